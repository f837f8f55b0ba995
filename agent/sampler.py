"""The CPU stack sampler: loads agent/bpf/cpu_sampler.c with BCC, drains its maps into plain values.

With `SamplerConfig.off_cpu` the same program also records off-CPU time (sched:sched_switch): nanoseconds
threads spent switched out, by the stacks they left with, drained with the samples (`Drain.offcpu`). See
DEFAULT_OFFCPU_SAMPLE_EVERY and DEFAULT_OFFCPU_MIN_BLOCK_US for the cost and the defaults
(bench/offcpu.py).
"""

from __future__ import annotations

import array
import ctypes as ct
import logging
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from fleetprof.agent.bpfmaps import (
    CounterDeltas,
    DoubleBuffer,
    drain_map_bytes,
    drain_map_chunks,
    read_map_bytes,
)
from fleetprof.agent.kernel import BpfUnavailable, load_bcc
from fleetprof.agent.kernel_btf import field_offsets
from fleetprof.agent.memory import release_startup_memory
from fleetprof.agent.model import Drain, OffCpuSettings, ProcessEvent, PyFrameRef, SampleCount
from fleetprof.agent.offcpu import (
    DEFAULT_OFFCPU_EXACT_US,
    DEFAULT_OFFCPU_MIN_BLOCK_US,
    DEFAULT_OFFCPU_SAMPLE_EVERY,
    START_LAYOUT,
    START_TGID,
    Pending,
    StackCarry,
    StolenTime,
    idle_threads,
)
from fleetprof.agent.python.offsets import PyProc
from fleetprof.agent.scope import CgroupScope
from fleetprof.agent.unwind.kernel_maps import UnwindMaps

log = logging.getLogger(__name__)

BPF_SOURCE = Path(__file__).parent / "bpf" / "cpu_sampler.c"
CUDA_BPF_SOURCE = Path(__file__).parent / "bpf" / "cuda_probes.c"  # with SamplerConfig.cuda

# Mirrors of cpu_sampler.c's constants and structs: the structs and STAT_NAMES are checked against the C side
# at every load (_check_layouts) and by tests/agent/test_sampler_layout.py.
MAX_DEPTH = 127
UNWIND_FRAMES_PER_PROG = 8  # table-walked frames per tail call of unwind_step (32 tail calls at most)
PY_MAX_DEPTH = 64  # CPython frames recorded per sample (deeper stacks lose their root-most frames)
PY_MAX_THREADS = 64  # thread states searched for the sampled tid (then cached per thread)
PY_NEW_PAGES = 128  # python_new ring buffer (~1 KB per new CPython stack): 512 KB, a few hundred in flight
GPU_TAG_POLLED, GPU_TAG_TIMELINE = 1, 2  # gpu_procs values (cpu_sampler.c)
STAT_NAMES = (
    "samples",
    "user_stack_missing",
    "user_stack_errors",
    "kernel_stack_errors",
    "stack_table_full",
    "count_table_full",
    "events_lost",
    "idle_skipped",
    "python_samples",
    "python_thread_unknown",
    "python_unwind_failed",
    "python_truncated",
    "python_stack_table_full",
    "python_namespace_mismatch",
    # off-CPU (sched_switch), all 0 when it is off
    "offcpu_switches",  # switch-outs of tasks on the node (not of the idle task)
    "offcpu_sampled",  # switch-outs sampled (stacks taken)
    "offcpu_runnable",  # ... of which left runnable: preempted or yielded, waiting for a CPU
    "offcpu_recorded",  # sampled waits recorded
    "offcpu_below_min",  # sampled waits shorter than the minimum: dropped
    "offcpu_state_table_full",  # sampled switch-outs lost: per-task table could not take them
    "offcpu_count_table_full",  # waits lost: off-CPU count table full
    "offcpu_stacks_carried",  # stacks copied by BPF into the current set for a wait that crossed a drain
    # user stacks walked by tables (bpf/unwind.h): walks, how each ended, frame-pointer steps, fallbacks
    "unwind_walks",
    "unwind_end",
    "unwind_no_mapping",
    "unwind_jit",
    "unwind_no_table",
    "unwind_fp_failed",
    "unwind_read_fault",
    "unwind_depth",
    "unwind_signal",
    "unwind_unsupported",
    "unwind_fp_frames",
    "unwind_fallback",
    "unwind_jit_fp",  # frames of JIT code stepped by frame pointer back into mapped code
    # CPython walks cut short by what they met, and new stacks user space was not told of
    "python_cycle",
    "python_stale",
    "python_names_lost",
    # waits at or above the exact threshold, each recorded once at its length (SamplerConfig.offcpu_exact_us)
    "offcpu_exact",
    "offcpu_exact_untaken",  # ... of which without their user stack (did not end in a syscall's return)
    "task_storage_failed",  # a task's own BPF storage could not be made: a wait or walk not kept
    "offcpu_exact_walks",  # user stacks of long unsampled waits walked at their syscall's return
    # CUDA uprobes (bpf/cuda_probes.c), all 0 when they are off
    "cuda_launches",  # kernel launches seen, every one
    "cuda_launches_sampled",  # ... of which their stacks taken
    "cuda_nested",  # driver launches made by the runtime: not counted again
    "cuda_calls",  # timed CUDA calls that returned
    "cuda_table_full",  # launches or calls not recorded: a map full
    "stack_insert_failed",  # new stacks a stack map could not take in the moment (not full: see the C side)
)
# Counters that count what follows one event of another (follow-up: event), in the order they are bounded:
# a window reports no more of the first than of the second (bpfmaps.CounterDeltas). The collector refuses a
# batch with more CUDA launches sampled than launches; the others keep the exported rates honest.
STAT_FOLLOW_UPS = {
    "offcpu_sampled": "offcpu_switches",
    "offcpu_runnable": "offcpu_sampled",
    "offcpu_exact_untaken": "offcpu_exact",
    "cuda_launches_sampled": "cuda_launches",
}
# Computed here at each drain, not by BPF: off-CPU rows whose stack bodies were nowhere (not in the drained
# set, not carried from earlier drains). Zero unless a stack table filled up; see agent/offcpu.py StackCarry.
STAT_OFFCPU_STACKS_UNRESOLVED = "offcpu_stacks_unresolved"


# Perf event constants (include/uapi/linux/perf_event.h).
# BCC's ring-buffer callback type (bcc/table.py _RINGBUF_CB_TYPE): int (*)(void *ctx, void *data, int size)
_RINGBUF_CALLBACK = ct.CFUNCTYPE(ct.c_int, ct.c_void_p, ct.c_void_p, ct.c_int)
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0


class SampleKey(ct.Structure):
    _fields_ = [
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("cgroup_id", ct.c_uint64),
        ("user_stack", ct.c_uint64),
        ("kernel_stack", ct.c_uint64),
        ("python_stack", ct.c_uint64),
        ("gpu_slot", ct.c_uint64),
        ("comm", ct.c_char * 16),
    ]


class PyFrame(ct.Structure):
    _fields_ = [("code", ct.c_uint64), ("instr", ct.c_uint32), ("tag", ct.c_uint32)]


class PyStack(ct.Structure):
    _fields_ = [("len", ct.c_uint64), ("frames", PyFrame * PY_MAX_DEPTH)]


class PyNewStack(ct.Structure):
    """struct py_new_stack (bpf/python_stack.h): a CPython stack as first stored, and whose."""

    _fields_ = [("tgid", ct.c_uint32), ("pad", ct.c_uint32), ("stack", PyStack)]


class StackTrace(ct.Structure):
    _fields_ = [("len", ct.c_uint64), ("ip", ct.c_uint64 * MAX_DEPTH)]


class OffcpuValue(ct.Structure):
    """struct offcpu_value: what sampled waits added to an off-CPU row (offcpu{0,1})."""

    _fields_ = [("ns", ct.c_uint64), ("ran_ns", ct.c_uint64)]


def task_run_offsets() -> tuple[int, int] | None:
    """Offsets in task_struct of the scheduler's count of a task's run (se.sum_exec_runtime and
    se.prev_sum_exec_runtime: cpu_sampler.c run_ending), from the kernel's BTF; None where BPF must time a
    run by the clock instead."""
    return field_offsets("task_struct", "se.sum_exec_runtime", "se.prev_sum_exec_runtime")


@dataclass(frozen=True)
class SamplerConfig:
    frequency_hz: int = 19
    interval_s: float = 10.0
    include_idle: bool = False
    scope: CgroupScope | None = None  # --cgroup: only its tasks are sampled and their waits recorded
    seen_size: int = 65536
    python: bool = True  # walk CPython frames of processes that user space registers (set_python_process)
    python_procs: int = 4096  # CPython processes walked at once
    gpu_slot_s: float = 1.0  # time resolution of GPU-state tagging: the GPU poll interval
    # ... for processes whose GPU activity timeline the agent reads (our CUPTI library): fine enough to put a
    # sample inside a 5 ms gap. Each such sample is its own count key (no two share a slot at 19 Hz).
    gpu_fine_slot_us: int = 100
    gpu_procs: int = 4096  # processes on GPUs tagged at once
    # Off-CPU time (sched_switch). Off: no sched_switch program is attached at all.
    off_cpu: bool = True
    offcpu_sample_every: int = DEFAULT_OFFCPU_SAMPLE_EVERY  # sample 1 switch-out in N (at random); 1: all
    offcpu_min_block_us: int = DEFAULT_OFFCPU_MIN_BLOCK_US  # shorter waits are dropped (not scaled)
    # Waits at or above this are recorded exactly (once, at their length) whatever the 1-in-N sampling; 0:
    # off (no per-switch bookkeeping, no sys_exit program). See agent/offcpu.py DEFAULT_OFFCPU_EXACT_US.
    offcpu_exact_us: int = DEFAULT_OFFCPU_EXACT_US
    offcpu_runnable: bool = True  # count time runnable (preempted) as well as blocked: see cpu_sampler.c
    offcpu_counts: int = 0  # (thread, stacks, GPU slot) keys per window; 0: from the node (offcpu_sizes)
    offcpu_tasks: int = 0  # sampled switch-outs pending at once (LRU beyond); 0: from the node
    # User stacks: "eh_frame" walks them by the files' call-frame information where agent/unwind/ loaded
    # it (frame pointers elsewhere), "fp" by frame pointers only (the kernel's walk).
    unwind: str = "eh_frame"
    # Table words of all files together (4 bytes each: a row, or a 64 KB page's index entry): 16 MB, room for
    # libtorch_cpu.so's 2.6 M rows and 1.5 M more (agent/bpf/unwind.h).
    unwind_rows: int = 1 << 22
    unwind_files: int = 8192  # files with a table at once
    unwind_maps: int = 1 << 17  # executable mappings of all unwound processes (32 bytes each)
    unwind_procs: int = 16384  # processes unwound by tables at once
    # Stack maps (stacks, python_stacks) allocated by need rather than preallocated at their full size, where
    # the kernel allows it (stacks_map_flags); False: always preallocated.
    stacks_by_need: bool = True
    # CUDA uprobes (agent/gpu/cuda_probes.py): launches with their stacks, latency of the waiting calls.
    cuda: bool = False
    # 1 launch in N has its stack taken (every one is counted): the walk costs ~4 µs a launch on top of the
    # trap (bench/cuda_launch.py), 1 in 8 brings it under 0.5 µs, as our CUPTI library samples its launches
    cuda_launch_sample_every: int = 8
    cuda_procs: int = 1024  # CUDA processes at once (driver names, runtime ranges, open calls per thread)
    cuda_launches: int = 16384  # (thread, stacks, kernel) launch rows per window
    cuda_calls: int = 4096  # (process, call) rows per window

    def cuda_flags(self) -> list[str]:
        if not self.cuda:
            return ["-DCUDA=0"]
        from fleetprof.agent import cuda_api as cp

        if self.cuda_launch_sample_every < 1:
            raise ValueError("cuda_launch_sample_every must be >= 1")
        return [
            "-DCUDA=1",
            f"-DCUDA_LAUNCH_SAMPLE_EVERY={self.cuda_launch_sample_every}U",
            f"-DCUDA_LAUNCHES_SIZE={self.cuda_launches}",
            f"-DCUDA_CALLS_SIZE={self.cuda_calls}",
            f"-DCUDA_CALL_IDS={len(cp.CALLS)}",
            f"-DCUDA_HIST={cp.CUDA_HIST}",
            f"-DCUDA_NAME_LEN={cp.CUDA_NAME_LEN}",
            f"-DCUDA_PROCS_SIZE={self.cuda_procs}",
        ]

    def table_sizes(self, ncpus: int) -> tuple[int, int]:
        """(counts entries, stacks entries) per map set, sized for one interval of this node.

        A window holds at most ncpus x frequency x interval samples; each has up to two distinct stacks.
        Counts are preallocated; stacks (~1 KB an entry, x2 for the double buffer) go by need where the
        kernel allows it (stacks_map_flags), so the stacks' size is a cap, not kernel memory held. Clamped
        to [4k, 64k].
        """
        per_window = int(ncpus * self.frequency_hz * self.interval_s * 1.25)
        counts = min(max(_pow2(per_window), 4096), 65536)
        stacks = min(max(_pow2(2 * per_window), 4096), 65536)
        if self.off_cpu:
            # Sampled switch-outs store their stacks here too: room for a quarter of the off-CPU keys' worth
            # (a thread waits in few places, and its waits repeat its stacks; a full table is counted).
            stacks = min(stacks + self.offcpu_sizes(ncpus)[0] // 4, 65536)
        return counts, stacks

    def offcpu_sizes(self, ncpus: int) -> tuple[int, int]:
        """(off-CPU count entries per map set, pending switch-out entries), unless set in the config.

        Both scale with the threads a node runs, taken as ~1,000 per CPU: a window's keys are the
        (thread, stacks) pairs that waited, the pending entries the sampled threads waiting right now
        (with 1/N sampling, ~1/N of the node's sleeping threads; all of them at 1/1). Preallocated: ~150 B
        an entry, so 4096-65536 count entries take 1.2-20 MB for both sets, 8192-65536 pending 1.2-10 MB.
        Past offcpu_tasks waiting at once, the LRU drops the oldest waits (Drain.offcpu_pending shows how
        full it is).
        """
        counts = self.offcpu_counts or min(max(_pow2(1024 * ncpus), 4096), 65536)
        tasks = self.offcpu_tasks or min(max(_pow2(2048 * ncpus), 8192), 65536)
        return counts, tasks

    def unwind_flags(self) -> list[str]:
        if self.unwind not in ("eh_frame", "fp"):
            raise ValueError(f'unwind must be "eh_frame" or "fp", got {self.unwind!r}')
        return [
            f"-DUNWIND={1 if self.unwind == 'eh_frame' else 0}",
            f"-DUNWIND_ROWS={self.unwind_rows}",
            f"-DUNWIND_FILES={self.unwind_files}",
            f"-DUNWIND_MAPS={self.unwind_maps}",
            f"-DUNWIND_PROCS={self.unwind_procs}",
            f"-DUNWIND_FRAMES_PER_PROG={UNWIND_FRAMES_PER_PROG}",
            f"-DUNWIND_MAX_FRAMES={MAX_DEPTH}",
        ]

    def offcpu_flags(self, ncpus: int) -> list[str]:
        if self.offcpu_sample_every < 1 or self.offcpu_min_block_us < 0 or self.offcpu_exact_us < 0:
            raise ValueError("offcpu_sample_every must be >= 1, offcpu_min_block_us and offcpu_exact_us >= 0")
        counts, tasks = self.offcpu_sizes(ncpus)
        exact = self.offcpu_exact_us * 1000 if self.off_cpu else 0
        run = (self.off_cpu and task_run_offsets()) or (0, 0)  # 0: run_ending times by the clock
        return [
            f"-DOFF_CPU={1 if self.off_cpu else 0}",
            f"-DOFFCPU_SAMPLE_EVERY={self.offcpu_sample_every}U",
            f"-DOFFCPU_MIN_BLOCK_NS={self.offcpu_min_block_us * 1000}ULL",
            f"-DOFFCPU_EXACT_NS={exact}ULL",
            f"-DOFFCPU_RUNNABLE={1 if self.offcpu_runnable else 0}",
            f"-DOFFCPU_COUNTS_SIZE={counts}",
            f"-DOFFCPU_TASKS_SIZE={tasks}",
            f"-DTASK_SUM_EXEC_OFF={run[0]}",
            f"-DTASK_PREV_SUM_EXEC_OFF={run[1]}",
        ]

    def stacks_map_flags(self, kernel_release: str | None = None) -> int:
        """BPF_F_NO_PREALLOC for the stack maps when they go by need and the kernel lets a perf_event
        program write a map without preallocation (6.1 gave such maps an allocator that works in any
        context; older verifiers refuse the program), else 0. See cpu_sampler.c stacks{0,1}."""
        if not self.stacks_by_need:
            return 0
        return BPF_F_NO_PREALLOC if _kernel_at_least(kernel_release or platform.release(), (6, 1)) else 0

    def python_stacks_size(self, stacks_size: int) -> int:
        """Entries per python_stacks map: ~1 KB each, by need as stacks are; a quarter of the native stack
        table (Python processes are a part of a node's samples), 1024 to 16k (at most 32 MB for both sets)."""
        if not self.python:
            return 1
        return min(max(stacks_size // 4, 1024), 16384)


BPF_F_NO_PREALLOC = 1  # include/uapi/linux/bpf.h


def _kernel_at_least(release: str, version: tuple[int, int]) -> bool:
    """Whether a kernel release ("6.18.0-1-cloud-amd64") is `version` or later; False when unreadable."""
    parts = release.split("-", 1)[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= version
    except (IndexError, ValueError):
        return False


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_layouts(bpf, off_cpu: bool) -> None:  # a BCC BPF object
    """The maps' key and value types, as BCC read them from cpu_sampler.c as compiled, are our mirrors
    (same fields, offsets and sizes), and the stats array has one entry per STAT_NAMES: a field or a stat
    added on one side only fails the load rather than draining shifted numbers."""
    pairs = [
        (bpf["counts0"].Key, SampleKey),
        (bpf["counts0"].Leaf, ct.c_uint64),
        (bpf["stacks0"].Key, ct.c_uint64),
        (bpf["stacks0"].Leaf, StackTrace),
        (bpf["python_stacks0"].Leaf, PyStack),
    ]
    if off_cpu:
        pairs += [(bpf["offcpu0"].Key, SampleKey), (bpf["offcpu0"].Leaf, OffcpuValue)]
    for theirs, ours in pairs:
        if layout(theirs) != layout(ours):
            raise RuntimeError(
                f"agent/sampler.py's {ours.__name__} is out of sync with {BPF_SOURCE.name}: "
                f"{layout(ours)} here, {layout(theirs)} there"
            )
    if bpf["stats"].max_entries != len(STAT_NAMES):
        raise RuntimeError(
            f"agent/sampler.py's STAT_NAMES ({len(STAT_NAMES)}) is out of sync with {BPF_SOURCE.name}'s "
            f"NSTATS ({bpf['stats'].max_entries})"
        )


def layout(ctype: type) -> tuple:
    """A ctypes type as (size, ((field, offset, layout), ...)) for structures, its size for the rest."""
    fields = getattr(ctype, "_fields_", None)
    if fields is None:
        return (ct.sizeof(ctype),)
    return (
        ct.sizeof(ctype),
        tuple((name, getattr(ctype, name).offset, layout(typ)) for name, typ, *_ in fields),
    )


# The drained maps are parsed from bytes with these (struct sample_key, u64 count, struct offcpu_value,
# struct py_frame), not copied into a ctypes object an entry: a drain's cost per row is mostly this
# (bench/README.md "Agent cost per sample"). _check_structs ties them to the ctypes mirrors.
_KEY = struct.Struct("=IIQQQQQ16s")
_COUNT = struct.Struct("=Q")
_OFFCPU_VALUE = struct.Struct("=QQ")
_PY_FRAME = struct.Struct("=QII")
_PY_STACK_WORDS = ct.sizeof(PyStack) // 8


def _check_structs() -> None:
    for fmt, ctype in ((_KEY, SampleKey), (_OFFCPU_VALUE, OffcpuValue), (_PY_FRAME, PyFrame)):
        if fmt.size != ct.sizeof(ctype):
            raise RuntimeError(
                f"agent/sampler.py: {fmt.format} is {fmt.size} bytes, {ctype.__name__} is {ct.sizeof(ctype)}"
            )


_check_structs()


def _sample_counts(
    keys: Iterable[tuple], counts: list[int], idle: set[tuple[int, int]] = frozenset()
) -> list[SampleCount]:
    """Drained sample keys (struct sample_key, unpacked by _KEY) and their counts as rows; `idle`: (tgid,
    tid) of the threads whose rows are marked idle (off-CPU rows)."""
    comms: dict[bytes, str] = {}  # a window holds a few hundred thread names, and many rows of each
    rows = []
    for (tgid, tid, cgroup, user, kernel, python, slot, raw), count in zip(keys, counts, strict=True):
        comm = comms.get(raw)
        if comm is None:
            comm = comms[raw] = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        rows.append(
            SampleCount(tgid, tid, cgroup, comm, user, kernel, count, python, slot, (tgid, tid) in idle)
        )
    return rows


def _stacks(keys: bytes, values: bytes) -> dict[int, tuple[int, ...]]:
    """Drained stacks{0,1} entries (u64 id, struct stack_trace) as id -> addresses, leaf first."""
    ids = memoryview(keys).cast("Q")
    words = memoryview(values).cast("Q")  # no copy of the values' bytes
    stride = MAX_DEPTH + 1
    out = {}
    for i, sid in enumerate(ids):
        base = i * stride
        out[sid] = tuple(words[base + 1 : base + 1 + min(words[base], MAX_DEPTH)])
    return out


def _python_stacks(keys: bytes, values: bytes) -> dict[int, tuple[PyFrameRef, ...]]:
    """Drained python_stacks{0,1} entries (u64 id, struct py_stack) as id -> frames, leaf first."""
    ids = memoryview(keys).cast("Q")
    size = _PY_STACK_WORDS * 8
    out = {}
    for i, sid in enumerate(ids):
        base = i * size
        n = min(int.from_bytes(values[base : base + 8], sys.byteorder), PY_MAX_DEPTH)
        out[sid] = tuple(_PY_FRAME.iter_unpack(values[base + 8 : base + 8 + n * _PY_FRAME.size]))
    return out


class CpuSampler:
    """Owns the BPF program; `drain()` returns one window of samples; thread-safe against itself."""

    def __init__(
        self,
        config: SamplerConfig,
        on_process_event: Callable[[int, int], None] | None = None,
        on_python_stack: Callable[[int, tuple[PyFrameRef, ...]], None] | None = None,
    ):
        """`on_process_event(tgid, kind)`: a process to describe, exec'd or gone; `on_python_stack(tgid,
        frames)`: a CPython stack (leaf first) as BPF first stored it in a window. Both are called from
        `consume_events`."""
        bcc = load_bcc()
        self._config = config
        self._lock = threading.Lock()
        self._gpu_lock = threading.Lock()
        self._polled_pids: set[int] = set()
        self._timeline_pids: set[int] = set()
        self._gpu_tags: dict[int, int] = {}  # pid -> GPU_TAG_* as written to gpu_procs
        self._gpu_table = None  # the BCC map, looked up once the BPF object exists
        self.counts_size, self.stacks_size = config.table_sizes(os.cpu_count() or 1)
        cflags = [
            # struct pt_regs differs by architecture (cpu_sampler.c user_regs, syscall_nr)
            f"-DARCH_ARM64={1 if platform.machine() == 'aarch64' else 0}",
            f"-DMAX_DEPTH={MAX_DEPTH}",
            f"-DCOUNTS_SIZE={self.counts_size}",
            f"-DSTACKS_SIZE={self.stacks_size}",
            f"-DSEEN_SIZE={config.seen_size}",
            f"-DINCLUDE_IDLE={1 if config.include_idle else 0}",
            f"-DSTACKS_MAP_FLAGS={config.stacks_map_flags()}",
            f"-DPYTHON_STACKS={1 if config.python else 0}",
            f"-DPY_MAX_DEPTH={PY_MAX_DEPTH}",
            f"-DPY_MAX_THREADS={PY_MAX_THREADS}",
            f"-DPY_STACKS_SIZE={config.python_stacks_size(self.stacks_size)}",
            f"-DPY_PROCS_SIZE={config.python_procs}",
            f"-DPY_NEW_PAGES={PY_NEW_PAGES if config.python else 1}",
            f"-DGPU_SLOT_NS={int(config.gpu_slot_s * 1e9)}ULL",
            f"-DGPU_FINE_SLOT_NS={config.gpu_fine_slot_us * 1000}ULL",
            f"-DGPU_PROCS_SIZE={config.gpu_procs}",
            *config.offcpu_flags(os.cpu_count() or 1),
            *config.unwind_flags(),
            *config.cuda_flags(),
            *(config.scope.cflags() if config.scope else []),
            f"-I{BPF_SOURCE.parent}",
        ]
        try:
            # The CUDA probes are appended as text: BCC makes programs of the main file's functions only.
            text = BPF_SOURCE.read_text()
            if config.cuda:
                text += "\n" + CUDA_BPF_SOURCE.read_text()
            self._bpf = bcc.BPF(text=text.encode(), cflags=cflags)
        except Exception as exc:  # BCC raises bare Exception for compile and verifier failures
            raise BpfUnavailable(f"the CPU sampler BPF program did not compile or load: {exc}") from exc
        self._buffers = DoubleBuffer(self._bpf["control"])
        self._gpu_table = self._bpf["gpu_procs"]
        self._counts = (self._bpf["counts0"], self._bpf["counts1"])
        self._stacks = (self._bpf["stacks0"], self._bpf["stacks1"])
        self._python_stacks = (self._bpf["python_stacks0"], self._bpf["python_stacks1"])
        self._python_procs = self._bpf["python_procs"]
        if config.off_cpu:
            self._offcpu = (self._bpf["offcpu0"], self._bpf["offcpu1"])
            self._offcpu_starts = self._bpf["offcpu_starts"]
        _check_layouts(self._bpf, config.off_cpu)
        self.cuda = None  # agent/gpu/cuda_probes.py CudaProbes, with config.cuda
        if config.cuda:
            from fleetprof.agent.cuda_probes import CudaProbes, check_layouts

            check_layouts(self._bpf)
            self.cuda = CudaProbes(self._bpf, config.cuda_launch_sample_every)
        self._carry = StackCarry()
        # Taken once a drain, with the off-CPU rows it judges; steal too only where BPF times a run by the
        # clock (the scheduler's count leaves it out already).
        self._stolen = StolenTime(steal=task_run_offsets() is None)
        self._offcpu_settings = (
            OffCpuSettings(config.offcpu_sample_every, config.offcpu_min_block_us * 1000)
            if config.off_cpu
            else None
        )
        self._stat_deltas = CounterDeltas(self._bpf["stats"], STAT_NAMES, STAT_FOLLOW_UPS)
        if config.unwind == "eh_frame":
            # One step program per program type that walks (cpu_sampler.c): a tail call stays in its type.
            steps = [(b"unwind_step", bcc.BPF.PERF_EVENT, "unwind_progs")]
            if config.off_cpu:
                steps.append((b"unwind_step_tp", bcc.BPF.TRACEPOINT, "unwind_progs_tp"))
                if config.offcpu_exact_us:
                    steps.append((b"unwind_step_raw", bcc.BPF.RAW_TRACEPOINT, "unwind_progs_raw"))
            if config.cuda:
                steps.append((b"unwind_step_kp", bcc.BPF.KPROBE, "unwind_progs_kp"))
            for name, prog_type, array in steps:
                try:
                    step = self._bpf.load_func(name, prog_type)
                except Exception as exc:  # the verifier's answer
                    raise BpfUnavailable(f"the table unwinder did not load (try --unwind=fp): {exc}") from exc
                self._bpf[array][ct.c_int(0)] = ct.c_int(step.fd)
        self._events_cb = on_process_event
        self._extra_callbacks: list = []
        if on_process_event is not None:
            self._bpf["events"].open_ring_buffer(self._on_event)
        self._python_cb = on_python_stack
        if on_python_stack is not None and config.python:
            self._bpf["python_new"].open_ring_buffer(self._on_python_stack)
        try:
            self._bpf.attach_perf_event(
                ev_type=PERF_TYPE_SOFTWARE,
                ev_config=PERF_COUNT_SW_CPU_CLOCK,
                fn_name=b"on_cpu_sample",
                sample_freq=config.frequency_hz,
            )
        except Exception as exc:
            raise BpfUnavailable(f"cannot attach to the CPU clock perf event: {exc}") from exc
        release_startup_memory()  # LLVM's heap garbage and ~85 MB of its code pages, needed only to compile

    @property
    def frequency_hz(self) -> int:
        return self._config.frequency_hz

    @property
    def offcpu_sample_every(self) -> int:
        """Off-CPU counts are scaled by this (1 in N switch-outs sampled); 0 when off-CPU is off."""
        return self._config.offcpu_sample_every if self._config.off_cpu else 0

    # -- process events --------------------------------------------------------------------------
    def _on_event(self, _ctx: object, data: int, _size: int) -> None:
        ev = ct.cast(data, ct.POINTER(ProcessEvent)).contents
        assert self._events_cb is not None
        self._events_cb(ev.tgid, ev.kind)

    def _on_python_stack(self, _ctx: object, data: int, _size: int) -> None:
        ev = ct.cast(data, ct.POINTER(PyNewStack)).contents
        frames = tuple((f.code, f.instr, f.tag) for f in ev.stack.frames[: min(ev.stack.len, PY_MAX_DEPTH)])
        assert self._python_cb is not None
        try:
            self._python_cb(ev.tgid, frames)
        except Exception:  # one stack must not stop the events behind it (ctypes would only print it)
            log.exception("naming a new Python stack failed")

    def events_fd(self) -> int:
        """A descriptor that polls readable while process events wait (libbpf's epoll descriptor over the
        ring buffers): a thread can sleep on it, and on its own stop signal, without waking on a timer."""
        from bcc.libbcc import lib as bcclib

        epoll_fd = bcclib.ring_buffer__epoll_fd
        epoll_fd.argtypes, epoll_fd.restype = [ct.c_void_p], ct.c_int
        return epoll_fd(self._bpf._ringbuf_manager)  # BCC keeps libbpf's struct ring_buffer there

    def consume_events(self) -> None:
        """Deliver pending process events to their callbacks; call from one dedicated thread."""
        self._bpf.ring_buffer_consume()

    def poll_also(self, table, callback: Callable[[object, int, int], None]) -> None:
        """Deliver another BPF object's ring buffer (`table`, e.g. the syscall tracer's process events) from
        `consume_events` too: one thread and one epoll descriptor for both. `callback(ctx, data, size)` as
        BCC's."""

        def deliver(ctx: object, data: int, size: int) -> int:
            try:
                callback(ctx, data, size)
            except Exception:  # one bad event must not stop the others (ctypes would only print it)
                log.exception("process event handling failed")
            return 0

        fn = _RINGBUF_CALLBACK(deliver)
        self._extra_callbacks.append(fn)  # ctypes keeps no reference: BCC would call freed memory
        self._bpf._open_ring_buffer(table.map_fd, fn)  # adds it to this object's ring-buffer manager

    # -- CPython processes ------------------------------------------------------------------------
    def set_gpu_processes(self, pids: set[int]) -> None:
        """The processes holding a GPU context now (NVML): their samples get time slots of the poll
        interval (SampleCount.gpu_slot)."""
        with self._gpu_lock:
            self._polled_pids = set(pids)
            self._write_gpu_tags()

    def set_gpu_timeline_processes(self, pids: set[int]) -> None:
        """The processes whose GPU activity timeline the agent reads (our CUPTI library): their samples get
        fine time slots (GPU_SLOT_FINE), whether NVML sees them or not."""
        with self._gpu_lock:
            self._timeline_pids = set(pids)
            self._write_gpu_tags()

    def _write_gpu_tags(self) -> None:
        wanted = dict.fromkeys(self._polled_pids, GPU_TAG_POLLED)
        wanted.update(dict.fromkeys(self._timeline_pids, GPU_TAG_TIMELINE))
        if wanted == self._gpu_tags:
            return
        table = self._gpu_table
        for pid in set(self._gpu_tags) - set(wanted):
            try:
                del table[ct.c_uint32(pid)]
            except KeyError:
                pass
            del self._gpu_tags[pid]
        for pid, tag in wanted.items():
            if self._gpu_tags.get(pid) == tag:
                continue
            try:
                table[ct.c_uint32(pid)] = ct.c_uint8(tag)
            except Exception:  # BCC raises bare Exception: the map is full, go untagged
                continue
            self._gpu_tags[pid] = tag

    def set_python_process(self, pid: int, proc: PyProc) -> None:
        """Walk the CPython frames of `pid` from now on (BPF forgets it at exec and exit)."""
        if self._config.python:
            self._python_procs[ct.c_uint32(pid)] = proc

    def forget_python_process(self, pid: int) -> None:
        try:
            del self._python_procs[ct.c_uint32(pid)]
        except KeyError:
            pass

    # -- draining --------------------------------------------------------------------------------
    def drain(self) -> Drain:
        """Flip to the other map set, then read and empty the one that was being written."""
        with self._lock:
            idle, start_ns, end_ns = self._buffers.flip()
            # After the grace, before the drain: every wait that ends later is one of these (StackCarry).
            pending = self._pending_starts() if self._config.off_cpu else []
            keys, values = drain_map_bytes(self._counts[idle], _KEY.size, _COUNT.size)
            samples = _sample_counts(_KEY.iter_unpack(keys), array.array("Q", values).tolist())
            offcpu = self._offcpu_rows(idle) if self._config.off_cpu else []
            # A batch at a time: a full stack map's bytes are tens of MB, its parsed stacks a few.
            stacks: dict[int, tuple[int, ...]] = {}
            for keys, values in drain_map_chunks(self._stacks[idle], 8, ct.sizeof(StackTrace)):
                stacks.update(_stacks(keys, values))
            python_stacks: dict[int, tuple[PyFrameRef, ...]] = {}
            for keys, values in drain_map_chunks(self._python_stacks[idle], 8, ct.sizeof(PyStack)):
                python_stacks.update(_python_stacks(keys, values))
            stats = self._stat_deltas()
            if self._config.off_cpu:
                stats[STAT_OFFCPU_STACKS_UNRESOLVED] = self._carry.fill(offcpu, stacks, python_stacks)
                self._carry.keep(pending, stacks, python_stacks)
            cuda = self.cuda.drain(idle, stats) if self.cuda is not None else None
            return Drain(
                start_ns,
                end_ns,
                samples,
                stacks,
                stats,
                python_stacks,
                offcpu,
                len(pending),
                frequency_hz=self._config.frequency_hz,
                offcpu_settings=self._offcpu_settings,
                cuda=cuda,
            )

    def _offcpu_rows(self, idle_set: int) -> list[SampleCount]:
        keys, values = drain_map_bytes(self._offcpu[idle_set], _KEY.size, _OFFCPU_VALUE.size)
        rows = list(_KEY.iter_unpack(keys))
        waits = list(_OFFCPU_VALUE.iter_unpack(values))
        threads = (((k[0], k[1]), ns, ran) for k, (ns, ran) in zip(rows, waits, strict=True))
        idle = idle_threads(threads, self._stolen.take_ns())  # by (tgid, tid): see idle_threads
        return _sample_counts(rows, [ns for ns, _ in waits], idle)

    def unwind_maps(self) -> UnwindMaps | None:
        """The table unwinder's maps (agent/unwind/), or None when stacks are walked by frame pointer."""
        if self._config.unwind != "eh_frame":
            return None
        b = self._bpf
        return UnwindMaps(
            b["unwind_rows"],
            b["unwind_rules"],
            b["unwind_files"],
            b["unwind_maps"],
            b["unwind_procs"],
            b["unwind_wanted"],
            b["unwind_unmapped"],
        )

    def offcpu_pending(self) -> list[tuple[int, int]]:
        """(tid, tgid) of every thread whose sampled switch-out waits for it to run again."""
        if not self._config.off_cpu:
            return []
        return [(tid, start[START_TGID]) for tid, start in self._pending_starts()]

    def _pending_starts(self) -> Pending:
        keys, values = read_map_bytes(self._offcpu_starts, 4, START_LAYOUT.size)
        tids = [t for (t,) in struct.iter_unpack("=I", keys)]
        return list(zip(tids, START_LAYOUT.iter_unpack(values), strict=True))

    def close(self) -> None:
        with self._lock:
            if self.cuda is not None:
                self.cuda.close()
            self._bpf.cleanup()
