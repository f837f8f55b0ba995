"""Per-pod GPU usage in ClickHouse: what collector/store/gpu_usage.py keeps in one collector's memory, here
shared by every collector (any of them answers /api/v1/gpus for the whole fleet).

Written when ingest reports a stored batch's GPU window, after the batch's rows: a collector killed
between the two loses that window's GPU summary (the resend is a duplicate), never samples, and never
counts a window twice."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fleetprof.collector.model.gpu import POD_GPU_LABELS, GpuWindow, PodGpuSummary
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.store.clickhouse.connection import Connection
from fleetprof.collector.store.clickhouse.schema import Layout
from fleetprof.collector.store.gpu_usage import PodGpuWindow, pod_windows, summarize


class ClickHouseGpuUsage:
    """GpuUsageLog's face (observe, pods) over the `gpu_usage` table."""

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
        self._insert = insert_settings
        self._read = read_settings
        self._clock = clock
        self._retention_s = retention_s

    def observe(self, window: GpuWindow) -> None:
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
        return summarize(rows)
