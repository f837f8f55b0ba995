"""A window's GPU section as plain values (what ingest decodes once and the GPU metrics and the per-pod
usage log both read), and a pod's GPU use over a time range (what the usage log answers queries)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetprof.gpu_families import GAP_BUCKETS_NS, DeviceReading

GAP_BUCKETS = len(GAP_BUCKETS_NS) + 1  # the gap histogram's buckets, the last open-ended

POD_GPU_LABELS = ("node", "namespace", "pod", "container", "gpu")


@dataclass(frozen=True)
class PodGpuUse:
    """One pod's use of one GPU during one window."""

    utilization: float | None  # ratio 0..1: the pod's processes' SM utilization (the GPU's when alone)
    memory_bytes: int | None  # the most its processes held
    idle_ratio: float | None  # share of polls the GPU was idle


@dataclass(frozen=True)
class PodGpuActivity:
    """One pod's exact activity on one GPU during one window, from its processes' CUPTI records (summed
    over its processes on that GPU): the time the records cover, of it the time none of the pod's kernels
    or copies ran, and the idle gaps that ended in the window."""

    known_ns: int
    idle_ns: int
    gaps: int
    gap_histogram: tuple[int, ...]  # per GAP_BUCKETS_NS bucket (GAP_BUCKETS entries)
    longest_gap_ns: int
    records_lost: int


@dataclass(frozen=True)
class GpuWindow:
    node: str
    start: float  # unix seconds
    end: float
    up: bool  # the agent's NVML poller answered its last poll
    devices: tuple[DeviceReading, ...]  # each device's values over the window (xid_errors: this window's)
    pods: dict[tuple[str, ...], PodGpuUse]  # keyed by POD_GPU_LABELS values
    # Exact activity where the pod's processes load the CUPTI library, keyed as `pods`.
    activity: dict[tuple[str, ...], PodGpuActivity] = field(default_factory=dict)


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
    # From the exact activity (CUPTI), where the pod's processes load the library: the time covered and
    # idle in it (summed over the pod's GPUs), the gaps that ended in the range by length bucket.
    activity_known_seconds: float = 0.0
    activity_idle_seconds: float = 0.0
    gaps: int = 0
    gap_histogram: list[int] = field(default_factory=lambda: [0] * GAP_BUCKETS)
    longest_gap_seconds: float = 0.0
    records_lost: int = 0

    @property
    def utilization(self) -> float | None:
        return self.util_seconds / self.util_known_seconds if self.util_known_seconds else None

    @property
    def nvml_idle_ratio(self) -> float | None:
        """The share of NVML polls that read the GPU idle."""
        return self.idle_seconds / self.idle_known_seconds if self.idle_known_seconds else None

    @property
    def idle_source(self) -> str | None:
        """What idle_ratio comes from: "activity" (exact, µs) where there is some, else "nvml"."""
        if self.activity_known_seconds:
            return "activity"
        return "nvml" if self.idle_known_seconds else None

    @property
    def idle_ratio(self) -> float | None:
        """Exact where the activity covers some of the range, else NVML's."""
        if self.activity_known_seconds:
            return self.activity_idle_seconds / self.activity_known_seconds
        return self.nvml_idle_ratio
