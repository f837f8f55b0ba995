"""The CPU stack sampler: loads agent/bpf/cpu_sampler.c with BCC, drains its maps into plain values."""

from __future__ import annotations

import ctypes as ct
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleetprof.agent.bpfmaps import CounterDeltas, DoubleBuffer
from fleetprof.agent.bpfmaps import drain_map as _drain_map
from fleetprof.agent.kernel import BpfUnavailable, load_bcc
from fleetprof.agent.memory import release_startup_memory
from fleetprof.agent.python.offsets import PyProc

log = logging.getLogger(__name__)

BPF_SOURCE = Path(__file__).parent / "bpf" / "cpu_sampler.c"

# Mirrors of cpu_sampler.c's constants and structs (keep in sync with the .c file).
MAX_DEPTH = 127
PY_MAX_DEPTH = 64  # CPython frames recorded per sample (deeper stacks lose their root-most frames)
PY_MAX_THREADS = 64  # thread states searched for the sampled tid (then cached per thread)
STACK_NONE = 0
STACK_LOST = 1
EVENT_NEW, EVENT_EXEC, EVENT_EXIT = 1, 2, 3  # bpf/process_event.h
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
)

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


class StackTrace(ct.Structure):
    _fields_ = [("len", ct.c_uint64), ("ip", ct.c_uint64 * MAX_DEPTH)]


class ProcessEvent(ct.Structure):
    """struct process_event (bpf/process_event.h), sent by this sampler and by the syscall tracer."""

    _fields_ = [("tgid", ct.c_uint32), ("kind", ct.c_uint32), ("ns", ct.c_uint64)]


@dataclass(frozen=True)
class SampleCount:
    tgid: int
    tid: int
    cgroup_id: int
    comm: str
    user_stack: int  # stack id, STACK_NONE or STACK_LOST
    kernel_stack: int
    count: int
    python_stack: int = STACK_NONE  # CPython frames of the thread, for processes running one
    gpu_slot: int = 0  # processes on a GPU: which GPU_SLOT of CLOCK_MONOTONIC the samples fell in, + 1


# One CPython frame as BPF recorded it: (code address, instruction pointer - code address, owner<<24 |
# qualname fingerprint); see struct py_frame in agent/bpf/python_stack.h.
PyFrameRef = tuple[int, int, int]


@dataclass
class Drain:
    """Everything one drain produced: counts, the stacks they reference (leaf first), stat deltas."""

    start_ns: int
    end_ns: int
    samples: list[SampleCount]
    stacks: dict[int, tuple[int, ...]]
    stats: dict[str, int] = field(default_factory=dict)
    python_stacks: dict[int, tuple[PyFrameRef, ...]] = field(default_factory=dict)  # leaf first


@dataclass(frozen=True)
class SamplerConfig:
    frequency_hz: int = 19
    interval_s: float = 10.0
    include_idle: bool = False
    seen_size: int = 65536
    python: bool = True  # walk CPython frames of processes that user space registers (set_python_process)
    python_procs: int = 4096  # CPython processes walked at once
    gpu_slot_s: float = 1.0  # time resolution of GPU-state tagging: the GPU poll interval
    gpu_procs: int = 4096  # processes on GPUs tagged at once

    def table_sizes(self, ncpus: int) -> tuple[int, int]:
        """(counts entries, stacks entries) per map set, sized for one interval of this node.

        A window holds at most ncpus x frequency x interval samples; each has up to two distinct stacks.
        Preallocated (allocation from the perf event's IRQ context can fail otherwise), so the size is
        kernel memory: ~1 KB per stack entry, x2 for the double buffer. Clamped to [4k, 64k].
        """
        per_window = int(ncpus * self.frequency_hz * self.interval_s * 1.25)
        counts = min(max(_pow2(per_window), 4096), 65536)
        stacks = min(max(_pow2(2 * per_window), 4096), 65536)
        return counts, stacks

    def python_stacks_size(self, stacks_size: int) -> int:
        """Entries per python_stacks map: ~1 KB each, preallocated; a quarter of the native stack table
        (Python processes are a part of a node's samples), 1024 to 16k (at most 32 MB for both sets)."""
        if not self.python:
            return 1
        return min(max(stacks_size // 4, 1024), 16384)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class CpuSampler:
    """Owns the BPF program; `drain()` returns one window of samples; thread-safe against itself."""

    def __init__(self, config: SamplerConfig, on_process_event: Callable[[int, int], None] | None = None):
        bcc = load_bcc()
        self._config = config
        self._lock = threading.Lock()
        self._gpu_lock = threading.Lock()
        self._gpu_pids: set[int] = set()
        self._gpu_table = None  # the BCC map, looked up once the BPF object exists
        self.counts_size, self.stacks_size = config.table_sizes(os.cpu_count() or 1)
        cflags = [
            f"-DMAX_DEPTH={MAX_DEPTH}",
            f"-DCOUNTS_SIZE={self.counts_size}",
            f"-DSTACKS_SIZE={self.stacks_size}",
            f"-DSEEN_SIZE={config.seen_size}",
            f"-DINCLUDE_IDLE={1 if config.include_idle else 0}",
            "-DSTACKS_MAP_FLAGS=0",
            f"-DPYTHON_STACKS={1 if config.python else 0}",
            f"-DPY_MAX_DEPTH={PY_MAX_DEPTH}",
            f"-DPY_MAX_THREADS={PY_MAX_THREADS}",
            f"-DPY_STACKS_SIZE={config.python_stacks_size(self.stacks_size)}",
            f"-DPY_PROCS_SIZE={config.python_procs}",
            f"-DGPU_SLOT_NS={int(config.gpu_slot_s * 1e9)}ULL",
            f"-DGPU_PROCS_SIZE={config.gpu_procs}",
            f"-I{BPF_SOURCE.parent}",
        ]
        try:
            self._bpf = bcc.BPF(src_file=str(BPF_SOURCE).encode(), cflags=cflags)
        except Exception as exc:  # BCC raises bare Exception for compile and verifier failures
            raise BpfUnavailable(f"the CPU sampler BPF program did not compile or load: {exc}") from exc
        self._buffers = DoubleBuffer(self._bpf["control"])
        self._gpu_table = self._bpf["gpu_procs"]
        self._counts = (self._bpf["counts0"], self._bpf["counts1"])
        self._stacks = (self._bpf["stacks0"], self._bpf["stacks1"])
        self._python_stacks = (self._bpf["python_stacks0"], self._bpf["python_stacks1"])
        self._python_procs = self._bpf["python_procs"]
        self._stat_deltas = CounterDeltas(self._bpf["stats"], STAT_NAMES)
        self._events_cb = on_process_event
        self._extra_callbacks: list = []
        if on_process_event is not None:
            self._bpf["events"].open_ring_buffer(self._on_event)
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

    # -- process events --------------------------------------------------------------------------
    def _on_event(self, _ctx: object, data: int, _size: int) -> None:
        ev = ct.cast(data, ct.POINTER(ProcessEvent)).contents
        assert self._events_cb is not None
        self._events_cb(ev.tgid, ev.kind)

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

    def poll_also(self, table, callback: Callable[[object, int, int], None]) -> None:  # noqa: ANN001
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
        """The processes holding a GPU context now: their samples get time slots (SampleCount.gpu_slot)."""
        with self._gpu_lock:
            if pids == self._gpu_pids:
                return
            table = self._gpu_table
            for pid in self._gpu_pids - pids:
                try:
                    del table[ct.c_uint32(pid)]
                except KeyError:
                    pass
                self._gpu_pids.discard(pid)
            for pid in pids - self._gpu_pids:
                try:
                    table[ct.c_uint32(pid)] = ct.c_uint8(1)
                except Exception:  # noqa: BLE001 - BCC raises bare Exception: the map is full, go untagged
                    continue
                self._gpu_pids.add(pid)

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
            samples = [
                SampleCount(
                    tgid=k.tgid,
                    tid=k.tid,
                    cgroup_id=k.cgroup_id,
                    comm=k.comm.decode("utf-8", "replace"),
                    user_stack=k.user_stack,
                    kernel_stack=k.kernel_stack,
                    count=v,
                    python_stack=k.python_stack,
                    gpu_slot=k.gpu_slot,
                )
                for k, v in _drain_map(self._counts[idle], SampleKey, ct.c_uint64)
            ]
            stacks = {
                k: tuple(v.ip[: min(v.len, MAX_DEPTH)])
                for k, v in _drain_map(self._stacks[idle], ct.c_uint64, StackTrace)
            }
            python_stacks = {
                k: tuple((f.code, f.instr, f.tag) for f in v.frames[: min(v.len, PY_MAX_DEPTH)])
                for k, v in _drain_map(self._python_stacks[idle], ct.c_uint64, PyStack)
            }
            return Drain(start_ns, end_ns, samples, stacks, self._stat_deltas(), python_stacks)

    def close(self) -> None:
        with self._lock:
            self._bpf.cleanup()
