"""Parse and evaluate PromQL-style label selectors such as {namespace="ml", pod=~"trainer-.*"}."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

OPERATORS = ("=", "!=", "=~", "!~")

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_WHITESPACE = " \t\r\n"
# Two-character operators first, so "=~" is not read as "=" followed by a stray "~".
_OPERATOR_TOKENS = ("=~", "!=", "!~", "=")
_SIMPLE_ESCAPES = MappingProxyType(
    {"a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "\\": 0x5C}
)
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCTAL_DIGITS = frozenset("01234567")
# \x and octal escapes give raw bytes (Go semantics), \u and \U give code points.
_ESCAPE_LENGTHS = MappingProxyType({"x": 2, "u": 4, "U": 8})


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
    regex: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not _LABEL_NAME.fullmatch(self.name):
            raise SelectorError(
                f'invalid label name "{self.name}": use letters, digits and "_", not first a digit'
            )
        if self.op not in OPERATORS:
            raise SelectorError(
                f'invalid operator "{self.op}" for label "{self.name}": use one of {_quoted_ops()}'
            )
        if self.op in ("=~", "!~"):
            try:
                # Prometheus compiles with RE2's DotNL, so "." also matches a newline there. Python's re
                # is close to RE2; RE2-only syntax such as \p{L} is rejected here as an invalid regex.
                compiled = re.compile(self.value, re.DOTALL)
            except re.error as err:
                where = f" (at offset {err.pos} in the regex)" if err.pos is not None else ""
                raise SelectorError(
                    f'invalid regex {quote(self.value)} for label "{self.name}": {err.msg}{where}'
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


@dataclass(frozen=True)
class Selector:
    """All of its matchers must hold; no matchers selects everything."""

    matchers: tuple[Matcher, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a label set is selected; a missing label reads as "", so {pod=""} finds pod-less series."""
        return all(matcher.matches(labels.get(matcher.name, "")) for matcher in self.matchers)

    def __str__(self) -> str:
        return "{" + ", ".join(str(matcher) for matcher in self.matchers) + "}"


def parse_selector(text: str) -> Selector:
    """Parse ``{name op "value", ...}``; empty or whitespace-only text selects everything."""
    return _Parser(text).parse()


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


def _quoted_ops() -> str:
    return ", ".join(f'"{op}"' for op in OPERATORS[:-1]) + f' or "{OPERATORS[-1]}"'


class _Parser:
    """Hand-written parser over one selector text; its only state is the cursor."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> Selector:
        self._skip_space()
        if self._at_end():
            return Selector()
        if _LABEL_NAME.match(self.text, self.pos):
            raise SelectorError(
                'a metric name before "{" is not supported; write only the braces, e.g. {pod="x"}',
                self.pos,
            )
        if self.text[self.pos] != "{":
            raise self._expected('"{"')
        self.pos += 1
        matchers: list[Matcher] = []
        while True:
            self._skip_space()
            if self._at_end():
                raise SelectorError('missing closing "}"', self.pos)
            if self.text[self.pos] == "}":
                self.pos += 1
                break
            matchers.append(self._matcher())
            self._skip_space()
            if self._at_end():
                raise SelectorError('missing closing "}"', self.pos)
            if self.text[self.pos] == ",":
                self.pos += 1  # a trailing comma before "}" is allowed, as in PromQL
            elif self.text[self.pos] != "}":
                raise self._expected(f'"," or "}}" after the value of label "{matchers[-1].name}"')
        self._skip_space()
        if not self._at_end():
            raise SelectorError(f'unexpected text after "}}": {self.text[self.pos :]!r}', self.pos)
        return Selector(tuple(matchers))

    def _matcher(self) -> Matcher:
        name_match = _LABEL_NAME.match(self.text, self.pos)
        if name_match is None:
            raise self._expected('label name or "}"')
        name = name_match.group()
        self.pos = name_match.end()
        self._skip_space()
        op = next((token for token in _OPERATOR_TOKENS if self.text.startswith(token, self.pos)), None)
        if op is None:
            raise self._expected(f'{_quoted_ops()} after label name "{name}"')
        self.pos += len(op)
        self._skip_space()
        value_start = self.pos
        value = self._string(f'a quoted value after "{name}{op}"')
        try:
            return Matcher(name, op, value)
        except SelectorError as err:
            raise SelectorError(err.reason, value_start) from None

    def _string(self, what: str) -> str:
        if self._at_end() or self.text[self.pos] not in "\"'`":
            raise self._expected(what)
        start = self.pos
        quote_char = self.text[start]
        self.pos += 1
        if quote_char == "`":
            end = self.text.find("`", self.pos)
            if end < 0:
                raise SelectorError("unterminated raw string (missing closing `)", start)
            self.pos = end + 1
            return self.text[start + 1 : end]
        return self._interpreted_string(quote_char, start)

    def _interpreted_string(self, quote_char: str, start: int) -> str:
        # Build bytes, since Go's \x and octal escapes are bytes that may form UTF-8 together.
        out = bytearray()
        while True:
            if self._at_end() or self.text[self.pos] == "\n":
                raise SelectorError(f"unterminated string (missing closing {quote_char})", start)
            char = self.text[self.pos]
            if char == quote_char:
                self.pos += 1
                break
            if char == "\\":
                self._escape(quote_char, start, out)
            else:
                out += char.encode("utf-8", "surrogatepass")
                self.pos += 1
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            raise SelectorError(
                "string is not valid UTF-8 (check its \\x and octal escapes)", start
            ) from None

    def _escape(self, quote_char: str, string_start: int, out: bytearray) -> None:
        escape_start = self.pos
        self.pos += 1
        if self._at_end():
            raise SelectorError(f"unterminated string (missing closing {quote_char})", string_start)
        kind = self.text[self.pos]
        self.pos += 1
        if kind == quote_char:
            out += kind.encode()
        elif kind in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[kind])
        elif kind in _ESCAPE_LENGTHS:
            digits = self.text[self.pos : self.pos + _ESCAPE_LENGTHS[kind]]
            if len(digits) != _ESCAPE_LENGTHS[kind] or not set(digits) <= _HEX_DIGITS:
                raise SelectorError(
                    f"\\{kind} needs exactly {_ESCAPE_LENGTHS[kind]} hex digits", escape_start
                )
            self.pos += len(digits)
            number = int(digits, 16)
            if kind == "x":
                out.append(number)
            elif number > 0x10FFFF or 0xD800 <= number <= 0xDFFF:
                raise SelectorError(f"\\{kind}{digits} is not a valid Unicode code point", escape_start)
            else:
                out += chr(number).encode("utf-8")
        elif kind in _OCTAL_DIGITS:
            digits = self.text[self.pos - 1 : self.pos + 2]
            if len(digits) != 3 or not set(digits) <= _OCTAL_DIGITS or int(digits, 8) > 0xFF:
                raise SelectorError("octal escape needs exactly 3 digits, at most \\377", escape_start)
            self.pos += 2
            out.append(int(digits, 8))
        else:
            raise SelectorError(f"unknown escape sequence \\{kind}", escape_start)

    def _expected(self, what: str) -> SelectorError:
        found = "end of text" if self._at_end() else repr(self.text[self.pos])
        return SelectorError(f"expected {what}, found {found}", self.pos)

    def _skip_space(self) -> None:
        while not self._at_end() and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def _at_end(self) -> bool:
        return self.pos >= len(self.text)
