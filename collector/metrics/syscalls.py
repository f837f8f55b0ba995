"""Prometheus series for syscalls per pod, and CUDA API calls per pod the same way: exact counts and a latency
histogram, with a cardinality cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from fleetprof.collector.model.profile import SyscallRow

SERIES_LABELS = ("node", "namespace", "pod", "container", "syscall")


@dataclass(frozen=True)
class CallFamilies:
    """What a SyscallMetrics exports: its two families' names and help, and its call-name label."""

    calls: str
    calls_help: str
    duration: str
    duration_help: str
    name_label: str


SYSCALL_FAMILIES = CallFamilies(
    "fleetprof_syscalls",
    "System calls, counted exactly in the kernel",
    "fleetprof_syscall_duration_seconds",
    "Latency of timed syscalls (the agent times one call in N; fleetprof_syscalls_total is exact)",
    "syscall",
)
# CUDA API calls (synchronizations, copies, allocations, NCCL), counted by uprobes: the same shape, series
# per pod and the same cap and buckets (their latencies span µs to seconds too).
CUDA_FAMILIES = CallFamilies(
    "fleetprof_cuda_calls",
    "CUDA API calls where the CPU waits for the GPU or the allocator, counted exactly by uprobes",
    "fleetprof_cuda_call_duration_seconds",
    "Latency of timed CUDA API calls, entry to return",
    "call",
)
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


@dataclass
class _Pod:
    """One pod's ranking: each syscall's recent volume (calls, decayed with VOLUME_HALF_LIFE_S), and the
    syscalls whose calls go to their own series now (in the order they were named)."""

    volume: dict[str, float] = field(default_factory=dict)
    named: dict[str, None] = field(default_factory=dict)
    decayed_at: float = 0.0


# A syscall's volume is its calls with a half-life: the ranking follows what a pod does now (a rollout, a
# new phase) within minutes, not what it did once.
VOLUME_HALF_LIFE_S = 300.0
# A syscall outside the top takes the place of the weakest one in it only once its volume is this much
# larger, so two syscalls of about equal volume at the edge do not swap at every batch (each swap leaves
# a series that ages out an hour later).
PROMOTE_RATIO = 1.25


class SyscallMetrics:
    """Cumulative since the collector started. Each pod (node, namespace, pod, container; host processes
    share empty pod labels) gets its own series for the `per_pod_limit` syscalls of the largest recent
    volume, re-ranked at each batch; calls of the rest are summed into syscall="other", so "other" holds
    the tail only.

    Every exported counter only grows: a call is counted once, in the series its syscall had when the call
    was counted. A syscall that joins the top starts (or resumes) its own series from then on, and its
    earlier calls stay in "other"; one that leaves it keeps its series, unchanged, while its new calls go
    to "other", until the series has been idle for `expire_s` and is dropped (a deleted pod's series go
    the same way). So a pod exports its top `per_pod_limit` plus those that left the top within the last
    `expire_s`, and `sum by (pod)` is exact at every moment."""

    def __init__(
        self,
        per_pod_limit: int = 12,
        expire_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        families: CallFamilies = SYSCALL_FAMILIES,
    ):
        self._families = families
        self._limit = per_pod_limit
        self._expire_s = expire_s
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], _Series] = {}
        self._pods: dict[tuple[str, ...], _Pod] = {}

    def observe(self, rows: Sequence[SyscallRow]) -> None:
        now = self._clock()
        # A batch's calls per pod and syscall first: the ranking sees the whole batch before any call is
        # routed, so a batch's biggest syscall never lands in "other" for arriving after small ones.
        per_pod: dict[tuple[str, ...], dict[str, list]] = {}
        for labels, name, agg in rows:
            lb = dict(labels)
            pod_key = (
                lb.get("node", ""),
                lb.get("namespace", ""),
                lb.get("pod", ""),
                lb.get("container", ""),
            )
            per_pod.setdefault(pod_key, {}).setdefault(name, []).append(agg)
        with self._lock:
            for pod_key, calls in per_pod.items():
                pod = self._pods.setdefault(pod_key, _Pod(decayed_at=now))
                self._decay(pod, now)
                for name, aggs in calls.items():
                    pod.volume[name] = pod.volume.get(name, 0.0) + sum(a.count for a in aggs)
                self._rerank(pod)
                for name, aggs in calls.items():
                    series = self._series.setdefault(
                        (*pod_key, name if name in pod.named else OTHER), _Series()
                    )
                    series.last_update = now
                    for agg in aggs:
                        series.count += agg.count
                        series.timed += agg.timed
                        series.timed_ns += agg.timed_ns
                        for i, n in enumerate(agg.hist):
                            if n:
                                series.buckets[_bucket_index(i)] += n
            self._expire(now)

    @staticmethod
    def _decay(pod: _Pod, now: float) -> None:
        if now <= pod.decayed_at:
            return
        factor = 0.5 ** ((now - pod.decayed_at) / VOLUME_HALF_LIFE_S)
        pod.decayed_at = now
        for name in pod.volume:
            pod.volume[name] *= factor

    def _rerank(self, pod: _Pod) -> None:
        """The pod's top `per_pod_limit` syscalls by volume, with PROMOTE_RATIO of hysteresis."""
        volume, named = pod.volume, pod.named
        outside = sorted((n for n in volume if n not in named), key=lambda n: -volume[n])  # stable: arrival
        for name in outside:
            if len(named) < self._limit:
                named[name] = None
                continue
            # The weakest named syscall; among equals the one named last, so the first named keep theirs.
            weakest = min(reversed(named), key=lambda n: volume.get(n, 0.0))
            if volume[name] <= PROMOTE_RATIO * volume.get(weakest, 0.0):
                break  # the rest of `outside` is smaller still
            del named[weakest]
            named[name] = None

    def _expire(self, now: float) -> None:
        stale = [k for k, s in self._series.items() if now - s.last_update > self._expire_s]
        for k in stale:
            del self._series[k]
        live_pods = {k[:4] for k in self._series}
        for pod_key in [p for p in self._pods if p not in live_pods]:
            del self._pods[pod_key]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = [(k, s.count, s.timed, s.timed_ns, list(s.buckets)) for k, s in self._series.items()]
        fam = self._families
        labels = [*SERIES_LABELS[:-1], fam.name_label]
        calls = CounterMetricFamily(fam.calls, fam.calls_help, labels=labels)
        latency = HistogramMetricFamily(fam.duration, fam.duration_help, labels=labels)
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
