"""The agent's plain values that cross its stages: what the BPF loaders drain, what the resolver makes of it,
and the complete window the batch encoder turns into the wire Batch.

Every stage may import this module, and it imports none of them (tests/deploy/test_layout.py): no BCC, no
/proc, no NVML, no gRPC. The ctypes mirror of struct process_event is here because both BPF loaders
(sampler.py, syscalls.py) read it from their ring buffers.
"""

from __future__ import annotations

import bisect
import ctypes as ct
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from fleetprof.gpu_families import GAP_BUCKETS_NS  # the wire's fixed buckets (CudaActivity.gap_histogram)

# -- what the BPF programs drain (agent/sampler.py, agent/syscalls.py) ------------------------------------

# Stack ids with a meaning of their own (cpu_sampler.c): no stored stack behind them.
# A gpu_slot of SamplerConfig.gpu_fine_slot_us (cpu_sampler.c): a process whose GPU activity timeline the
# agent reads (our CUPTI library), its samples judged by that timeline, not NVML's.
GPU_SLOT_FINE = 1 << 63
STACK_NONE = 0
STACK_LOST = 1
STACK_UNTAKEN = 2  # a long wait recorded exactly, its stack not taken (cpu_sampler.c offcpu_untaken)
STACK_SYSCALL = 0x400  # kernel_stack STACK_SYSCALL + nr: the wait was in syscall nr (stack taken at return)
STACK_RESERVED = 0x800  # ids below this name no stored stack
EVENT_NEW, EVENT_EXEC, EVENT_EXIT, EVENT_UNMAPPED = 1, 2, 3, 4  # bpf/process_event.h


class ProcessEvent(ct.Structure):
    """struct process_event (bpf/process_event.h), sent by this sampler and by the syscall tracer."""

    _fields_ = [("tgid", ct.c_uint32), ("kind", ct.c_uint32), ("ns", ct.c_uint64)]


class SampleCount(NamedTuple):
    """One drained row. A NamedTuple, as ResolvedSample: a drain makes one a row (thousands a window on a
    busy node), and a frozen dataclass's __init__ took ~3x as long (bench/drain_parse.py)."""

    tgid: int
    tid: int
    cgroup_id: int
    comm: str
    user_stack: int  # stack id, STACK_NONE or STACK_LOST
    kernel_stack: int
    count: int
    python_stack: int = STACK_NONE  # CPython frames of the thread, for processes running one
    gpu_slot: int = 0  # processes on a GPU: which GPU_SLOT of CLOCK_MONOTONIC the samples fell in, + 1
    idle: bool = False  # off-CPU rows: the thread was idle in this window (agent/offcpu.py idle_threads)


# One CPython frame as BPF recorded it: (code address, instruction pointer - code address, owner<<24 |
# qualname fingerprint); see struct py_frame in agent/bpf/python_stack.h.
PyFrameRef = tuple[int, int, int]


@dataclass(frozen=True)
class OffCpuSettings:
    """How the off-CPU recorder ran (its stats go in the batch with them)."""

    sample_every: int  # 1 switch-out in N sampled; counts are scaled by it
    min_block_ns: int  # shorter waits were dropped


# How a launch named its kernel (agent/bpf/cuda_probes.c CUDA_API_*): what CudaLaunchCount.handle is.
CUDA_API_RUNTIME = 1  # the host stub's address: named by the process's symbols
CUDA_API_DRIVER = 2  # a CUfunction / CUkernel: named by cuModuleGetFunction / cuLibraryGetKernel
CUDA_API_GRAPH = 3  # a graph's executable handle: its kernels are not known at launch
CUDA_API_MARKER = 4  # our CUPTI library's sampled launch: weight << 32 | correlation id (not a launch count)


@dataclass(frozen=True)
class CudaLibrary:
    """A CUDA runtime, driver or NCCL file a process maps (agent/gpu/cuda_libraries.py), for its uprobes."""

    key: tuple[int, int, int]  # (device major, minor, inode) as /proc/PID/maps prints them: one per file
    kind: str  # agent/cuda_api.py RUNTIME, DRIVER or NCCL
    path: str  # /proc/PID/map_files/START-END: exactly the mapped inode, while the process lives
    offsets: dict[str, int]  # probed function -> file offset; empty when the file is probed already
    text: tuple[tuple[int, int], ...] = ()  # the runtime's executable ranges in this process


@dataclass(frozen=True)
class CudaLaunchCount:
    """Launches recorded with one stack and one kernel in a window: `row.count` as recorded (1 in
    CudaProbeDrain.sample_every), its stacks in the Drain's tables."""

    row: SampleCount
    handle: int
    api: int  # CUDA_API_*


@dataclass(frozen=True)
class CudaCallStat:
    """One process's calls of one timed CUDA function that returned in a window (every one of them)."""

    tgid: int
    call: str  # the function as exported ("cudaStreamSynchronize")
    count: int
    ns: int
    hist: tuple[int, ...]  # hist[i]: calls in [2^i, 2^(i+1)) ns; the last bucket is open-ended


@dataclass
class CudaProbeDrain:
    """What the CUDA uprobes recorded in one window (agent/gpu/cuda_probes.py)."""

    launches: list[CudaLaunchCount]
    calls: list[CudaCallStat]
    names: dict[tuple[int, int], str]  # (tgid, driver handle) -> kernel name, for the launches' handles
    sample_every: int  # 1 launch in N had its stack taken; launch counts are scaled by it
    launches_seen: int = 0  # every launch, counted in the kernel
    launches_sampled: int = 0
    table_full: int = 0


@dataclass
class Drain:
    """Everything one drain produced: counts, the stacks they reference (leaf first), stat deltas."""

    start_ns: int
    end_ns: int
    samples: list[SampleCount]
    stacks: dict[int, tuple[int, ...]]
    stats: dict[str, int] = field(default_factory=dict)
    python_stacks: dict[int, tuple[PyFrameRef, ...]] = field(default_factory=dict)  # leaf first
    # Off-CPU time: `count` is nanoseconds switched out (already scaled up for sampling), recorded in the
    # window in which the thread ran again, by the stacks it left the CPU with and the GPU slot of its
    # wake-up. Its stacks are in `stacks`/`python_stacks` like the samples'. Empty when off-CPU is off.
    offcpu: list[SampleCount] = field(default_factory=list)
    # Sampled switch-outs still waiting at this drain (a gauge, unlike `stats`): their waits are recorded
    # in later windows. Near SamplerConfig.offcpu_sizes()'s pending bound, the oldest waits get dropped.
    offcpu_pending: int = 0
    frequency_hz: int = 0  # samples per second per CPU
    offcpu_settings: OffCpuSettings | None = None  # how `offcpu` was recorded; None when off-CPU is off
    cuda: CudaProbeDrain | None = None  # the CUDA uprobes' window; None when they are off


@dataclass(frozen=True)
class SyscallStat:
    """One process's calls of one syscall in one window.

    `count` is every call that entered in the window; `timed`, `timed_ns` and `hist` cover the sampled
    calls that returned in it (a call blocked across a drain is counted in one window and timed in a
    later one, so `timed` may exceed `count` for a key in a window).
    """

    tgid: int
    nr: int
    name: str
    count: int
    timed: int
    timed_ns: int
    hist: tuple[int, ...]  # hist[i]: timed calls in [2^i, 2^(i+1)) ns; the last bucket is open-ended


@dataclass
class SyscallDrain:
    """One window: its stats and the deltas of the tracer's counters (syscalls.py STAT_NAMES)."""

    start_ns: int
    end_ns: int
    stats: list[SyscallStat]
    counters: dict[str, int] = field(default_factory=dict)
    sample_every: int = 0  # 1 call in N timed while timing windows are open; 0: count only
    duty: float = 0.0  # fraction of the time in timing windows


# -- processes, as captured while they lived (agent/process/, agent/symbols/maps.py) ---------------------

DELETED_SUFFIX = " (deleted)"


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps; `path` is exactly as the kernel prints it (may end in " (deleted)")."""

    start: int
    end: int
    offset: int
    dev_major: int
    dev_minor: int
    inode: int
    path: str
    perms: str

    @property
    def is_exec(self) -> bool:
        return len(self.perms) > 2 and self.perms[2] == "x"

    @property
    def is_file(self) -> bool:
        """Backed by a file (including deleted files and memfds); anonymous and [special] mappings are not."""
        return self.inode != 0

    @property
    def deleted(self) -> bool:
        return self.path.endswith(DELETED_SUFFIX)

    @property
    def file_path(self) -> str:
        """The path without the " (deleted)" marker."""
        return self.path[: -len(DELETED_SUFFIX)] if self.deleted else self.path

    @property
    def display_name(self) -> str:
        """Short name for frames: the file's basename, "[vdso]"-style names as is, "[anon]" for no name."""
        if self.is_file:
            return os.path.basename(self.file_path) or self.file_path
        return self.path or "[anon]"


@dataclass(frozen=True)
class CgroupIdentity:
    """Who a process belongs to, as far as its cgroup path tells.

    ``runtime`` is "" when the path does not name the runtime: cgroupfs-driver containerd and
    cri-dockerd both use a bare container id, so only the node's configured runtime can say which.
    A CRI-O conmon process gets runtime "cri-o" and its pod's UID but no container_id: it watches
    the container from outside it. ``qos`` is "" for processes outside pods, and for pods whose
    QoS ancestors a cgroup namespace hid.
    """

    path: str
    container_id: str = ""
    runtime: str = ""
    pod_uid: str = ""
    qos: str = ""


@dataclass(frozen=True)
class ProcessInfo:
    """A process as captured while it was alive. Samples taken after it exits still resolve through it."""

    pid: int
    start_ticks: int  # /proc/PID/stat field 22: tells a reused pid apart
    comm: str
    exe: str
    cgroup: CgroupIdentity
    mappings: tuple[Mapping, ...] = field(repr=False)
    mapped: bool = True  # False: captured for its labels only, mappings not read (ProcessTable.note)
    captured_ns: int = field(default=0, compare=False, repr=False)  # CLOCK_MONOTONIC as the capture began


# -- GPUs, as polled and owned (agent/gpu/, agent/kube/podresources.py) -------------------------------------

# A GPU counts as idle in a poll when its utilization (the share of NVML's sample period in which a kernel
# ran) is below this. Not 0: an idle GPU with a polling monitor or a stray context shows 1-3%, while a
# stalled training loop (data loader, collective wait, host-side Python) drops below 5% for whole seconds.
IDLE_BELOW_PERCENT = 5


@dataclass(frozen=True)
class DeviceAssignment:
    namespace: str
    pod: str
    container: str
    resource: str  # e.g. "nvidia.com/gpu", "nvidia.com/mig-1g.10gb"
    device_id: str  # the GPU or MIG UUID ("GPU-…", "MIG-…"), without a time-slicing "::<replica>" suffix


@dataclass(frozen=True)
class DeviceIdentity:
    index: int  # NVML index (of the parent GPU for a MIG instance)
    uuid: str
    name: str
    mig_mode: bool = False
    parent_uuid: str = ""  # MIG instances: the GPU they live on
    gpu_instance_id: int = 0

    @property
    def label(self) -> str:
        """The `gpu` label: "0" for a whole GPU, "0/3" for GPU instance 3 of GPU 0."""
        return f"{self.index}/{self.gpu_instance_id}" if self.parent_uuid else str(self.index)


@dataclass(frozen=True)
class DeviceSample:
    """One poll of one device; None where the device does not support the field."""

    time_ns: int
    gpu_util_percent: int | None = None
    mem_util_percent: int | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_mw: int | None = None
    energy_mj: int | None = None  # since the driver was loaded
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    pcie_tx_kbps: int | None = None
    pcie_rx_kbps: int | None = None
    # NVML GPM metrics (Hopper and newer), percent over the interval since the previous poll's GPM sample.
    sm_active_percent: float | None = None
    sm_occupancy_percent: float | None = None
    tensor_active_percent: float | None = None
    dram_bandwidth_percent: float | None = None


@dataclass
class DeviceWindow:
    device: DeviceIdentity
    samples: list[DeviceSample] = field(default_factory=list)
    xid_codes: list[int] = field(default_factory=list)
    xid_errors: int = 0
    xid_watched: bool = False
    owner: DeviceAssignment | None = None  # from the kubelet's PodResources, filled by `attributed`


@dataclass
class ProcessWindow:
    """One process's use of one device over the window (see GpuProcessUsage in ingest.proto)."""

    pid: int
    uuid: str
    polls: int = 0
    state_polls: int = 0
    idle_polls: int = 0
    mem_used_bytes: int | None = None
    sm_util_sum: float | None = None
    mem_util_sum: float | None = None
    process: ProcessInfo | None = None  # filled by `attributed`

    @property
    def sm_util_percent(self) -> float | None:
        return None if self.sm_util_sum is None or not self.polls else self.sm_util_sum / self.polls

    @property
    def mem_util_percent(self) -> float | None:
        return None if self.mem_util_sum is None or not self.polls else self.mem_util_sum / self.polls


@dataclass
class GpuWindow:
    """The polls since the previous drain, for one batch."""

    state: str  # "up", "no_library", "no_driver", "lost", "disabled"
    devices: list[DeviceWindow] = field(default_factory=list)
    processes: list[ProcessWindow] = field(default_factory=list)
    idle_below_percent: int = IDLE_BELOW_PERCENT

    @property
    def up(self) -> bool:
        return self.state == "up"

    def attributed(self, process_of, owner_of) -> GpuWindow:  # two lookups, see below
        """A copy with each process's ProcessInfo (`process_of(pid)`, e.g. ProcessTable.get) and each
        device's PodResources owner (`owner_of(uuid)`, e.g. GpuOwners.owner) filled in."""
        return replace(
            self,
            devices=[replace(d, owner=owner_of(d.device.uuid)) for d in self.devices],
            processes=[replace(p, process=process_of(p.pid)) for p in self.processes],
        )


# -- what the resolver makes of a window (agent/resolver.py): the batch encoder's whole input ------------

UNKNOWN = "[unknown]"


@dataclass(frozen=True)
class Frame:
    """One symbolized stack frame.

    Unknown frames are never dropped: `function` reads "[unknown] (MODULE+0xOFFSET)", where OFFSET is the
    offset into the mapped file for file-backed code (what `addr - start + offset` in /proc/PID/maps gives;
    equal to the ELF address for most shared libraries), the offset into the region for anonymous and
    special mappings ("[anon]", "[vdso]", ...), and the absolute address for "[kernel]" and "[unmapped]".
    """

    function: str
    module: str
    kernel: bool = False
    # The hash, computed once: the encoder keys every row by its whole stack of frames, and a hash made
    # afresh (the dataclass's own) cost ~1 us a frame, tens of us a row (bench/README.md "Agent cost per
    # sample").
    _hash: int = field(init=False, repr=False, compare=False)
    # Whether no symbol named it, computed once too: every frame of a new stack is asked (by_module).
    is_unknown: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.function, self.module, self.kernel)))
        object.__setattr__(self, "is_unknown", self.function.startswith(UNKNOWN))

    def __hash__(self) -> int:
        return self._hash


class ResolvedSample(NamedTuple):
    """One row symbolized (a NamedTuple: see SampleCount)."""

    process: ProcessInfo
    tid: int  # the agent's own (per-thread Python stacks are checked by it); batches sum a process's threads
    frames: tuple[Frame, ...]  # root first
    kernel_start: int  # index of the first kernel frame (len(frames) if none)
    count: int
    gpu_slot: int = 0  # see SampleCount.gpu_slot
    idle: bool = False  # off-CPU rows: see SampleCount.idle
    gpu_state: str = ""  # "busy" or "idle": its GPUs in its gpu_slot (GPU timeline); "": none known


# A process's labels as the batch carries them: (name, value) pairs sorted by name.
Labels = tuple[tuple[str, str], ...]


# -- GPU activity from our CUPTI library's rings (agent/gpu/activity.py, cupti_reader.py) -------------
@dataclass(frozen=True)
class Gap:
    start_ns: int
    end_ns: int
    clipped: bool  # cut by the edge of the window asked about (or of what is known)

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class GapStats:
    count: int
    idle_ns: int
    longest_ns: int
    histogram: tuple[int, ...]  # counts per GAP_BUCKETS_NS bucket (length < bound), then the rest

    @classmethod
    def of(cls, gaps: list[Gap]) -> GapStats:
        lengths = [g.length_ns for g in gaps]
        hist = [0] * (len(GAP_BUCKETS_NS) + 1)
        for n in lengths:
            hist[bisect.bisect_right(GAP_BUCKETS_NS, n)] += 1
        return cls(len(lengths), sum(lengths), max(lengths, default=0), tuple(hist))


@dataclass(frozen=True)
class DeviceActivity:
    """One process's activity on one device over [start_ns, start_ns + span) of CLOCK_MONOTONIC."""

    device: int
    start_ns: int
    known_ns: int
    idle_ns: int
    gaps: GapStats  # the gaps that ended in the stretch, each at its full length
    records_lost: int


@dataclass
class ProcessCuda:
    """What one process's ring gave in one window."""

    process: ProcessInfo
    devices: list[DeviceActivity] = field(default_factory=list)
    kernel_ns: dict[str, int] = field(default_factory=dict)  # kernel name -> ns that ran in this window
    kernel_count: dict[str, int] = field(default_factory=dict)  # kernel name -> kernels of those ns
    kernels: int = 0
    # Kernels of launches the library sampled: (outer correlation id, name, ns, weight), to be joined with the
    # stacks the uprobe on its marker took (agent/resolver.py); and what the resolver made of them: kernel ns
    # by launching stack, the kernel as leaf (each name's total apportioned over its sampled launches).
    sampled_kernels: list[tuple[int, str, int, int]] = field(default_factory=list)
    kernel_stacks: list[tuple[tuple[Frame, ...], int]] = field(default_factory=list)

    @property
    def kernels_attributed(self) -> int:
        """Of `kernels`, those whose time went under launching stacks: the kernels of the names that lead
        kernel_stacks (the rest is under the kernel's name alone)."""
        placed = {frames[-1].function for frames, _ in self.kernel_stacks}
        return sum(self.kernel_count.get(name, 0) for name in placed)


@dataclass
class CudaWindow:
    """A window's CUDA facts: what the CUPTI rings gave per process, and what the uprobes saw."""

    processes: list[ProcessCuda] = field(default_factory=list)
    # Launches by launching stack, the kernel as leaf frame (ResolvedSample.frames), counts scaled up by
    # launch_sample_every; kernel_start == len(frames): the kernel frame is no OS kernel frame.
    launches: list[ResolvedSample] = field(default_factory=list)
    calls: list[tuple[ProcessInfo, CudaCallStat]] = field(default_factory=list)
    launch_sample_every: int = 0  # 0: no uprobes (no CudaStats for them)
    launches_seen: int = 0
    launches_sampled: int = 0
    table_full: int = 0

    @property
    def empty(self) -> bool:
        return not (self.processes or self.launches or self.calls or self.launch_sample_every)

    @property
    def kernels(self) -> int:
        return sum(p.kernels for p in self.processes)

    @property
    def kernels_attributed(self) -> int:
        return sum(p.kernels_attributed for p in self.processes)


@dataclass
class Window:
    """One window, resolved and complete: everything the batch encoder needs (agent/batch.py), nothing
    it has to look up."""

    start_ns: int
    end_ns: int
    samples: list[ResolvedSample]
    stats: dict[str, int] = field(default_factory=dict)
    syscalls: list[tuple[ProcessInfo, SyscallStat]] = field(default_factory=list)
    syscall_sample_every: int = 0
    syscall_duty: float = 0.0  # fraction of the time in syscall timing windows
    syscall_counters: dict[str, int] = field(default_factory=dict)
    # Off-CPU time: `count` is nanoseconds switched out (scaled up for sampling), by the stack the thread
    # left with; empty when the agent does not record it.
    offcpu: list[ResolvedSample] = field(default_factory=list)
    frequency_hz: int = 0
    offcpu_settings: OffCpuSettings | None = None  # None: off-CPU time not recorded (no stats sent)
    # The GPU polls of the window, processes and device owners attributed; None leaves the section out.
    gpu: GpuWindow | None = None
    # (pid, start_ticks) -> labels (cgroup and pod), for every process the window names; one missing has
    # none (a process gone before it was described).
    labels: dict[tuple[int, int], Labels] = field(default_factory=dict)
    # What the CUPTI rings of processes that load our library gave in the window (agent/gpu/cupti_reader.py);
    # None or empty leaves the section out.
    cuda: CudaWindow | None = None

    def labels_of(self, proc: ProcessInfo) -> Labels:
        return self.labels.get((proc.pid, proc.start_ticks), ())
