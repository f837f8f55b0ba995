"""Turns a raw drain (pids, stack ids, addresses) into attributed, symbolized samples (plain values)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleetprof.agent.attribution import Attributor
from fleetprof.agent.cuda_api import library_kind
from fleetprof.agent.model import (
    CUDA_API_DRIVER,
    CUDA_API_GRAPH,
    CUDA_API_MARKER,
    CUDA_API_RUNTIME,
    GPU_SLOT_FINE,
    STACK_LOST,
    STACK_NONE,
    STACK_RESERVED,
    STACK_SYSCALL,
    STACK_UNTAKEN,
    CgroupIdentity,
    CudaLaunchCount,
    CudaWindow,
    DeviceAssignment,
    Drain,
    Frame,
    GpuWindow,
    Labels,
    ProcessCuda,
    ProcessInfo,
    ResolvedSample,
    SampleCount,
    SyscallDrain,
    Window,
)
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.python.codes import PYTHON_MODULE
from fleetprof.agent.python.merge import PythonFrames
from fleetprof.agent.python.unwinder import LOST_PYTHON_STACK, PythonStacks
from fleetprof.agent.symbols.modules import ModuleWatch
from fleetprof.agent.symbols.symbolizer import Symbolizer, by_module, module_runs, unknown_frame
from fleetprof.agent.symbols.unsymbolized import Run, UnsymbolizedAddresses
from fleetprof.agent.syscall_names import syscall_name

log = logging.getLogger(__name__)

LOST_USER_STACK = Frame("[user stack lost: stack map full or busy]", "[fleetprof]")
LOST_KERNEL_STACK = Frame("[kernel stack lost: stack map full or busy]", "[fleetprof]", kernel=True)
NO_STACK = Frame("[no stack]", "[fleetprof]")
# A wait at or above the exact threshold, recorded at its length, whose switch-out was not sampled and which
# did not end in a return to the user context it left (preempted or faulted in user code): no stack.
UNTAKEN_STACK = Frame("[long wait: stack not taken]", "[fleetprof]")
UNMAPPED = "[unmapped]"
# Leaf frames of launches whose kernel has no name: a graph (its kernels are not known at launch), a driver
# handle whose naming call was not seen (made before the probes were attached).
CUDA_MODULE = "[cuda]"
CUDA_GRAPH = Frame("[cuda graph]", CUDA_MODULE)
UNNAMED_KERNEL = Frame("[unnamed kernel]", CUDA_MODULE)
# User frames of a process that was gone before its mappings could be read (it lived between two looks, or
# its first events were lost): its addresses cannot be named, nor told apart from garbage.
NOT_DESCRIBED = Frame("[process gone before its mappings were read]", "[fleetprof]")
# Where the CPU was (the leaf), in a mapping the agent never saw: the process mapped it after its last
# description and was gone before the mappings could be read again.
UNSEEN_MAPPING = "[unseen mapping]"
# How the addresses of a file that no symbol covers are shown (--unsymbolized): as one frame per file
# ("sha256sum": symbolizer.by_module), or one frame per address ("[unknown] (sha256sum+0x41fe)").
UNSYMBOLIZED_MODULE = "module"
UNSYMBOLIZED_ADDRESS = "address"
UNSYMBOLIZED_CHOICES = (UNSYMBOLIZED_MODULE, UNSYMBOLIZED_ADDRESS)


class GpuStates(Protocol):
    """What the resolver asks of the GPUs' busy/idle timeline (agent/gpu/timeline.py GpuTimeline)."""

    def state(self, pid: int, t: float) -> str | None:  # "busy", "idle", None: on no GPU known at t
        ...


@dataclass(frozen=True)
class GpuSources:
    """Where a window's GPU facts come from: the busy/idle timeline of the processes on GPUs, the length of
    a sample's GPU time slot (SamplerConfig.gpu_slot_s), and a device's owner (uuid -> its pod's container,
    GpuOwners.owner)."""

    timeline: GpuStates | None
    slot_s: float
    owner: Callable[[str], DeviceAssignment | None]
    # (pid, CLOCK_MONOTONIC ns) -> "busy"/"idle"/None from the process's own CUPTI activity timeline, for
    # samples in fine slots (GPU_SLOT_FINE, of fine_slot_ns): processes that load our CUPTI library.
    activity: Callable[[int, int], str | None] | None = None
    fine_slot_ns: int = 100_000


def window_processes(window: Window) -> list[ProcessInfo]:
    """Every process `window` names, in the order the batch meets them (samples, off-CPU, syscalls, GPUs)."""
    procs = [s.process for s in window.samples]
    procs += [s.process for s in window.offcpu]
    procs += [p for p, _ in window.syscalls]
    if window.gpu is not None:
        procs += [pw.process for pw in window.gpu.processes if pw.process is not None]
    if window.cuda is not None:
        procs += [pc.process for pc in window.cuda.processes]
        procs += [s.process for s in window.cuda.launches]
        procs += [p for p, _ in window.cuda.calls]
    return procs


def _no_owner(_uuid: str) -> DeviceAssignment | None:
    return None


class _Lru(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.size:
            self.popitem(last=False)


class _Described(_Lru):
    """An _Lru of answers read against one description of a process: each is kept with the mappings it
    was read against and holds only while the process has those. A process described again keeps its pid
    and start time (an exec, a dlopen), and its next stack with a known id must be read against the new
    mappings: kept by (pid, start time, stack id) alone, a stack first read before a dlopen mapped its
    library stayed "[unseen mapping]" for the rest of the process's life. ProcessTable keeps the mappings
    object while a re-read finds them unchanged."""

    def lookup(self, key, mappings):
        hit = self.get(key)
        return hit[1] if hit is not None and hit[0] is mappings else None

    def keep(self, key, mappings, value) -> None:
        self.put(key, (mappings, value))


class Resolver:
    """Symbolizes each distinct stack once; caches per (process, stack id) across drains (bounded).

    Stack ids are content hashes of the addresses, so the same id in the same process is the same
    stack in every window: the cache makes steady-state drains nearly free.
    """

    def __init__(
        self,
        processes: ProcessTable,
        symbolizer: Symbolizer,
        cache_size: int = 32768,
        python: PythonStacks | None = None,
        modules: ModuleWatch | None = None,
        unsymbolized: str = UNSYMBOLIZED_MODULE,
        addresses: UnsymbolizedAddresses | None = None,
        attributor: Attributor | None = None,
        gpu: GpuSources | None = None,
    ):
        """`modules`: the kernel's module list, looked at once a drain; when it changed, kernel symbols are
        read again (and kernel stacks named with the old ones forgotten). `unsymbolized`: one of
        UNSYMBOLIZED_CHOICES; with "module", `addresses` is given the samples at the addresses the merge
        hides. `attributor` labels each process of a window (cgroup and pod, as of that window); `gpu`:
        where samples on GPUs find their GPUs' state, and GPU polls their owners (None: no GPUs polled)."""
        if unsymbolized not in UNSYMBOLIZED_CHOICES:
            raise ValueError(
                f"unsymbolized must be one of {', '.join(UNSYMBOLIZED_CHOICES)}: {unsymbolized!r}"
            )
        self._by_module = unsymbolized == UNSYMBOLIZED_MODULE
        self._addresses = addresses if self._by_module else None
        self._processes = processes
        self._modules = modules
        self._symbolizer = symbolizer
        self._python = python
        self._attributor = attributor or Attributor()
        self._gpu = gpu
        # (pid, start, stack id) -> (frames, cut at an unmapped address, runs of a file's unsymbolized code)
        self._user_cache = _Described(cache_size)
        self._kernel_cache = _Lru(cache_size)
        self._py_named = _Lru(cache_size // 2)
        self._py_merged = _Described(cache_size)
        self._py_by_content = _Lru(cache_size)  # (native frames, Python frames) -> merged, any process
        self._cut = 0  # samples of this window whose user stack was cut at an unmapped address
        self._unsymbolized = 0  # ... and whose user stack holds code of a file that no symbol covers
        self._symbol_generation = symbolizer.generation
        # (pid, start, correlation id) -> the launching stack (root first, ending in the CUDA API function)
        # of a launch our CUPTI library sampled, until its kernel's record is read (a window or two later)
        self._launch_stacks = _Lru(cache_size)
        self._window_processes: dict[tuple[int, bool], ProcessInfo] = {}  # (pid, mappings) -> as in resolve

    def resolve(
        self,
        drain: Drain,
        syscalls: SyscallDrain | None = None,
        gpu: GpuWindow | None = None,
        cuda: CudaWindow | None = None,
    ) -> Window:
        """The complete window of `drain`: symbolized samples and off-CPU rows with their GPU state, the
        syscall counts of `syscalls` and the GPU polls `gpu` of the same window (each process attributed,
        each device given its owner), and the labels of every process named."""
        reloaded = 0
        if self._modules is not None and self._modules.changed():
            # A module loaded or unloaded: its addresses name other functions now, or none.
            self._symbolizer.reload_kernel_symbols()
            self._kernel_cache.clear()
            reloaded = 1
        if self._symbolizer.generation != self._symbol_generation:
            # A debug file arrived (debuginfod): stacks through that file are named now.
            self._symbol_generation = self._symbolizer.generation
            self._user_cache.clear()
            self._py_merged.clear()
            self._py_by_content.clear()
        samples: list[ResolvedSample] = []
        # The window's processes as first looked up (or remapped, or renamed) in it: a window's rows name
        # few processes thousands of times, and each table lookup takes the table's lock, which the process
        # events' thread holds while it captures a process.
        self._window_processes = {}
        unknown_process = 0
        remapped: set[int] = set()
        python = (
            _PythonWindow(self._python, self._py_named, self._py_merged, self._py_by_content)
            if self._python is not None
            else None
        )
        gpu_state = self._gpu_states()
        self._cut = self._unsymbolized = 0
        for s in drain.samples:
            proc = self._process(s.tgid, s.comm, tid=s.tid)
            if not proc.start_ticks:
                # Exited before we could describe it (short-lived, or an event was lost): keep the
                # samples with what the kernel told us; user addresses cannot be symbolized.
                unknown_process += s.count
            samples.append(self._resolved(s, proc, drain, remapped, python, s.count, gpu_state))
        cut, unsymbolized = self._cut, self._unsymbolized
        # Off-CPU rows take the same path; their counts are nanoseconds, so the Python walker's
        # per-sample statistics do not count them.
        offcpu = [
            self._resolved(s, self._process(s.tgid, s.comm, tid=s.tid), drain, remapped, python, 0, gpu_state)
            for s in drain.offcpu
        ]
        stats = dict(drain.stats)
        stats["unknown_process"] = unknown_process
        stats["user_stack_cut_unmapped"] = cut
        stats["user_stack_unsymbolized"] = unsymbolized
        stats["kernel_symbol_reloads"] = reloaded
        if python is not None:
            stats.update(python.stats())
        window = Window(
            drain.start_ns,
            drain.end_ns,
            samples,
            stats,
            offcpu=offcpu,
            frequency_hz=drain.frequency_hz,
            offcpu_settings=drain.offcpu_settings,
        )
        if syscalls is not None:
            window.syscalls = [(self._process(st.tgid, "", mappings=False), st) for st in syscalls.stats]
            window.syscall_counters = dict(syscalls.counters)
            window.syscall_sample_every = syscalls.sample_every
            window.syscall_duty = syscalls.duty
            stats["events_lost"] = stats.get("events_lost", 0) + syscalls.counters.get("events_lost", 0)
        if gpu is not None:
            owner = self._gpu.owner if self._gpu is not None else _no_owner
            window.gpu = gpu.attributed(lambda pid: self._processes.get(pid, mappings=False), owner)
        if drain.cuda is not None:
            cuda = self._cuda_probes(drain, cuda, remapped, python, gpu_state)
        window.cuda = cuda
        window.labels = self._labels(window)
        return window

    def _cuda_probes(
        self,
        drain: Drain,
        cuda: CudaWindow | None,
        remapped: set[int],
        python: _PythonWindow | None,
        gpu_state: Callable[[int, int], str],
    ) -> CudaWindow:
        """The uprobes' launches (symbolized as samples are, the kernel as leaf, counts scaled back up) and
        timed calls, added to the CUPTI rings' `cuda`."""
        probes = drain.cuda
        assert probes is not None
        out = cuda if cuda is not None else CudaWindow()
        every = probes.sample_every
        for lc in probes.launches:
            proc = self._process(lc.row.tgid, lc.row.comm, tid=lc.row.tid)
            r = self._resolved(lc.row, proc, drain, remapped, python, 0, gpu_state)
            if lc.api == CUDA_API_MARKER:
                cid = lc.handle & 0xFFFFFFFF
                self._launch_stacks.put(
                    (proc.pid, proc.start_ticks, cid), _up_to_cuda(r.frames[: r.kernel_start])
                )
                continue
            frames = (*r.frames[: r.kernel_start], self._kernel_frame(proc, lc, probes.names))
            out.launches.append(
                r._replace(frames=frames, kernel_start=len(frames), count=lc.row.count * every)
            )
        for pc in out.processes:
            pc.kernel_stacks = self._kernel_stacks(pc)
        out.calls = [(self._process(c.tgid, "", mappings=False), c) for c in probes.calls]
        out.launch_sample_every = every
        out.launches_seen = probes.launches_seen
        out.launches_sampled = probes.launches_sampled
        out.table_full = probes.table_full
        return out

    def _kernel_stacks(self, pc: ProcessCuda) -> list[tuple[tuple[Frame, ...], int]]:
        """Each kernel name's exact time this window (pc.kernel_ns) under the stacks that launched it: split
        over the name's sampled launches whose stack the marker's uprobe took, in proportion to each one's
        own kernel time times its weight (the launches it stands for). Names with no such launch are left
        to the one-frame stack."""
        by_name: dict[str, list[tuple[tuple[Frame, ...], int]]] = {}
        proc = pc.process
        for cid, name, ns, weight in pc.sampled_kernels:
            frames = self._launch_stacks.get((proc.pid, proc.start_ticks, cid))
            if frames is not None and ns > 0:
                by_name.setdefault(name, []).append((frames, ns * max(weight, 1)))
        out: dict[tuple[Frame, ...], int] = {}
        for name, parts in by_name.items():
            total = pc.kernel_ns.get(name, 0)
            weights = sum(w for _, w in parts)
            if total <= 0 or weights <= 0:
                continue
            leaf = Frame(name, CUDA_MODULE)
            given = 0
            for i, (frames, w) in enumerate(parts):
                share = total - given if i == len(parts) - 1 else total * w // weights
                given += share
                if share > 0:
                    key = (*frames, leaf)
                    out[key] = out.get(key, 0) + share
        return list(out.items())

    def _kernel_frame(
        self, proc: ProcessInfo, lc: CudaLaunchCount, names: dict[tuple[int, int], str]
    ) -> Frame:
        """The launched kernel as a frame: the runtime's host stub named by the process's symbols (nvcc
        gives the stub the kernel's own mangled name; the collector demangles it), the driver's handle by
        the name it was looked up under."""
        if lc.api == CUDA_API_RUNTIME and proc.mappings:
            key = (proc.pid, proc.start_ticks, -lc.handle - 1)  # apart from stack ids in the same cache
            cached = self._user_cache.lookup(key, proc.mappings)
            if cached is None:
                f = self._symbolizer.user_frames(proc.pid, proc.mappings, (lc.handle,))[0]
                cached = Frame(f.function, f.module)
                self._user_cache.keep(key, proc.mappings, cached)
            return cached
        if lc.api == CUDA_API_DRIVER:
            name = names.get((lc.row.tgid, lc.handle))
            return Frame(name, CUDA_MODULE) if name else UNNAMED_KERNEL
        if lc.api == CUDA_API_GRAPH:
            return CUDA_GRAPH
        return UNNAMED_KERNEL

    def _gpu_states(self) -> Callable[[int, int], str]:
        """(pid, gpu_slot) -> the process's GPU state in that slot of CLOCK_MONOTONIC (bpf_ktime_get_ns's
        clock) for one window, "" when none is known: the wall-clock offset is read once."""
        if self._gpu is None:
            return lambda _pid, _slot: ""
        timeline, slot_s = self._gpu.timeline, self._gpu.slot_s
        activity, fine_ns = self._gpu.activity, self._gpu.fine_slot_ns
        offset = time.time() - time.monotonic()

        def state(pid: int, slot: int) -> str:
            if not slot:
                return ""
            if slot & GPU_SLOT_FINE:  # judged by the process's own timeline, at the slot's middle
                fine = slot & ~GPU_SLOT_FINE
                return (activity(pid, (fine - 1) * fine_ns + fine_ns // 2) or "") if activity else ""
            return (timeline.state(pid, (slot - 0.5) * slot_s + offset) or "") if timeline else ""

        return state

    def _labels(self, window: Window) -> dict[tuple[int, int], Labels]:
        """The labels of each process the window names, as of now (a pod that reached the metadata cache
        since a process was captured labels it from this window on)."""
        return self._attributor.by_process(window_processes(window))

    def _resolved(
        self,
        s: SampleCount,
        proc: ProcessInfo,
        drain: Drain,
        remapped: set[int],
        python: _PythonWindow | None,
        weight: int,
        gpu_state: Callable[[int, int], str],
    ) -> ResolvedSample:
        """One drained row symbolized; `weight`: its samples, for the Python walker's statistics."""
        user, cut, runs = self._user(proc, s.user_stack, drain.stacks, remapped)
        if cut:
            self._cut += weight
        if runs:
            self._unsymbolized += weight
            if self._addresses is not None and weight:
                self._addresses.add(runs, weight)
        if python is not None:
            user = python.user_frames(proc, s.user_stack, s.python_stack, weight, user, drain.python_stacks)
        kernel = self._kernel(s.kernel_stack, drain.stacks)
        frames = user + kernel
        if not frames:
            frames = (NO_STACK,)
        state = gpu_state(proc.pid, s.gpu_slot)
        return ResolvedSample(proc, s.tid, frames, len(user), s.count, s.gpu_slot, s.idle, state)

    def _process(self, tgid: int, comm: str, mappings: bool = True, tid: int = 0) -> ProcessInfo:
        """The process as captured, or (gone before it could be described) what the kernel told us. A row
        of its main thread (`tid` == `tgid`) carries the process's name at sample time: one that named
        itself after it was described (a Python program, once its imports are done) is renamed."""
        key = (tgid, mappings)
        proc = self._window_processes.get(key)
        if proc is None:
            proc = self._processes.get(tgid, mappings)
            if proc is None:
                return ProcessInfo(tgid, 0, comm, "", CgroupIdentity(path=""), ())
            self._window_processes[key] = proc
        if tid == tgid and comm and proc.comm != comm:
            proc = self._window_processes[key] = self._processes.renamed(tgid, comm) or proc
        return proc

    def _user(
        self, proc: ProcessInfo, stack_id: int, stacks: dict[int, tuple[int, ...]], remapped: set[int]
    ) -> tuple[tuple[Frame, ...], bool, tuple[Run, ...]]:
        """The user frames, root first, whether they were cut at an address outside every mapping, and
        the runs of frames in files that no symbol covers there (symbolizer.module_runs)."""
        if stack_id == STACK_NONE:
            return (), False, ()
        if stack_id == STACK_LOST:
            return (LOST_USER_STACK,), False, ()
        if stack_id == STACK_UNTAKEN:
            return (UNTAKEN_STACK,), False, ()
        key = (proc.pid, proc.start_ticks, stack_id)
        cached = self._user_cache.lookup(key, proc.mappings)
        if cached is not None:
            return cached
        addrs = stacks.get(stack_id)
        if addrs is None:  # cannot happen with the double buffer; be explicit if it ever does
            return (LOST_USER_STACK,), False, ()
        if not proc.mappings:
            result = ((NOT_DESCRIBED,), False, ())
            self._user_cache.keep(key, proc.mappings, result)
            return result
        mappings = proc.mappings
        frames = self._symbolizer.user_frames(proc.pid, mappings, addrs, return_addresses=True)
        if any(f.module == UNMAPPED for f in frames) and proc.pid not in remapped:
            # An address outside the captured mappings: the process mapped something new (dlopen).
            remapped.add(proc.pid)
            fresh = self._processes.remap(proc.pid)
            if fresh is not None:
                self._window_processes[(proc.pid, True)] = fresh  # the window's later rows read these
            if fresh is not None and fresh.mappings is not mappings:
                mappings = fresh.mappings
                frames = self._symbolizer.user_frames(proc.pid, mappings, addrs, return_addresses=True)
        # A return address outside every executable mapping, even now, is no caller: a frame-pointer walk
        # (the kernel's, for processes not walked by tables) read it from a frame of code that keeps no frame
        # pointer. The stack ends below it. The leaf is where the CPU was, and stays.
        cut = next((i for i in range(1, len(frames)) if frames[i].module == UNMAPPED), len(frames))
        kept = frames[:cut]
        if kept and kept[0].module == UNMAPPED:
            kept[0] = unknown_frame(UNSEEN_MAPPING, addrs[0])
        kept.reverse()
        if any(f.is_unknown for f in kept):
            runs = module_runs(kept)
            result = (by_module(kept) if self._by_module else tuple(kept), cut < len(frames), runs)
        else:  # every frame named: nothing to merge (most stacks; a frame at a time cost ~2 us a stack)
            result = (tuple(kept), cut < len(frames), ())
        self._user_cache.keep(key, mappings, result)
        return result

    def _kernel(self, stack_id: int, stacks: dict[int, tuple[int, ...]]) -> tuple[Frame, ...]:
        if stack_id == STACK_NONE:
            return ()
        if stack_id == STACK_LOST:
            return (LOST_KERNEL_STACK,)
        if STACK_SYSCALL <= stack_id < STACK_RESERVED:
            # A long wait whose stack was taken at its syscall's return: its kernel stack is gone, the
            # syscall says where it waited.
            return (Frame(f"[syscall {syscall_name(stack_id - STACK_SYSCALL)}]", "[kernel]", kernel=True),)
        cached = self._kernel_cache.get(stack_id)
        if cached is not None:
            return cached
        addrs = stacks.get(stack_id)
        if addrs is None:
            return (LOST_KERNEL_STACK,)
        result = tuple(reversed(self._symbolizer.kernel_frames(addrs, return_addresses=True)))
        self._kernel_cache.put(stack_id, result)
        return result


def _up_to_cuda(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """A stack (root first) up to its first frame in a CUDA library (the API function the program called),
    without what ran inside it (the runtime, the driver, CUPTI's callback into our library)."""
    for i, f in enumerate(frames):
        if library_kind(f.module) is not None or f.module.startswith("libcupti"):
            return frames[: i + 1]
    return frames


def _unnamed(groups: PythonFrames) -> bool:
    """Some frame could not be named yet (PYTHON_MODULE marks a placeholder): try again next window."""
    return any(f.module == PYTHON_MODULE for group in groups for f in group)


class _PythonWindow:
    """One window's Python frames: each distinct (process, Python stack) is named once, then merged into
    native stacks. Names are kept across windows (`named`, `merged`: the resolver's bounded LRUs): a Python
    stack id hashes each frame's code address, instruction and a fingerprint of its qualname pointer taken
    at sample time, so a later sample with the same id ran the same code (a code object freed and replaced
    by one with another name changes the id). Results that met a freed or unreadable code object are not
    kept. Without this, every window re-read every sampled code object and re-decoded its line table:
    ~1% of a core for a handful of Python processes, most of the agent's CPU."""

    def __init__(self, python: PythonStacks, named: _Lru, merged: _Described, by_content: _Lru):
        self._python = python
        self._detected = python.begin_window()
        self._named = named
        self._merged = merged
        self._by_content = by_content
        self.unsupported_samples = 0
        self.merged_samples = 0

    def user_frames(
        self,
        proc: ProcessInfo,
        native_id: int,
        stack_id: int,
        count: int,
        native: tuple[Frame, ...],
        stacks: dict[int, tuple[tuple[int, int, int], ...]],
    ) -> tuple[Frame, ...]:
        p = self._python.process(proc.pid, proc.start_ticks) if proc.start_ticks else None
        if p is None:
            return native
        if not p.supported:
            self.unsupported_samples += count
            return native
        if stack_id == STACK_NONE:
            return native
        key = (proc.pid, proc.start_ticks, stack_id)
        named = self._named.get(key)
        unnamed = False  # the cache holds only named frames
        if named is None:
            if stack_id == STACK_LOST or stack_id not in stacks:
                named = ((LOST_PYTHON_STACK,),)
            else:
                named = self._python.frames(p, stacks[stack_id], count)
            unnamed = _unnamed(named)
            if not unnamed:
                self._named.put(key, named)
        mkey = (*key, native_id)
        merged = self._merged.lookup(mkey, proc.mappings)
        if merged is None:
            # The merge is a function of the frames alone, and stacks whose raw ids differ (where the CPU
            # was inside a function or a line) often have equal frames: those are merged once.
            content = (native, named)
            merged = self._by_content.get(content)
            if merged is None:
                merged = self._python.merged(native, named)
                if not unnamed:
                    self._by_content.put(content, merged)
            if not unnamed:
                self._merged.keep(mkey, proc.mappings, merged)
        self.merged_samples += count
        return merged

    def stats(self) -> dict[str, int]:
        out = {f"python_processes_{k}": v for k, v in self._detected.items()}
        out["python_unsupported_samples"] = self.unsupported_samples
        out["python_merged_samples"] = self.merged_samples
        out.update({f"python_unnamed_{k}": v for k, v in self._python.take_unnamed().items()})
        return out
