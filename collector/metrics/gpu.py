"""Prometheus series of the fleet's GPUs: per device (the agents' NVML readings) and per pod."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from prometheus_client.core import GaugeMetricFamily, Metric

from fleetprof.collector.model.gpu import POD_GPU_LABELS, GpuWindow, PodGpuActivity, PodGpuUse
from fleetprof.gpu_families import DeviceReading, device_families


@dataclass
class _Node:
    end: float = 0.0  # the newest window ingested; older (resent) ones do not overwrite gauges
    updated: float = 0.0
    up: bool = False
    devices: dict[str, DeviceReading] = field(default_factory=dict)  # uuid -> latest reading
    pods: dict[tuple[str, ...], PodGpuUse] = field(default_factory=dict)
    activity: dict[tuple[str, ...], PodGpuActivity] = field(default_factory=dict)
    xids: dict[str, int] = field(default_factory=dict)  # uuid -> XID events since the collector started


class GpuMetrics:
    """Device gauges from each node's latest window (utilization is the window's mean, the rest its last
    poll); pod series are replaced by each window's (a pod that left its GPU disappears); XID counts are
    summed over windows. Nodes silent for `expire_s` are dropped."""

    def __init__(self, expire_s: float = 900.0, clock: Callable[[], float] = time.time):
        self._expire_s = expire_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}

    def observe(self, window: GpuWindow) -> None:
        """Feed one ingested (validated, not duplicate) window's GPU section."""
        now = self._clock()
        with self._lock:
            node = self._nodes.setdefault(window.node, _Node())
            for r in window.devices:
                if r.xid_errors is not None:
                    node.xids[r.uuid] = node.xids.get(r.uuid, 0) + int(r.xid_errors)
            if window.end >= node.end:
                node.end = window.end
                node.up = window.up
                node.devices = {r.uuid: r for r in window.devices}
                node.pods = window.pods
                node.activity = window.activity
            node.updated = now
            for name in [n for n, v in self._nodes.items() if now - v.updated > self._expire_s]:
                del self._nodes[name]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            nodes = {
                name: replace(
                    n,
                    devices=dict(n.devices),
                    pods=dict(n.pods),
                    activity=dict(n.activity),
                    xids=dict(n.xids),
                )
                for name, n in self._nodes.items()
            }
        up = GaugeMetricFamily(
            "fleetprof_gpu_source_up", "1 when the node's agent reads its GPUs", labels=["node"]
        )
        readings = []
        util = GaugeMetricFamily(
            "fleetprof_pod_gpu_utilization_ratio",
            "Share of the window the pod's processes kept the GPU's SMs busy (NVML per-process utilization)",
            labels=list(POD_GPU_LABELS),
        )
        mem = GaugeMetricFamily(
            "fleetprof_pod_gpu_memory_used_bytes",
            "GPU memory held by the pod's processes",
            labels=list(POD_GPU_LABELS),
        )
        idle = GaugeMetricFamily(
            "fleetprof_pod_gpu_idle_ratio",
            "Share of the window the pod's GPU was idle (utilization below the agent's threshold)",
            labels=list(POD_GPU_LABELS),
        )
        exact = GaugeMetricFamily(
            "fleetprof_pod_gpu_exact_idle_ratio",
            "Share of the window's covered time no kernel or copy of the pod ran on the GPU (from its CUPTI "
            "records, µs resolution; only where the pod loads fleetprof's CUPTI library)",
            labels=list(POD_GPU_LABELS),
        )
        for name, n in sorted(nodes.items()):
            for key, act in sorted(n.activity.items()):
                if act.known_ns:
                    exact.add_metric(list(key), act.idle_ns / act.known_ns)
            up.add_metric([name], 1 if n.up else 0)
            for uuid, r in sorted(n.devices.items()):
                readings.append(r if r.xid_errors is None else replace(r, xid_errors=n.xids.get(uuid, 0)))
            for key, use in sorted(n.pods.items()):
                if use.utilization is not None:
                    util.add_metric(list(key), use.utilization)
                if use.memory_bytes is not None:
                    mem.add_metric(list(key), use.memory_bytes)
                if use.idle_ratio is not None:
                    idle.add_metric(list(key), use.idle_ratio)
        yield up
        yield from device_families(readings)
        yield util
        yield mem
        yield idle
        yield exact
