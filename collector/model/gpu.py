"""A window's GPU section as plain values: what ingest decodes once and the GPU metrics and the per-pod
usage log both read."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof.gpu_families import DeviceReading

POD_GPU_LABELS = ("node", "namespace", "pod", "container", "gpu")


@dataclass(frozen=True)
class PodGpuUse:
    """One pod's use of one GPU during one window."""

    utilization: float | None  # ratio 0..1: the pod's processes' SM utilization (the GPU's when alone)
    memory_bytes: int | None  # the most its processes held
    idle_ratio: float | None  # share of polls the GPU was idle


@dataclass(frozen=True)
class GpuWindow:
    node: str
    start: float  # unix seconds
    end: float
    up: bool  # the agent's NVML poller answered its last poll
    devices: tuple[DeviceReading, ...]  # each device's values over the window (xid_errors: this window's)
    pods: dict[tuple[str, ...], PodGpuUse]  # keyed by POD_GPU_LABELS values
