"""Per-pod GPU usage in ClickHouse: what collector/store/gpu_usage.py keeps in one collector's memory, here
shared by every collector (any of them answers /api/v1/gpus for the whole fleet).

Written when ingest reports a stored batch's GPU window, after the batch's rows: a collector killed
between the two loses that window's GPU summary (the resend is a duplicate), never samples, and never
counts a window twice."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fleetprof.collector.model.gpu import (
    GAP_BUCKETS,
    POD_GPU_LABELS,
    GpuWindow,
    PodGpuActivity,
    PodGpuSummary,
)
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.store.clickhouse.connection import Connection
from fleetprof.collector.store.clickhouse.schema import Layout
from fleetprof.collector.store.gpu_usage import (
    PodActivityWindow,
    PodGpuWindow,
    activity_windows,
    pod_windows,
    summarize,
)

_GAPS = [f"gap_{i}" for i in range(GAP_BUCKETS)]


class ClickHouseGpuUsage:
    """GpuUsageLog's face (observe, pods) over the `gpu_usage` and `gpu_activity` tables."""

    def __init__(
        self,
        conn: Connection,
        layout: Layout,
        insert_settings: dict,
        read_settings: dict,
        clock: Callable[[], float],
        retention_s: float,
    ):
        self._conn = conn
        self._table = layout.table("gpu_usage")
        self._activity = layout.table("gpu_activity")
        self._insert = insert_settings
        self._read = read_settings
        self._clock = clock
        self._retention_s = retention_s

    def observe(self, window: GpuWindow) -> None:
        self._observe_activity(activity_windows(window))
        rows = pod_windows(window)
        if not rows:
            return
        cols: dict = {
            "start": np.array([r.start for r in rows], dtype=np.float64),
            "end": np.array([r.end for r in rows], dtype=np.float64),
        }
        for name in POD_GPU_LABELS:
            cols[name] = np.array([r.labels[name] for r in rows], dtype=object)
        cols["utilization"] = np.array([r.utilization for r in rows], dtype=object)
        cols["memory_bytes"] = np.array([r.memory_bytes for r in rows], dtype=object)
        cols["idle_ratio"] = np.array([r.idle_ratio for r in rows], dtype=object)
        self._conn.insert(self._table, cols, settings=self._insert)

    def _observe_activity(self, rows: list[PodActivityWindow]) -> None:
        if not rows:
            return
        cols: dict = {
            "start": np.array([r.start for r in rows], dtype=np.float64),
            "end": np.array([r.end for r in rows], dtype=np.float64),
        }
        for name in POD_GPU_LABELS:
            cols[name] = np.array([r.labels[name] for r in rows], dtype=object)
        for name in ("known_ns", "idle_ns", "gaps", "longest_gap_ns", "records_lost"):
            cols[name] = np.array([getattr(r.activity, name) for r in rows], dtype=np.int64)
        for i, name in enumerate(_GAPS):
            cols[name] = np.array([r.activity.gap_histogram[i] for r in rows], dtype=np.int64)
        self._conn.insert(self._activity, cols, settings=self._insert)

    def _activity_rows(self, selector: Selector, start: float, end: float, horizon: float) -> list:
        fetched = self._conn.query(
            f"SELECT start, end, {', '.join(POD_GPU_LABELS)}, known_ns, idle_ns, gaps, {', '.join(_GAPS)}, "
            f"longest_gap_ns, records_lost FROM {self._activity} WHERE end > {float(start)!r} AND "
            f"start < {float(end)!r} AND end >= {float(horizon)!r} "
            "ORDER BY end, start, node, namespace, pod, container, gpu",
            settings=self._read,
        )
        out = []
        for r in fetched:
            labels = dict(zip(POD_GPU_LABELS, r[2:7], strict=True))
            if selector.matches(labels):
                hist = tuple(int(n) for n in r[10 : 10 + GAP_BUCKETS])
                rest = r[10 + GAP_BUCKETS :]
                act = PodGpuActivity(int(r[7]), int(r[8]), int(r[9]), hist, int(rest[0]), int(rest[1]))
                out.append(PodActivityWindow(r[0], r[1], labels, act))
        return out

    def pods(self, selector: Selector, start: float, end: float) -> list[PodGpuSummary]:
        horizon = self._clock() - self._retention_s
        fetched = self._conn.query(
            f"SELECT start, end, {', '.join(POD_GPU_LABELS)}, utilization, memory_bytes, idle_ratio "
            f"FROM {self._table} WHERE end > {float(start)!r} AND start < {float(end)!r} "
            f"AND end >= {float(horizon)!r} ORDER BY end, start, node, namespace, pod, container, gpu",
            settings=self._read,
        )
        rows = []
        for r in fetched:
            labels = dict(zip(POD_GPU_LABELS, r[2:7], strict=True))
            if selector.matches(labels):
                rows.append(PodGpuWindow(r[0], r[1], labels, r[7], r[8], r[9]))
        return summarize(rows, self._activity_rows(selector, start, end, horizon))
