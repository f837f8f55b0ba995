"""A store as one profile type counts it (query/types.py says what each counts).

Off-CPU rows live beside the samples under label sets carrying __type__="offcpu" (ingest adds it), and idle
threads' off-CPU rows also carry __thread__="idle": a typed view of the store only adds matchers, or for
`wall` merges the two, CPU samples scaled to nanoseconds by their sampling period. CUDA launches and GPU
kernel time are rows under __type__="cuda_launch" and "gpu": their views only add the matcher."""

from __future__ import annotations

from collections.abc import Sequence

from fleetprof.collector.model.profile import (
    CUDA_LAUNCH,
    GPU_KERNELS,
    IDLE_THREAD,
    OFFCPU,
    PROFILE_TYPE_NAME,
    THREAD_STATE_NAME,
    Stack,
)
from fleetprof.collector.model.rows import Grouped, Selection, TimeSeries, period_ns
from fleetprof.collector.model.selector import Matcher, Selector
from fleetprof.collector.query.types import DEFAULT_THREADS, NS_HZ, THREADS, TYPES, UNITS
from fleetprof.collector.store.base import ProfileStore

_CPU = Matcher(PROFILE_TYPE_NAME, "=", "")
_OFFCPU = Matcher(PROFILE_TYPE_NAME, "=", OFFCPU)
_ACTIVE = Matcher(THREAD_STATE_NAME, "!=", IDLE_THREAD)
# Types read straight from their own rows: the matcher, and the frequency their counts are read at (GPU
# nanoseconds as samples at 1 GHz, as off-CPU's; launches have none: they are no time).
_OWN_ROWS = {
    "cuda_launch": (Matcher(PROFILE_TYPE_NAME, "=", CUDA_LAUNCH), None),
    "gpu": (Matcher(PROFILE_TYPE_NAME, "=", GPU_KERNELS), NS_HZ),
}


def _with(selector: Selector, *matchers: Matcher) -> Selector:
    return Selector((*selector.matchers, *matchers))


def _in_ns(cpu: Selection) -> dict[Stack, int]:
    """CPU samples in nanoseconds (a sampling period each), by stack."""
    period = period_ns(cpu.frequency_hz)
    return {st: n * period for st, n in cpu.stacks.items()} if period else {}


def _wall(cpu: Selection, off: Selection) -> Selection:
    """CPU samples in nanoseconds plus off-CPU nanoseconds, by stack."""
    stacks = _in_ns(cpu)
    for st, n in off.stacks.items():
        stacks[st] = stacks.get(st, 0) + n
    return Selection(stacks, NS_HZ)


def _merged(parts: list[Selection]) -> Selection:
    """Selections of one profile type summed by stack, at the frequency of the one with most samples (the
    CPU samples of a group are one part: they carry no thread state)."""
    if len(parts) == 1:
        return parts[0]
    stacks: dict[Stack, int] = {}
    for sel in parts:
        for st, n in sel.stacks.items():
            stacks[st] = stacks.get(st, 0) + n
    return Selection(stacks, max(parts, key=lambda s: s.total).frequency_hz if parts else None)


class TypedStore:
    """A store's select, group and series as one profile type counts them."""

    def __init__(self, store: ProfileStore, kind: str = "cpu", threads: str | None = None):
        if kind not in TYPES:
            raise ValueError(f"unknown profile type {kind!r}: use one of {', '.join(TYPES)}")
        threads = threads or DEFAULT_THREADS[kind]
        if threads not in THREADS:
            raise ValueError(f"unknown thread choice {threads!r}: use one of {', '.join(THREADS)}")
        self.store = store
        self.kind = kind
        self.unit = UNITS[kind]
        self.threads = threads  # CPU samples are every thread's: only off-CPU rows are told apart
        self._off = (_OFFCPU, _ACTIVE) if threads == "active" else (_OFFCPU,)

    def select(self, selector: Selector, start: float, end: float) -> Selection:
        if self.kind in _OWN_ROWS:
            matcher, hz = _OWN_ROWS[self.kind]
            return Selection(self.store.select(_with(selector, matcher), start, end).stacks, hz)
        if self.kind == "cpu":
            return self.store.select(_with(selector, _CPU), start, end)
        off = self.store.select(_with(selector, *self._off), start, end)
        if self.kind == "offcpu":
            return Selection(off.stacks, NS_HZ)
        return _wall(self.store.select(_with(selector, _CPU), start, end), off)

    def select_apart(self, selector: Selector, start: float, end: float) -> tuple[Selection, Selection]:
        """An off-CPU or wall view's two halves before they merge: its CPU samples in nanoseconds (none for
        offcpu) and its off-CPU time. A ranking of waits reads them apart: a stack alone does not say
        whether it ran or waited."""
        if self.kind == "cpu":
            raise ValueError("a CPU view has no off-CPU half")
        off = Selection(self.store.select(_with(selector, *self._off), start, end).stacks, NS_HZ)
        if self.kind == "offcpu":
            return Selection({}, NS_HZ), off
        return Selection(_in_ns(self.store.select(_with(selector, _CPU), start, end)), NS_HZ), off

    def select_with_wall_by(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], tuple[Selection, Selection, Selection]]:
        """Per group of `by` with samples: this view's selection, and the wall view's of active threads in
        its two halves, its CPU samples in nanoseconds and its off-CPU time (what the per-pod GPU report
        shows of each pod's idle time, and ranks by where it blocked). One select_groups of the store
        answers every group: its rows grouped by `by`, profile type and thread state, put together here."""
        types = ["", OFFCPU, *((_OWN_ROWS[self.kind][0].value,) if self.kind in _OWN_ROWS else ())]
        matchers = [Matcher(PROFILE_TYPE_NAME, "=~", "|".join(types))]
        every_thread = self.threads == "all" and self.kind in ("offcpu", "wall")
        if not every_thread:
            # __thread__ is on off-CPU rows only (ingest sets it; agents may not send "__" labels), so
            # this leaves the CPU samples whole.
            matchers.append(_ACTIVE)
        parts: dict[tuple[str, ...], dict[tuple[str, str], Selection]] = {}
        grouped = self.store.select_groups(
            _with(selector, *matchers), start, end, [*by, PROFILE_TYPE_NAME, THREAD_STATE_NAME]
        )
        for (*key, kind, thread), sel in grouped.items():
            parts.setdefault(tuple(key), {})[(kind, thread)] = sel
        return {key: self._with_wall(of) for key, of in parts.items()}

    def _with_wall(self, parts: dict[tuple[str, str], Selection]) -> tuple[Selection, Selection, Selection]:
        """select_with_wall_by's answer for one group from its selections by (profile type, thread state)."""
        cpu = _merged([sel for (kind, _), sel in parts.items() if kind == ""])
        active = _merged(
            [s for (kind, thread), s in parts.items() if kind == OFFCPU and thread != IDLE_THREAD]
        )
        running, waits = Selection(_in_ns(cpu), NS_HZ), Selection(active.stacks, NS_HZ)
        if self.kind == "cpu":
            return cpu, running, waits
        if self.kind in _OWN_ROWS:
            matcher, hz = _OWN_ROWS[self.kind]
            own = _merged([sel for (kind, _), sel in parts.items() if kind == matcher.value])
            return Selection(own.stacks, hz), running, waits
        off = active
        if self.threads == "all":
            off = _merged([sel for (kind, _), sel in parts.items() if kind == OFFCPU])
        return (Selection(off.stacks, NS_HZ) if self.kind == "offcpu" else _wall(cpu, off)), running, waits

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        if self.kind in _OWN_ROWS:
            matcher, hz = _OWN_ROWS[self.kind]
            own = self.store.group(_with(selector, matcher), start, end, by)
            return Grouped(own.by, own.totals, hz)
        if self.kind == "cpu":
            return self.store.group(_with(selector, _CPU), start, end, by)
        off = self.store.group(_with(selector, *self._off), start, end, by)
        if self.kind == "offcpu":
            return Grouped(off.by, off.totals, NS_HZ)
        cpu = self.store.group(_with(selector, _CPU), start, end, by)
        period = period_ns(cpu.frequency_hz)
        totals = {k: n * period for k, n in cpu.totals.items()} if period else {}
        for k, n in off.totals.items():
            totals[k] = totals.get(k, 0) + n
        return Grouped(off.by, totals, NS_HZ)

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        if self.kind in _OWN_ROWS:
            matcher, hz = _OWN_ROWS[self.kind]
            own = self.store.series(_with(selector, matcher), start, end, step_s, by)
            return TimeSeries(own.by, own.step_s, own.points, hz)
        if self.kind == "cpu":
            return self.store.series(_with(selector, _CPU), start, end, step_s, by)
        off = self.store.series(_with(selector, *self._off), start, end, step_s, by)
        if self.kind == "offcpu":
            return TimeSeries(off.by, off.step_s, off.points, NS_HZ)
        cpu = self.store.series(_with(selector, _CPU), start, end, step_s, by)
        period = period_ns(cpu.frequency_hz)
        points = {k: {t: n * period for t, n in p.items()} for k, p in cpu.points.items()} if period else {}
        for k, p in off.points.items():
            mine = points.setdefault(k, {})
            for t, n in p.items():
                mine[t] = mine.get(t, 0) + n
        return TimeSeries(off.by, off.step_s, points, NS_HZ)
