"""Prometheus series for syscalls per pod: exact counts and a latency histogram, with a cardinality cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from fleetprof.collector.model.profile import SyscallRow

SERIES_LABELS = ("node", "namespace", "pod", "container", "syscall")
# Histogram bounds: every second power of two from 1 µs to 17 s (2^10 .. 2^34 ns). Syscalls live in the µs
# range, where Prometheus's default buckets (5 ms and up) say nothing.
BUCKET_LOG2 = tuple(range(10, 36, 2))
OTHER = "other"


@dataclass
class _Series:
    count: int = 0
    timed: int = 0
    timed_ns: int = 0
    # Not cumulative; the extra last slot holds latencies beyond the largest bound (+Inf only).
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKET_LOG2) + 1))
    last_update: float = 0.0


class SyscallMetrics:
    """Cumulative since the collector started. Each pod (node, namespace, pod, container) gets its own
    series for its first `per_pod_limit` syscalls; later ones are summed into syscall="other". Once a
    syscall has a series it keeps it, so every counter stays monotonic. Series idle for `expire_s`
    (a deleted pod) are dropped."""

    def __init__(
        self, per_pod_limit: int = 12, expire_s: float = 3600.0, clock: Callable[[], float] = time.time
    ):
        self._limit = per_pod_limit
        self._expire_s = expire_s
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], _Series] = {}
        self._named: dict[tuple[str, ...], set[str]] = {}  # pod key -> syscalls with their own series

    def observe(self, rows: Sequence[SyscallRow]) -> None:
        now = self._clock()
        with self._lock:
            for labels, name, agg in rows:
                lb = dict(labels)
                pod_key = (
                    lb.get("node", ""),
                    lb.get("namespace", ""),
                    lb.get("pod", ""),
                    lb.get("container", ""),
                )
                named = self._named.setdefault(pod_key, set())
                if name not in named and len(named) < self._limit:
                    named.add(name)
                series = self._series.setdefault((*pod_key, name if name in named else OTHER), _Series())
                series.count += agg.count
                series.timed += agg.timed
                series.timed_ns += agg.timed_ns
                series.last_update = now
                for i, n in enumerate(agg.hist):
                    if n:
                        series.buckets[_bucket_index(i)] += n
            self._expire(now)

    def _expire(self, now: float) -> None:
        stale = [k for k, s in self._series.items() if now - s.last_update > self._expire_s]
        for k in stale:
            del self._series[k]
        live_pods = {k[:4] for k in self._series}
        for pod_key in [p for p in self._named if p not in live_pods]:
            del self._named[pod_key]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = [(k, s.count, s.timed, s.timed_ns, list(s.buckets)) for k, s in self._series.items()]
        calls = CounterMetricFamily(
            "fleetprof_syscalls", "System calls, counted exactly in the kernel", labels=list(SERIES_LABELS)
        )
        latency = HistogramMetricFamily(
            "fleetprof_syscall_duration_seconds",
            "Latency of timed syscalls (the agent times one call in N; fleetprof_syscalls_total is exact)",
            labels=list(SERIES_LABELS),
        )
        for key, count, timed, timed_ns, buckets in sorted(items):
            calls.add_metric(list(key), count)
            cumulative, running = [], 0
            for k, n in zip(BUCKET_LOG2, buckets[:-1], strict=True):
                running += n
                cumulative.append((f"{(1 << k) / 1e9:.9g}", running))
            cumulative.append(("+Inf", timed))
            latency.add_metric(list(key), cumulative, sum_value=timed_ns / 1e9)
        yield calls
        yield latency


def _bucket_index(log2_bucket: int) -> int:
    """The Prometheus bucket holding latencies in [2^i, 2^(i+1)) ns: the first bound >= 2^(i+1), or the
    overflow slot past the largest bound."""
    upper = log2_bucket + 1
    for j, k in enumerate(BUCKET_LOG2):
        if upper <= k:
            return j
    return len(BUCKET_LOG2)
