"""Per-pod GPU usage over time (utilization, memory, idle fraction per window), for /api/v1/gpus.

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

from fleetprof.collector.model.gpu import POD_GPU_LABELS, GpuWindow, PodGpuSummary
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
        self._lock = threading.Lock()
        self._clock = clock

    def observe(self, window: GpuWindow) -> None:
        """Record one ingested window's per-pod GPU use."""
        if not window.pods:
            return
        rows = pod_windows(window)
        horizon = self._clock() - self._retention_s
        with self._lock:
            self._rows.extend(rows)
            while self._rows and self._rows[0].end < horizon:
                self._rows.popleft()

    def pods(self, selector: Selector, start: float, end: float) -> list[PodGpuSummary]:
        """Per pod (namespace, pod), the windows overlapping [start, end) that match the selector."""
        with self._lock:
            rows = [r for r in self._rows if r.end > start and r.start < end and selector.matches(r.labels)]
        return summarize(rows)


def summarize(rows: Iterable[PodGpuWindow]) -> list[PodGpuSummary]:
    """Per pod (namespace, pod), what `rows` add up to; the pods whose GPUs idled most first."""
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
    return sorted(out.values(), key=lambda p: (-(p.idle_ratio or 0.0), p.namespace, p.pod))
