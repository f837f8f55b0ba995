"""A store as one profile type counts it (query/types.py says what each counts).

Off-CPU rows live beside the samples under label sets carrying __type__="offcpu" (ingest adds it), and idle
threads' off-CPU rows also carry __thread__="idle": a typed view of the store only adds matchers, or for
`wall` merges the two, CPU samples scaled to nanoseconds by their sampling period."""

from __future__ import annotations

from collections.abc import Sequence

from fleetprof.collector.model.profile import IDLE_THREAD, OFFCPU, PROFILE_TYPE_NAME, THREAD_STATE_NAME, Stack
from fleetprof.collector.model.rows import Grouped, Selection, TimeSeries, period_ns
from fleetprof.collector.model.selector import Matcher, Selector
from fleetprof.collector.query.types import DEFAULT_THREADS, NS_HZ, THREADS, TYPES, UNITS
from fleetprof.collector.store.base import ProfileStore

_CPU = Matcher(PROFILE_TYPE_NAME, "=", "")
_OFFCPU = Matcher(PROFILE_TYPE_NAME, "=", OFFCPU)
_ACTIVE = Matcher(THREAD_STATE_NAME, "!=", IDLE_THREAD)


def _with(selector: Selector, *matchers: Matcher) -> Selector:
    return Selector((*selector.matchers, *matchers))


def _wall(cpu: Selection, off: Selection) -> Selection:
    """CPU samples in nanoseconds (a sampling period each) plus off-CPU nanoseconds, by stack."""
    period = period_ns(cpu.frequency_hz)
    stacks: dict[Stack, int] = {st: n * period for st, n in cpu.stacks.items()} if period else {}
    for st, n in off.stacks.items():
        stacks[st] = stacks.get(st, 0) + n
    return Selection(stacks, NS_HZ)


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
        if self.kind == "cpu":
            return self.store.select(_with(selector, _CPU), start, end)
        off = self.store.select(_with(selector, *self._off), start, end)
        if self.kind == "offcpu":
            return Selection(off.stacks, NS_HZ)
        return _wall(self.store.select(_with(selector, _CPU), start, end), off)

    def select_with_wall(self, selector: Selector, start: float, end: float) -> tuple[Selection, Selection]:
        """This view's selection and the wall view's of active threads (what the per-pod GPU report shows
        of a pod's idle time), from the store's selects the two share."""
        cpu = self.store.select(_with(selector, _CPU), start, end)
        active = self.store.select(_with(selector, _OFFCPU, _ACTIVE), start, end)
        wall = _wall(cpu, active)
        if self.kind == "cpu":
            return cpu, wall
        off = active if self.threads == "active" else self.store.select(_with(selector, _OFFCPU), start, end)
        return (Selection(off.stacks, NS_HZ) if self.kind == "offcpu" else _wall(cpu, off)), wall

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
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
