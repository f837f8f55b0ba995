"""What queries say about labels: the names and values listed, the GPU filter, and the notes an answer
carries about the labels it used (a label no series in the range has, and why an empty answer is empty)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetprof.collector.model.profile import GPU_STATE_NAME, internal_label
from fleetprof.collector.model.selector import Matcher, Selector
from fleetprof.collector.store.base import ProfileStore

GPU_STATES = ("idle", "busy")
# Grouped by pod, a process without one (a host process: no Kubernetes, or outside any pod) is grouped by
# its comm, as "comm:NAME" in the pod column, rather than all of them as one empty pod.
POD = "pod"
HOST_GROUP_PREFIX = "comm:"


def with_gpu_state(selector: Selector, state: str) -> Selector:
    """Only the CPU samples taken while the process's GPUs were `state` (idle or busy)."""
    if state not in GPU_STATES:
        raise ValueError(f"a GPU state is one of {', '.join(GPU_STATES)}, not {state!r}")
    return Selector((*selector.matchers, Matcher(GPU_STATE_NAME, "=", state)))


def label_names(
    store: ProfileStore, start: float | None, end: float | None, match: Sequence[Selector] = ()
) -> list[str]:
    """The label names of the label sets with data in range (of those `match` selects), sorted, less the
    collector's own (__type__ and __thread__ mark off-CPU rows: a query's type and threads select on them)."""
    return [n for n in store.label_names(start, end, match) if not internal_label(n)]


@dataclass(frozen=True)
class Notes:
    """The "warnings" and "empty_reason" of an answer: label names its selector or `by` use that no series
    in the range has (a typo, or a label this fleet lacks: no Kubernetes metadata), and why an empty answer
    is empty: "no_match" (the range holds data, the selector matched none of it) or "no_data" (nothing
    stored in the range)."""

    warnings: list[str]
    empty_reason: str | None


def notes(
    store: ProfileStore, total: int, selector: Selector, start: float, end: float, by: Sequence[str] = ()
) -> Notes:
    """The notes of an answer of `total` over the selector's series in [start, end), grouped by `by`. The
    range's labels are read only when the answer is empty or grouped: a selector that matched something
    needs no check (a missing label can match only with `!=`, `!~` or an empty value), and most queries pay
    nothing."""
    names = [m.name for m in selector.matchers if not internal_label(m.name)]
    if not by and (total or not names):
        return Notes([], None if total else "no_data")
    known = label_names(store, start, end)
    warnings = _label_warnings(names + list(by), by, known)
    reason = None if total else "no_match" if names and known else "no_data"
    if reason == "no_match":
        warnings.append(f"the selector {selector} matched nothing in this range, which holds other data")
    return Notes(warnings, reason)


def _label_warnings(names: list[str], by: Sequence[str], known: list[str]) -> list[str]:
    """Warnings for the label names a query uses (its selector's, then `by`) that no series in the range
    has, naming the labels there are (`known`: empty when the range holds nothing, then none)."""
    there = f"the labels in this range: {', '.join(known)}"
    out = []
    for name in dict.fromkeys(names):
        if not known or name in known:
            continue
        if name == GPU_STATE_NAME:
            out.append(f"no series in this range has a GPU state (gpu= needs processes on GPUs); {there}")
        elif name == POD and name in by:
            out.append(
                'no series in this range has the label "pod" (no Kubernetes metadata?): processes'
                f" without a pod are grouped as {HOST_GROUP_PREFIX}NAME; {there}"
            )
        else:
            out.append(f'no series in this range has the label "{name}"; {there}')
    return out
