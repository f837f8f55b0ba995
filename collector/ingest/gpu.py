"""A batch's GPU section (checked by validate.py) into a GpuWindow: device readings in base units, and each
pod's use of each GPU."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.model.gpu import GpuWindow, PodGpuUse
from fleetprof.gpu_families import DeviceReading, percent, scaled


def gpu_window(batch: pb.Batch) -> GpuWindow | None:
    """None when the agent runs without GPU polling (--no-gpu)."""
    if not batch.HasField("gpu_source") and not batch.gpu_devices:
        return None
    node, strings = batch.agent.node, batch.strings
    return GpuWindow(
        node,
        batch.start_unix_ns / 1e9,
        batch.end_unix_ns / 1e9,
        batch.gpu_source.up,
        tuple(_reading(node, d, strings) for d in batch.gpu_devices),
        pod_usage(node, batch) if batch.gpu_processes else {},
    )


def gpu_label(d: pb.GpuDevice) -> str:
    """The `gpu` label: "0" for a whole GPU, "0/3" for GPU instance 3 of GPU 0 (as on the agent)."""
    return f"{d.index}/{d.gpu_instance_id}" if d.parent_uuid else str(d.index)


def _latest(samples, name: str) -> float | None:  # repeated GpuSample
    for s in reversed(samples):
        if s.HasField(name):
            return getattr(s, name)
    return None


def _mean(samples, name: str) -> float | None:
    values = [getattr(s, name) for s in samples if s.HasField(name)]
    return sum(values) / len(values) if values else None


def _reading(node: str, d: pb.GpuDevice, strings) -> DeviceReading:
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
        xid_errors=d.xid_errors if d.xid_watched else None,
    )


@dataclass
class _PodAcc:
    sm_percent: float | None = None  # sum over the pod's processes on the device
    memory_bytes: int | None = None
    state_polls: int = 0
    idle_polls: int = 0


def pod_usage(node: str, batch: pb.Batch) -> dict[tuple[str, ...], PodGpuUse]:
    """(node, namespace, pod, container, gpu) -> the pod's use of that GPU in the window.

    A process is credited to the pod its own labels name; one without (it exited, or no API server is
    configured) to the pod the kubelet says holds the device."""
    strings = batch.strings
    accs: dict[tuple[str, ...], _PodAcc] = {}
    pods_on: dict[int, set[tuple[str, ...]]] = {}
    for u in batch.gpu_processes:
        d = batch.gpu_devices[u.device]
        labels = {strings[lb.name]: strings[lb.value] for lb in batch.processes[u.process].labels}
        ns, pod, container = labels.get("namespace", ""), labels.get("pod", ""), labels.get("container", "")
        if not (ns and pod) and d.owner_pod:
            ns, pod, container = strings[d.owner_namespace], strings[d.owner_pod], strings[d.owner_container]
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
        idle = acc.idle_polls / acc.state_polls if acc.state_polls else None
        out[key] = PodGpuUse(util, acc.memory_bytes, idle)
    # Without per-process utilization (e.g. not supported), a pod alone on a GPU gets the GPU's.
    for dev, keys in pods_on.items():
        if len(keys) == 1:
            (key,) = keys
            if out[key].utilization is None:
                mean = _mean(batch.gpu_devices[dev].samples, "gpu_utilization_percent")
                if mean is not None:
                    out[key] = PodGpuUse(min(mean, 100.0) / 100.0, out[key].memory_bytes, out[key].idle_ratio)
    return out
