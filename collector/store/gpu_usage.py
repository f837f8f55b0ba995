"""Per-pod GPU usage over time (utilization, memory, idle fraction per window; and the exact activity where
the pod loads the CUPTI library), for /api/v1/gpus.

Kept in memory for the collector's retention (at most a day): it is small (one row per pod and GPU per
window) and what it answers — "which pods' GPUs idled in the last minutes" — is about recent time. The
CPU side of the question (what the CPUs did meanwhile) lives in the profile store, under the samples'
`gpu_state` label.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleetprof.collector.model.gpu import POD_GPU_LABELS, GpuWindow, PodGpuActivity, PodGpuSummary
from fleetprof.collector.model.selector import Selector


@dataclass(frozen=True)
class PodGpuWindow:
    """One pod's use of one GPU during one agent window."""

    start: float  # unix seconds
    end: float
    labels: dict[str, str]  # node, namespace, pod, container, gpu
    utilization: float | None  # ratio 0..1 (mean over the window)
    memory_bytes: int | None  # the most it held
    idle_ratio: float | None  # of the polls with a known utilization, the share below the idle threshold


@dataclass(frozen=True)
class PodActivityWindow:
    """One pod's exact activity on one GPU during one agent window."""

    start: float
    end: float
    labels: dict[str, str]  # node, namespace, pod, container, gpu
    activity: PodGpuActivity


def activity_windows(window: GpuWindow) -> list[PodActivityWindow]:
    """One ingested window's per-pod exact GPU activity, a row per pod and GPU."""
    return [
        PodActivityWindow(window.start, window.end, dict(zip(POD_GPU_LABELS, key, strict=True)), act)
        for key, act in window.activity.items()
    ]


def pod_windows(window: GpuWindow) -> list[PodGpuWindow]:
    """One ingested window's per-pod GPU use, a row per pod and GPU."""
    return [
        PodGpuWindow(
            window.start,
            window.end,
            dict(zip(POD_GPU_LABELS, key, strict=True)),
            use.utilization,
            int(use.memory_bytes) if use.memory_bytes is not None else None,
            use.idle_ratio,
        )
        for key, use in window.pods.items()
    ]


class GpuUsageLog:
    """Thread-safe ring of PodGpuWindows, fed by ingest (deduplicated batches only)."""

    def __init__(
        self, retention_s: float = 3600.0, max_rows: int = 500_000, clock: Callable[[], float] = time.time
    ):
        self._retention_s = min(retention_s, 86400.0)
        self._rows: deque[PodGpuWindow] = deque(maxlen=max_rows)
        self._activity: deque[PodActivityWindow] = deque(maxlen=max_rows)
        self._lock = threading.Lock()
        self._clock = clock

    def observe(self, window: GpuWindow) -> None:
        """Record one ingested window's per-pod GPU use and exact activity."""
        if not window.pods and not window.activity:
            return
        rows, activity = pod_windows(window), activity_windows(window)
        horizon = self._clock() - self._retention_s
        with self._lock:
            self._rows.extend(rows)
            self._activity.extend(activity)
            for kept in (self._rows, self._activity):
                while kept and kept[0].end < horizon:
                    kept.popleft()

    def pods(self, selector: Selector, start: float, end: float) -> list[PodGpuSummary]:
        """Per pod (namespace, pod), the windows overlapping [start, end) that match the selector."""
        with self._lock:
            rows = [r for r in self._rows if r.end > start and r.start < end and selector.matches(r.labels)]
            acts = [
                r for r in self._activity if r.end > start and r.start < end and selector.matches(r.labels)
            ]
        return summarize(rows, acts)


def summarize(
    rows: Iterable[PodGpuWindow], activity: Iterable[PodActivityWindow] = ()
) -> list[PodGpuSummary]:
    """Per pod (namespace, pod), what `rows` and `activity` add up to; the pods whose GPUs idled most first
    (exactly where the activity says, else by NVML's polls)."""
    out: dict[tuple[str, str], PodGpuSummary] = {}
    memory_by_window: dict[tuple[str, str, float, str], int] = {}
    for r in rows:
        key = (r.labels["namespace"], r.labels["pod"])
        acc = out.setdefault(key, PodGpuSummary(*key))
        acc.gpus.add(f"{r.labels['node']}/{r.labels['gpu']}")
        secs = max(r.end - r.start, 0.0)
        acc.seconds += secs
        if r.utilization is not None:
            acc.util_seconds += r.utilization * secs
            acc.util_known_seconds += secs
        if r.idle_ratio is not None:
            acc.idle_seconds += r.idle_ratio * secs
            acc.idle_known_seconds += secs
        if r.memory_bytes is not None:
            wkey = (*key, r.end, r.labels["node"])
            memory_by_window[wkey] = memory_by_window.get(wkey, 0) + r.memory_bytes
    for (ns, pod, _end, _node), mem in memory_by_window.items():
        acc = out[(ns, pod)]
        acc.memory_bytes = max(acc.memory_bytes or 0, mem)
    for r in activity:
        key = (r.labels["namespace"], r.labels["pod"])
        acc = out.setdefault(key, PodGpuSummary(*key))
        acc.gpus.add(f"{r.labels['node']}/{r.labels['gpu']}")
        a = r.activity
        acc.activity_known_seconds += a.known_ns / 1e9
        acc.activity_idle_seconds += a.idle_ns / 1e9
        acc.gaps += a.gaps
        for i, n in enumerate(a.gap_histogram):
            acc.gap_histogram[i] += n
        acc.longest_gap_seconds = max(acc.longest_gap_seconds, a.longest_gap_ns / 1e9)
        acc.records_lost += a.records_lost
    return sorted(out.values(), key=lambda p: (-(p.idle_ratio or 0.0), p.namespace, p.pod))
