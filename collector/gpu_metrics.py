"""The GPU section of ingested batches: its validation, and Prometheus series per device and per pod."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from prometheus_client.core import GaugeMetricFamily, Metric

from fleetprof.gpu_families import DeviceReading, device_families, percent, scaled
from fleetprof.v1 import ingest_pb2 as pb

POD_LABELS = ["node", "namespace", "pod", "container", "gpu"]
MAX_SAMPLES_PER_DEVICE = 100_000


def gpu_section_problem(batch: pb.Batch) -> str | None:
    """What is wrong with the batch's GPU section, or None when it is sound."""
    nstr, nproc, ndev = len(batch.strings), len(batch.processes), len(batch.gpu_devices)
    if batch.gpu_source.state >= max(nstr, 1):
        return f"gpu_source.state refers to string {batch.gpu_source.state}, but there are {nstr}"
    for i, d in enumerate(batch.gpu_devices):
        for name in ("uuid", "name", "parent_uuid", "owner_namespace", "owner_pod", "owner_container"):
            if getattr(d, name) >= nstr:
                return f"gpu device {i} {name} refers to string {getattr(d, name)}, but there are {nstr}"
        if d.uuid == 0:
            return f"gpu device {i} has no uuid"
        if len(d.samples) > MAX_SAMPLES_PER_DEVICE:
            return f"gpu device {i} has {len(d.samples)} samples (limit {MAX_SAMPLES_PER_DEVICE})"
    for i, u in enumerate(batch.gpu_processes):
        if u.process >= nproc:
            return f"gpu process row {i} refers to process {u.process}, but there are {nproc}"
        if u.device >= ndev:
            return f"gpu process row {i} refers to gpu device {u.device}, but there are {ndev}"
        if not u.idle_polls <= u.state_polls <= u.polls:
            return (
                f"gpu process row {i}: idle_polls {u.idle_polls} <= state_polls {u.state_polls} <= "
                f"polls {u.polls} does not hold"
            )
    return None


def gpu_label(d: pb.GpuDevice) -> str:
    """The `gpu` label: "0" for a whole GPU, "0/3" for GPU instance 3 of GPU 0 (as on the agent)."""
    return f"{d.index}/{d.gpu_instance_id}" if d.parent_uuid else str(d.index)


def _latest(samples, name: str) -> float | None:  # noqa: ANN001 - repeated GpuSample
    for s in reversed(samples):
        if s.HasField(name):
            return getattr(s, name)
    return None


def _mean(samples, name: str) -> float | None:  # noqa: ANN001
    values = [getattr(s, name) for s in samples if s.HasField(name)]
    return sum(values) / len(values) if values else None


@dataclass
class _PodAcc:
    sm_percent: float | None = None  # sum over the pod's processes on the device
    memory_bytes: int | None = None
    state_polls: int = 0
    idle_polls: int = 0


@dataclass
class _Node:
    end_ns: int = 0  # the newest window ingested; older (resent) ones do not overwrite gauges
    updated: float = 0.0
    up: bool = False
    devices: dict[str, DeviceReading] = field(default_factory=dict)  # uuid -> latest reading
    pods: dict[tuple[str, ...], tuple[float | None, float | None, float | None]] = field(default_factory=dict)
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

    def observe(self, batch: pb.Batch, pods: dict | None = None) -> None:
        """Feed one ingested (validated, not duplicate) batch; `pods`: its pod_usage, if already computed."""
        if not batch.HasField("gpu_source") and not batch.gpu_devices:
            return  # the agent runs with --no-gpu
        now = self._clock()
        node_name = batch.agent.node
        strings = batch.strings
        with self._lock:
            node = self._nodes.setdefault(node_name, _Node())
            for d in batch.gpu_devices:
                uuid = strings[d.uuid]
                node.xids[uuid] = node.xids.get(uuid, 0) + d.xid_errors
            if batch.end_unix_ns >= node.end_ns:
                node.end_ns = batch.end_unix_ns
                node.up = batch.gpu_source.up
                node.devices = {
                    strings[d.uuid]: self._reading(node_name, d, strings) for d in batch.gpu_devices
                }
                node.pods = self.pod_usage(node_name, batch) if pods is None else pods
            node.updated = now
            for name in [n for n, v in self._nodes.items() if now - v.updated > self._expire_s]:
                del self._nodes[name]

    @staticmethod
    def _reading(node: str, d: pb.GpuDevice, strings) -> DeviceReading:  # noqa: ANN001
        s = d.samples
        util = _mean(s, "gpu_utilization_percent")
        mem_util = _mean(s, "memory_utilization_percent")
        return DeviceReading(
            node=node,
            gpu=gpu_label(d),
            uuid=strings[d.uuid],
            model=strings[d.name],
            utilization_ratio=None if util is None else percent(round(util, 3)),
            memory_utilization_ratio=None if mem_util is None else percent(round(mem_util, 3)),
            memory_used_bytes=_latest(s, "memory_used_bytes"),
            memory_total_bytes=_latest(s, "memory_total_bytes"),
            power_watts=scaled(_latest(s, "power_milliwatts"), 1e-3),
            energy_joules=scaled(_latest(s, "energy_millijoules"), 1e-3),
            temperature_celsius=_latest(s, "temperature_celsius"),
            sm_clock_hertz=scaled(_latest(s, "sm_clock_mhz"), 1e6),
            clock_event_reasons=_latest(s, "clock_event_reasons"),
            pcie_tx_bytes_per_second=scaled(_latest(s, "pcie_tx_kilobytes_per_second"), 1024),
            pcie_rx_bytes_per_second=scaled(_latest(s, "pcie_rx_kilobytes_per_second"), 1024),
            ecc_corrected_errors=_latest(s, "ecc_corrected_errors"),
            ecc_uncorrected_errors=_latest(s, "ecc_uncorrected_errors"),
            xid_errors=0 if d.xid_watched else None,  # the running total is kept per node
        )

    @staticmethod
    def pod_usage(node: str, batch: pb.Batch) -> dict[tuple[str, ...], tuple[float | None, ...]]:
        """(node, namespace, pod, container, gpu) -> (utilization ratio, memory bytes, idle ratio).

        A process is credited to the pod its own labels name; one without (it exited, or no API server
        is configured) to the pod the kubelet says holds the device."""
        strings = batch.strings
        accs: dict[tuple[str, ...], _PodAcc] = {}
        pods_on: dict[int, set[tuple[str, ...]]] = {}
        for u in batch.gpu_processes:
            d = batch.gpu_devices[u.device]
            labels = {strings[lb.name]: strings[lb.value] for lb in batch.processes[u.process].labels}
            ns, pod, container = (
                labels.get("namespace", ""),
                labels.get("pod", ""),
                labels.get("container", ""),
            )
            if not (ns and pod) and d.owner_pod:
                ns, pod, container = (
                    strings[d.owner_namespace],
                    strings[d.owner_pod],
                    strings[d.owner_container],
                )
            if not (ns and pod):
                continue  # a host process: no pod series
            key = (node, ns, pod, container, gpu_label(d))
            pods_on.setdefault(u.device, set()).add(key)
            acc = accs.setdefault(key, _PodAcc())
            if u.HasField("sm_utilization_percent"):
                acc.sm_percent = (acc.sm_percent or 0.0) + u.sm_utilization_percent
            if u.HasField("memory_used_bytes"):
                acc.memory_bytes = (acc.memory_bytes or 0) + u.memory_used_bytes
            acc.state_polls += u.state_polls
            acc.idle_polls += u.idle_polls
        out = {}
        for key, acc in accs.items():
            util = None if acc.sm_percent is None else min(acc.sm_percent, 100.0) / 100.0
            out[key] = (util, acc.memory_bytes, acc.idle_polls / acc.state_polls if acc.state_polls else None)
        # Without per-process utilization (e.g. not supported), a pod alone on a GPU gets the GPU's.
        for dev, keys in pods_on.items():
            if len(keys) == 1:
                (key,) = keys
                if out[key][0] is None:
                    mean = _mean(batch.gpu_devices[dev].samples, "gpu_utilization_percent")
                    if mean is not None:
                        out[key] = (min(mean, 100.0) / 100.0, *out[key][1:])
        return out

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            nodes = {
                name: replace(n, devices=dict(n.devices), pods=dict(n.pods), xids=dict(n.xids))
                for name, n in self._nodes.items()
            }
        up = GaugeMetricFamily(
            "fleetprof_gpu_source_up", "1 when the node's agent reads its GPUs", labels=["node"]
        )
        readings = []
        util = GaugeMetricFamily(
            "fleetprof_pod_gpu_utilization_ratio",
            "Share of the window the pod's processes kept the GPU's SMs busy (NVML per-process utilization)",
            labels=POD_LABELS,
        )
        mem = GaugeMetricFamily(
            "fleetprof_pod_gpu_memory_used_bytes", "GPU memory held by the pod's processes", labels=POD_LABELS
        )
        idle = GaugeMetricFamily(
            "fleetprof_pod_gpu_idle_ratio",
            "Share of the window the pod's GPU was idle (utilization below the agent's threshold)",
            labels=POD_LABELS,
        )
        for name, n in sorted(nodes.items()):
            up.add_metric([name], 1 if n.up else 0)
            for uuid, r in sorted(n.devices.items()):
                readings.append(r if r.xid_errors is None else replace(r, xid_errors=n.xids.get(uuid, 0)))
            for key, (u, m, i) in sorted(n.pods.items()):
                if u is not None:
                    util.add_metric(list(key), u)
                if m is not None:
                    mem.add_metric(list(key), m)
                if i is not None:
                    idle.add_metric(list(key), i)
        yield up
        yield from device_families(readings)
        yield util
        yield mem
        yield idle
