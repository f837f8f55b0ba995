"""Label selectors as values: matchers that every stage evaluates the same way (the text form is parsed by
collector/query/selector.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import re2

from fleetprof.collector.model.profile import Labels

OPERATORS = ("=", "!=", "=~", "!~")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Prometheus compiles with RE2's DotNL: "." also matches a newline.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.dot_nl = True
_RE2_OPTIONS.log_errors = False  # the error goes to the user as a SelectorError, not to stderr
# RE2's default 8 MiB lets a long regex exhaust its DFA cache and fall back to a 16x slower NFA: (a+)+
# repeated 2,000 times took 1.1 s on a 1 KiB value, 0.07 s with 32 MiB (allocated only as states are met).
_RE2_OPTIONS.max_mem = 32 << 20


class SelectorError(ValueError):
    """A selector that cannot be parsed or a matcher that cannot be built.

    ``position`` is the 0-based character offset in the selector text where parsing stopped,
    or None when the error is not tied to a place in a text.
    """

    def __init__(self, message: str, position: int | None = None) -> None:
        self.reason = message
        self.position = position
        where = f" at position {position}" if position is not None else ""
        super().__init__(f"bad selector{where}: {message}")


@dataclass(frozen=True)
class Matcher:
    """One label condition: ``name op "value"``. Regexes match the whole value, as in PromQL."""

    name: str
    op: str
    value: str
    regex: re2._Regexp | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not LABEL_NAME.fullmatch(self.name):
            raise SelectorError(
                f'invalid label name "{self.name}": use letters, digits and "_", not first a digit'
            )
        if self.op not in OPERATORS:
            raise SelectorError(
                f'invalid operator "{self.op}" for label "{self.name}": use one of {quoted_operators()}'
            )
        if self.op in ("=~", "!~"):
            try:
                # RE2, as Prometheus: matching runs in time linear in the value, so no selector can make a
                # query backtrack for ever (Python's re takes minutes on (a+)+b against 30 a's).
                compiled = re2.compile(self.value, _RE2_OPTIONS)
            except re2.error as err:
                reason = err.args[0].decode() if err.args and isinstance(err.args[0], bytes) else str(err)
                raise SelectorError(
                    f'invalid regex {quote(self.value)} for label "{self.name}": {reason} (regexes use RE2 '
                    "syntax, as in Prometheus: no backreferences or lookaround)"
                ) from None
            object.__setattr__(self, "regex", compiled)

    def matches(self, value: str) -> bool:
        """Whether a label value satisfies this condition."""
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        assert self.regex is not None  # set in __post_init__ for both regex operators
        found = self.regex.fullmatch(value) is not None
        return found if self.op == "=~" else not found

    def __str__(self) -> str:
        return f"{self.name}{self.op}{quote(self.value)}"


# Labels no series stores but every stage reads the same way. `service_name` is what Grafana's Profiles
# Drilldown groups by: the pod's workload, else the process name.
DERIVED_LABELS = {"service_name": lambda labels: labels.get("workload") or labels.get("comm", "")}


def label_value(labels: Mapping[str, str], name: str) -> str:
    """A label's value in a set: stored, derived, or "" where the set has none."""
    value = labels.get(name)
    if value is None:
        derive = DERIVED_LABELS.get(name)
        return derive(labels) if derive is not None else ""
    return value


@dataclass(frozen=True)
class Selector:
    """All of its matchers must hold; no matchers selects everything."""

    matchers: tuple[Matcher, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a label set is selected; a missing label reads as "", so {pod=""} finds pod-less series."""
        return all(matcher.matches(label_value(labels, matcher.name)) for matcher in self.matchers)

    def __str__(self) -> str:
        return "{" + ", ".join(str(matcher) for matcher in self.matchers) + "}"


def quote(value: str) -> str:
    """Write a value as a double-quoted string that parse_selector reads back unchanged."""
    out = ['"']
    for char in value:
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def quoted_operators() -> str:
    return ", ".join(f'"{op}"' for op in OPERATORS[:-1]) + f' or "{OPERATORS[-1]}"'


def matching_sets(sets: Iterable[Labels], match: Sequence[Selector]) -> list[Labels]:
    """The label sets some selector of `match` matches (all of them when `match` is empty): what the
    label-name and label-value listings take `match[]` to mean, as Prometheus does."""
    if not match or any(not m.matchers for m in match):
        return list(sets)
    out = []
    for lb in sets:
        d = dict(lb)
        if any(m.matches(d) for m in match):
            out.append(lb)
    return out


def names_in(sets: Iterable[Labels], match: Sequence[Selector]) -> list[str]:
    """The label names of the sets `match` matches (matching_sets), sorted: every store's label listing."""
    return sorted({k for labels in matching_sets(sets, match) for k, _ in labels})


def values_in(sets: Iterable[Labels], name: str, match: Sequence[Selector]) -> list[str]:
    """The values label `name` takes in the sets `match` matches, sorted."""
    return sorted({v for labels in matching_sets(sets, match) for k, v in labels if k == name})
