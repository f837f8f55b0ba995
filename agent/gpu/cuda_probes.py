"""Uprobes on the CUDA runtime, driver and NCCL of every process that maps them (agent/bpf/cuda_probes.c):
which files to probe, where their functions are, attaching and detaching, and draining what the probes
recorded into plain values (model.CudaProbeDrain).

Rules this file keeps:
  * One attachment per file, whoever maps it: a uprobe is set on an inode and fires in every process that
    maps it, so files are told apart by (device, inode) as /proc/PID/maps prints them and each is attached
    once, however many processes (or copies of a path, in containers) map it, and detached when the last
    process that mapped it is forgotten.
  * The file is reached as the process maps it: /proc/PID/map_files/START-END, the exact mapped inode
    (inside its mount namespace, deleted or not); never a path that a tenant's symlink could redirect. Its
    exported functions are read by our own ELF reader (agent/symbols/elf.py: pread, capped), and the kernel
    is given file offsets, so nothing needs the file again to detach.
  * Finding processes costs no /proc reads of its own: the process table's capture hook (every capture and
    re-capture after a dlopen) hands over the mappings it read.
  * Never raises into the caller for a tenant's file: a file that cannot be read or attached is counted by
    reason (`errors`) and left unprobed.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetprof.agent.bpfmaps import drain_map
from fleetprof.agent.model import (
    CUDA_API_DRIVER,
    CudaCallStat,
    CudaLaunchCount,
    CudaProbeDrain,
    Mapping,
    ProcessInfo,
    SampleCount,
)
from fleetprof.agent.process.rootfs import open_file
from fleetprof.agent.sampler import SampleKey  # sampler.py imports this module only once it is loaded
from fleetprof.agent.symbols.elf import SHT_DYNSYM, ElfError, ElfFile, Segment

log = logging.getLogger(__name__)

# Mirrors of cuda_probes.c's sizes (checked against the compiled maps by CpuSampler at load).
CUDA_HIST = 40  # log2 ns buckets: [2^39 ns, ∞) is the last (9 minutes and more)
CUDA_NAME_LEN = 256
CUDA_CALL_IDS = 40  # entry programs cuda_call_0 .. cuda_call_39
DEFAULT_LAUNCH_SAMPLE_EVERY = 1  # every launch's stack (bench/cuda_launch.py: what it costs)

RUNTIME, DRIVER, NCCL = "cudart", "cuda", "nccl"


def library_kind(basename: str) -> str | None:
    """Which CUDA library a mapped file is, by its name (a wheel's copy in site-packages included)."""
    if basename.startswith("libcudart.so"):
        return RUNTIME
    if basename.startswith("libcuda.so"):
        return DRIVER
    if basename.startswith("libnccl.so"):
        return NCCL
    return None


# Launch functions: (library, exported name, program). The program reads the kernel from the argument that
# holds it: cudaLaunchKernelExC(config, func, args) and cuLaunchKernelEx(config, f, ...) have it second.
LAUNCHES: tuple[tuple[str, str, str], ...] = (
    (RUNTIME, "cudaLaunchKernel", "cuda_launch_rt1"),
    (RUNTIME, "cudaLaunchKernel_ptsz", "cuda_launch_rt1"),
    (RUNTIME, "cudaLaunchKernelExC", "cuda_launch_rt2"),
    (RUNTIME, "cudaLaunchKernelExC_ptsz", "cuda_launch_rt2"),
    (RUNTIME, "cudaGraphLaunch", "cuda_graph_rt"),
    (RUNTIME, "cudaGraphLaunch_ptsz", "cuda_graph_rt"),
    (DRIVER, "cuLaunchKernel", "cuda_launch_drv1"),
    (DRIVER, "cuLaunchKernel_ptsz", "cuda_launch_drv1"),
    (DRIVER, "cuLaunchKernelEx", "cuda_launch_drv2"),
    (DRIVER, "cuLaunchKernelEx_ptsz", "cuda_launch_drv2"),
    (DRIVER, "cuGraphLaunch", "cuda_graph_drv"),
    (DRIVER, "cuGraphLaunch_ptsz", "cuda_graph_drv"),
)
# Driver calls whose return names a kernel handle (cuda_name_enter / cuda_name_return).
NAMING = ("cuModuleGetFunction", "cuLibraryGetKernel")

# Timed calls, where the CPU waits for the GPU or the allocator; the index is the call's id in BPF (the
# entry program cuda_call_<id>). A call is named on the wire as exported.
CALLS: tuple[tuple[str, str], ...] = (
    (RUNTIME, "cudaStreamSynchronize"),
    (RUNTIME, "cudaDeviceSynchronize"),
    (RUNTIME, "cudaEventSynchronize"),
    (RUNTIME, "cudaMemcpy"),
    (RUNTIME, "cudaMalloc"),
    (RUNTIME, "cudaFree"),
    (RUNTIME, "cudaMallocHost"),
    (RUNTIME, "cudaFreeHost"),
    (DRIVER, "cuStreamSynchronize"),
    (DRIVER, "cuCtxSynchronize"),
    (DRIVER, "cuEventSynchronize"),
    (DRIVER, "cuMemcpy"),
    (DRIVER, "cuMemcpyHtoD_v2"),
    (DRIVER, "cuMemcpyDtoH_v2"),
    (DRIVER, "cuMemcpyDtoD_v2"),
    (DRIVER, "cuMemAlloc_v2"),
    (DRIVER, "cuMemFree_v2"),
    (DRIVER, "cuMemAllocHost_v2"),
    (DRIVER, "cuMemFreeHost"),
    (DRIVER, "cuMemAllocManaged"),
    (NCCL, "ncclGroupEnd"),
    (NCCL, "ncclAllReduce"),
    (NCCL, "ncclBroadcast"),
    (NCCL, "ncclReduce"),
    (NCCL, "ncclAllGather"),
    (NCCL, "ncclReduceScatter"),
    (NCCL, "ncclSend"),
    (NCCL, "ncclRecv"),
)
assert len(CALLS) <= CUDA_CALL_IDS
CALL_NAMES = tuple(name for _, name in CALLS)

# Why a file went unprobed: read errors of its ELF, and attachments the kernel refused.
ERROR_REASONS = ("unreadable", "malformed", "attach_failed")


class CudaLaunchKey(ct.Structure):
    """struct cuda_launch_key."""

    _fields_ = [("key", SampleKey), ("handle", ct.c_uint64), ("api", ct.c_uint32), ("pad", ct.c_uint32)]


class CudaCallKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("call", ct.c_uint32)]


class CudaCallValue(ct.Structure):
    _fields_ = [("count", ct.c_uint64), ("ns", ct.c_uint64), ("hist", ct.c_uint64 * CUDA_HIST)]


class CudaFunctionKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("pad", ct.c_uint32), ("handle", ct.c_uint64)]


class CudaFunctionName(ct.Structure):
    _fields_ = [("name", ct.c_char * CUDA_NAME_LEN)]


class CudaRuntimeText(ct.Structure):
    _fields_ = [("start", ct.c_uint64 * 4), ("end", ct.c_uint64 * 4)]


# -- the files' exported functions -----------------------------------------------------------------------

_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
STT_FUNC, STT_GNU_IFUNC = 2, 10


def exported_functions(elf: ElfFile, wanted: Iterable[str]) -> dict[str, int]:
    """File offsets of the `wanted` functions that `elf` exports (defined in its .dynsym), for uprobes."""
    names = set(wanted)
    sec = next((s for s in elf.sections if s.type == SHT_DYNSYM and s.size), None)
    if sec is None:
        return {}
    if not 0 < sec.link < len(elf.sections):
        raise ElfError(f"{sec.name}: string table index {sec.link} out of range")
    syms = elf.section_data(sec)
    strings = bytes(elf.section_data(elf.sections[sec.link]))
    out: dict[str, int] = {}
    for off in range(0, len(syms) - _SYM.size + 1, _SYM.size):
        st_name, info, _other, shndx, value, _size = _SYM.unpack_from(syms, off)
        if shndx == 0 or (info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC) or not value:
            continue
        end = strings.find(b"\0", st_name)
        name = strings[st_name : end if end >= 0 else len(strings)].decode("utf-8", "replace")
        if name in names and name not in out:
            where = vaddr_to_offset(elf.load_segments, value)
            if where is not None:
                out[name] = where
    return out


def vaddr_to_offset(segments: Iterable[Segment], vaddr: int) -> int | None:
    """The file offset of ELF virtual address `vaddr` (what a uprobe is set at), through its PT_LOAD."""
    for seg in segments:
        if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
            return vaddr - seg.vaddr + seg.offset
    return None


# -- attaching ---------------------------------------------------------------------------------------------


@dataclass
class _File:
    kind: str
    events: list[bytes]
    pids: set[int] = field(default_factory=set)
    functions: tuple[str, ...] = ()


class BccUprobes:
    """The narrow face over BCC's uprobe attachment: by file offset, with our own event names, so that
    detaching needs neither the file nor its symbols again."""

    def __init__(self, bpf) -> None:  # a BCC BPF object holding cuda_probes.c's programs
        from bcc.libbcc import lib

        self._bpf = bpf
        self._lib = lib

    def attach(self, event: bytes, fn_name: str, path: str, offset: int, ret: bool) -> None:
        fn = self._bpf.load_func(fn_name.encode(), self._bpf.KPROBE)
        fd = self._lib.bpf_attach_uprobe(fn.fd, 1 if ret else 0, event, path.encode(), offset, -1)
        if fd < 0:
            raise OSError(f"the kernel refused a uprobe on {path}+{offset:#x}")
        self._bpf._add_uprobe_fd(event, fd)

    def detach(self, event: bytes) -> None:
        self._bpf.detach_uprobe_event(event)


class CudaProbes:
    """Every CUDA library mapped on the node, probed. `on_capture` and `forget` may be called from any
    thread; `drain` from the sampler's (under its lock, after a flip)."""

    def __init__(self, bpf, sample_every: int, proc_root: str = "/proc", uprobes=None) -> None:
        self._bpf = bpf
        self._uprobes = uprobes or BccUprobes(bpf)
        self._proc_root = proc_root
        self.sample_every = sample_every
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int, int], _File] = {}
        self._refused: set[tuple[int, int, int]] = set()  # files that failed: not tried again
        self._names: dict[tuple[int, int], str] = {}  # (tgid, handle) -> kernel name (driver API)
        self._launches = (bpf["cuda_launches0"], bpf["cuda_launches1"])
        self._calls = (bpf["cuda_calls0"], bpf["cuda_calls1"])
        self._functions = bpf["cuda_functions"]
        self._runtimes = bpf["cuda_runtimes"]
        self.errors = dict.fromkeys(ERROR_REASONS, 0)
        self._seq = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def probed_pids(self) -> set[int]:
        with self._lock:
            return {p for f in self._files.values() for p in f.pids}

    def on_capture(self, info: ProcessInfo) -> None:
        """The process table captured `info`: probe the CUDA libraries it maps (once per file)."""
        found: dict[tuple[int, int, int], tuple[str, list[Mapping]]] = {}
        for m in info.mappings:
            if not m.is_file:
                continue
            kind = library_kind(os.path.basename(m.file_path))
            if kind is not None:
                found.setdefault((m.dev_major, m.dev_minor, m.inode), (kind, []))[1].append(m)
        if not found:
            return
        with self._lock:
            for key, (kind, maps) in found.items():
                f = self._files.get(key)
                if f is None and key not in self._refused:
                    f = self._attach(info.pid, key, kind, maps)
                if f is not None:
                    f.pids.add(info.pid)
            runtime = [m for k, (kind, maps) in found.items() if kind == RUNTIME for m in maps if m.is_exec]
            if runtime:
                self._set_runtime_text(info.pid, runtime)

    def _attach(self, pid: int, key: tuple[int, int, int], kind: str, maps: list[Mapping]) -> _File | None:
        m = next((m for m in maps if m.is_exec), maps[0])
        path = f"{self._proc_root}/{pid}/map_files/{m.start:x}-{m.end:x}"
        wanted = [n for lib, n, _ in LAUNCHES if lib == kind] + [n for lib, n in CALLS if lib == kind]
        if kind == DRIVER:
            wanted += NAMING
        try:
            with ElfFile(open_file(path)) as elf:
                offsets = exported_functions(elf, wanted)
        except ElfError as e:
            self._refuse(key, "malformed", path, e)
            return None
        except OSError as e:
            self._refuse(key, "unreadable", path, e)
            return None
        f = _File(kind, [], functions=tuple(sorted(offsets)))
        self._seq += 1
        tag = f"fp_cuda_{self._seq}_{key[2]}"

        def attach(fn_name: str, name: str, ret: bool) -> None:
            event = f"{tag}_{name}_{'r' if ret else 'p'}".encode()
            self._uprobes.attach(event, fn_name, path, offsets[name], ret)
            f.events.append(event)

        try:
            for lib, name, prog in LAUNCHES:
                if lib == kind and name in offsets:
                    attach(prog, name, False)
            for i, (lib, name) in enumerate(CALLS):
                if lib == kind and name in offsets:
                    attach(f"cuda_call_{i}", name, False)
                    attach("cuda_call_return", name, True)
            for name in NAMING if kind == DRIVER else ():
                if name in offsets:
                    attach("cuda_name_enter", name, False)
                    attach("cuda_name_return", name, True)
        except Exception as e:  # BCC raises bare Exception; the kernel's refusal is an OSError
            self._detach_all(f)
            self._refuse(key, "attach_failed", path, e)
            return None
        self._files[key] = f
        log.info("CUDA probes on %s (%s of pid %d): %d functions", m.file_path, kind, pid, len(offsets))
        return f

    def _refuse(self, key: tuple[int, int, int], reason: str, path: str, err: BaseException) -> None:
        self._refused.add(key)
        self.errors[reason] += 1
        log.info("CUDA library %s not probed (%s): %s", path, reason, err)

    def _detach_all(self, f: _File) -> None:
        for event in f.events:
            try:
                self._uprobes.detach(event)
            except Exception:  # already gone: nothing left to undo
                log.debug("detaching %s failed", event, exc_info=True)
        f.events.clear()

    def _set_runtime_text(self, pid: int, maps: list[Mapping]) -> None:
        text = CudaRuntimeText()
        for i, m in enumerate(maps[:4]):
            text.start[i], text.end[i] = m.start, m.end
        try:
            self._runtimes[ct.c_uint32(pid)] = text
        except Exception:  # the map is full: this process's runtime launches may count twice
            log.debug("cuda_runtimes full", exc_info=True)

    def forget(self, pid: int) -> None:
        """`pid` exited: files no process maps any more are detached."""
        with self._lock:
            for key in [k for k, f in self._files.items() if pid in f.pids]:
                f = self._files[key]
                f.pids.discard(pid)
                if not f.pids:
                    self._detach_all(f)
                    del self._files[key]
            try:
                del self._runtimes[ct.c_uint32(pid)]
            except KeyError:
                pass
            for k in [k for k in self._names if k[0] == pid]:
                del self._names[k]

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                self._detach_all(f)
            self._files.clear()

    # -- draining -----------------------------------------------------------------------------------------
    def drain(self, idle_set: int, stats: dict[str, int]) -> CudaProbeDrain:
        """The launches and calls recorded in map set `idle_set` (now idle), and the names of the driver
        kernels they launched."""
        self._learn_names()
        launches = [
            CudaLaunchCount(
                SampleCount(
                    tgid=k.key.tgid,
                    tid=k.key.tid,
                    cgroup_id=k.key.cgroup_id,
                    comm=k.key.comm.decode("utf-8", "replace"),
                    user_stack=k.key.user_stack,
                    kernel_stack=k.key.kernel_stack,
                    count=v,
                    python_stack=k.key.python_stack,
                    gpu_slot=k.key.gpu_slot,
                ),
                k.handle,
                k.api,
            )
            for k, v in drain_map(self._launches[idle_set], CudaLaunchKey, ct.c_uint64)
        ]
        calls = [
            CudaCallStat(k.tgid, CALL_NAMES[k.call], v.count, v.ns, tuple(v.hist))
            for k, v in drain_map(self._calls[idle_set], CudaCallKey, CudaCallValue)
            if k.call < len(CALL_NAMES)
        ]
        with self._lock:
            names = {
                (c.row.tgid, c.handle): self._names[(c.row.tgid, c.handle)]
                for c in launches
                if c.api == CUDA_API_DRIVER and (c.row.tgid, c.handle) in self._names
            }
        return CudaProbeDrain(
            launches=launches,
            calls=calls,
            names=names,
            sample_every=self.sample_every,
            launches_seen=stats.get("cuda_launches", 0),
            launches_sampled=stats.get("cuda_launches_sampled", 0),
            table_full=stats.get("cuda_table_full", 0),
        )

    def _learn_names(self) -> None:
        table = self._functions
        read = [(k.tgid, k.handle, v.name.decode("utf-8", "replace")) for k, v in table.items()]
        with self._lock:
            for tgid, handle, name in read:
                if name:
                    self._names[(tgid, handle)] = name
        for tgid, handle, _ in read:
            try:
                del table[CudaFunctionKey(tgid, 0, handle)]
            except KeyError:
                pass


def check_layouts(bpf) -> None:
    """The CUDA maps' key and value types as BCC read them from cuda_probes.c are our mirrors."""
    from fleetprof.agent.sampler import layout

    pairs = [
        (bpf["cuda_launches0"].Key, CudaLaunchKey),
        (bpf["cuda_calls0"].Key, CudaCallKey),
        (bpf["cuda_calls0"].Leaf, CudaCallValue),
        (bpf["cuda_functions"].Key, CudaFunctionKey),
        (bpf["cuda_functions"].Leaf, CudaFunctionName),
        (bpf["cuda_runtimes"].Leaf, CudaRuntimeText),
    ]
    for theirs, ours in pairs:
        if layout(theirs) != layout(ours):
            raise RuntimeError(
                f"agent/gpu/cuda_probes.py's {ours.__name__} is out of sync with cuda_probes.c: "
                f"{layout(ours)} here, {layout(theirs)} there"
            )
