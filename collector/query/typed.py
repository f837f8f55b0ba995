"""Profile types: what a query counts. `cpu` is CPU samples (today's profiles); `offcpu` is nanoseconds
threads spent switched out, by the stack they left with; `wall` is both in nanoseconds (CPU samples ×
the sampling period, plus off-CPU time): where a thread's time went, running or waiting.

Off-CPU rows live beside the samples under label sets carrying __type__="offcpu" (ingest adds it), so a
typed view of the store only adds a matcher, or for `wall` merges the two. Idle threads' off-CPU rows
(pools waiting for work: the agent's verdict, per window) also carry __thread__="idle"; `threads` says
whether a view counts them: `all` (the default for offcpu: where threads wait, all of them) or `active`
(the default for wall, so that a pod's sleeping pools do not drown where its working threads' time went)."""

from __future__ import annotations

from collections.abc import Sequence

from fleetprof.collector.model.profile import IDLE_THREAD, OFFCPU, PROFILE_TYPE_NAME, THREAD_STATE_NAME, Stack
from fleetprof.collector.model.rows import Grouped, Selection, TimeSeries
from fleetprof.collector.model.selector import Matcher, Selector
from fleetprof.collector.store.base import ProfileStore

TYPES = ("cpu", "offcpu", "wall")
UNITS = {"cpu": "samples", "offcpu": "nanoseconds", "wall": "nanoseconds"}
THREADS = ("active", "all")
DEFAULT_THREADS = {"cpu": "all", "offcpu": "all", "wall": "active"}
# Nanoseconds read as samples at 1 GHz, so every renderer that turns samples into seconds with the
# frequency shows nanosecond profiles in seconds too.
NS_HZ = 1_000_000_000
_CPU = Matcher(PROFILE_TYPE_NAME, "=", "")
_OFFCPU = Matcher(PROFILE_TYPE_NAME, "=", OFFCPU)
_ACTIVE = Matcher(THREAD_STATE_NAME, "!=", IDLE_THREAD)


def _with(selector: Selector, *matchers: Matcher) -> Selector:
    return Selector((*selector.matchers, *matchers))


def period_ns(frequency_hz: int | None) -> int:
    return round(1e9 / frequency_hz) if frequency_hz else 0


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
        cpu = self.store.select(_with(selector, _CPU), start, end)
        period = period_ns(cpu.frequency_hz)
        stacks: dict[Stack, int] = {st: n * period for st, n in cpu.stacks.items()} if period else {}
        for st, n in off.stacks.items():
            stacks[st] = stacks.get(st, 0) + n
        return Selection(stacks, NS_HZ)

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
