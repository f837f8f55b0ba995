"""A window's GPU section as plain values (what ingest decodes once and the GPU metrics and the per-pod
usage log both read), and a pod's GPU use over a time range (what the usage log answers queries)."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class PodGpuSummary:
    """One pod over a time range: what `fleetprof gpus` prints per row."""

    namespace: str
    pod: str
    gpus: set[str] = field(default_factory=set)  # "node/gpu"
    seconds: float = 0.0  # window time covered
    util_seconds: float = 0.0  # utilization x seconds, where known
    util_known_seconds: float = 0.0
    idle_seconds: float = 0.0  # idle ratio x seconds, where known
    idle_known_seconds: float = 0.0
    memory_bytes: int | None = None  # the most held by the pod at once (summed over its GPUs)

    @property
    def utilization(self) -> float | None:
        return self.util_seconds / self.util_known_seconds if self.util_known_seconds else None

    @property
    def idle_ratio(self) -> float | None:
        return self.idle_seconds / self.idle_known_seconds if self.idle_known_seconds else None
