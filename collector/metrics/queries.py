"""Query timing for any ProfileStore: a wrapper that records how long each query method takes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric

from fleetprof.collector.model.profile import SyscallAgg
from fleetprof.collector.model.rows import Grouped, ProfileRows, Selection, TimeSeries
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.store.base import ProfileStore

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class QueryTimer:
    """A Prometheus histogram of query durations by store method (`fleetprof_store_query_seconds`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}

    def observe(self, method: str, seconds: float) -> None:
        with self._lock:
            counts = self._counts.setdefault(method, [0] * (len(BOUNDS) + 1))
            i = next((j for j, b in enumerate(BOUNDS) if seconds <= b), len(BOUNDS))
            counts[i] += 1
            self._sums[method] = self._sums.get(method, 0.0) + seconds

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(
            "fleetprof_store_query_seconds", "Time the store took to answer a query", labels=["method"]
        )
        with self._lock:
            items = sorted((m, list(c), self._sums[m]) for m, c in self._counts.items())
        for method, counts, total in items:
            buckets, running = [], 0
            for bound, n in zip(BOUNDS, counts, strict=False):
                running += n
                buckets.append((f"{bound:g}", running))
            buckets.append(("+Inf", sum(counts)))
            fam.add_metric([method], buckets, sum_value=total)
        yield fam


class TimedStore:
    """Delegates to a store, timing every query method into a QueryTimer. Other attributes pass through."""

    def __init__(self, store: ProfileStore, timer: QueryTimer):
        self.inner = store
        self.timer = timer

    def __getattr__(self, name: str):  # write_logged, seen, ... of the wrapped store
        return getattr(self.inner, name)

    def _timed(self, method: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.timer.observe(method, time.perf_counter() - t0)

    def write(self, profile: ProfileRows) -> None:
        self.inner.write(profile)

    def select(self, selector: Selector, start: float, end: float) -> Selection:
        return self._timed("select", self.inner.select, selector, start, end)

    def select_groups(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], Selection]:
        return self._timed("select_groups", self.inner.select_groups, selector, start, end, by)

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        return self._timed("group", self.inner.group, selector, start, end, by)

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        return self._timed("series", self.inner.series, selector, start, end, step_s, by)

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        return self._timed("syscalls", self.inner.syscalls, selector, start, end, by)

    def label_names(
        self, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return self._timed("label_names", self.inner.label_names, start, end, match)

    def label_values(
        self, name: str, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return self._timed("label_values", self.inner.label_values, name, start, end, match)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
