"""Uprobes on the CUDA runtime, driver and NCCL (agent/bpf/cuda_probes.c, loaded with the CPU sampler's
program): attaching them to the files processes map, detaching them, and draining what they recorded into
plain values (model.CudaProbeDrain). Which files a process maps and where their functions are is found by
agent/gpu/cuda_libraries.py; the functions are agent/cuda_api.py's.

Rules this file keeps:
  * One attachment per file, whoever maps it: a uprobe is set on an inode and fires in every process that
    maps it, so files are told apart by (device, inode) as /proc/PID/maps prints them and each is attached
    once, however many processes (or copies of a path, in containers) map it, and detached when the last
    process that mapped it is forgotten.
  * Attached by file offset with our own event names, so detaching needs neither the file nor its symbols.
  * Never raises into the caller: a file the kernel refuses is counted (`errors`) and not tried again.
"""

from __future__ import annotations

import ctypes as ct
import logging
import threading
from dataclasses import dataclass, field

from fleetprof.agent.bpfmaps import drain_map
from fleetprof.agent.cuda_api import CALL_NAMES, CALLS, CUDA_HIST, CUDA_NAME_LEN, DRIVER, LAUNCHES, NAMING
from fleetprof.agent.model import (
    CUDA_API_DRIVER,
    CudaCallStat,
    CudaLaunchCount,
    CudaLibrary,
    CudaProbeDrain,
    SampleCount,
)
from fleetprof.agent.sampler import SampleKey  # sampler.py imports this module only once it is loaded

log = logging.getLogger(__name__)


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
        self._walk_loaded = False

    def attach(self, event: bytes, fn_name: str, path: str, offset: int, ret: bool) -> None:
        if not self._walk_loaded:
            # The launch probes' one walk program (cuda_probes.c), tail-called by each of them: loaded with
            # the first probe, so a node without CUDA never loads it, and a refusal by the verifier refuses
            # the CUDA file (the caller counts it), not the CPU sampler.
            walk = self._bpf.load_func(b"cuda_launch_walk", self._bpf.KPROBE)
            self._bpf[b"cuda_walk_progs"][ct.c_int(0)] = ct.c_int(walk.fd)
            self._walk_loaded = True
        fn = self._bpf.load_func(fn_name.encode(), self._bpf.KPROBE)
        fd = self._lib.bpf_attach_uprobe(fn.fd, 1 if ret else 0, event, path.encode(), offset, -1)
        if fd < 0:
            raise OSError(f"the kernel refused a uprobe on {path}+{offset:#x}")
        self._bpf._add_uprobe_fd(event, fd)

    def detach(self, event: bytes) -> None:
        self._bpf.detach_uprobe_event(event)


class CudaProbes:
    """Every CUDA library mapped on the node, probed. `attach` and `forget` may be called from any
    thread; `drain` from the sampler's (under its lock, after a flip)."""

    def __init__(self, bpf, sample_every: int, uprobes=None) -> None:
        self._bpf = bpf
        self._uprobes = uprobes or BccUprobes(bpf)
        self.sample_every = sample_every
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int, int], _File] = {}
        self._refused: set[tuple[int, int, int]] = set()  # files that failed: not tried again
        self._names: dict[tuple[int, int], str] = {}  # (tgid, handle) -> kernel name (driver API)
        self._launches = (bpf["cuda_launches0"], bpf["cuda_launches1"])
        self._calls = (bpf["cuda_calls0"], bpf["cuda_calls1"])
        self._functions = bpf["cuda_functions"]
        self._runtimes = bpf["cuda_runtimes"]
        self.errors = {"attach_failed": 0}  # files the kernel would not probe
        self._seq = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def probed_pids(self) -> set[int]:
        with self._lock:
            return {p for f in self._files.values() for p in f.pids}

    def known(self, key: tuple[int, int, int]) -> bool:
        """The file is probed already, or was refused: its functions need not be read again."""
        with self._lock:
            return key in self._files or key in self._refused

    def attach(self, pid: int, libraries: list[CudaLibrary]) -> None:
        """`pid` maps `libraries` (agent/gpu/cuda_libraries.py): probe each file not probed yet."""
        with self._lock:
            for lib in libraries:
                f = self._files.get(lib.key)
                if f is None and lib.key not in self._refused and lib.offsets:
                    f = self._attach(lib)
                if f is not None:
                    f.pids.add(pid)
            text = [r for lib in libraries for r in lib.text]
            if text:
                self._set_runtime_text(pid, text)

    def _attach(self, lib: CudaLibrary) -> _File | None:
        offsets = lib.offsets
        f = _File(lib.kind, [], functions=tuple(sorted(offsets)))
        self._seq += 1
        tag = f"fp_cuda_{self._seq}_{lib.key[2]}"

        def attach(fn_name: str, name: str, ret: bool) -> None:
            event = f"{tag}_{name}_{'r' if ret else 'p'}".encode()
            self._uprobes.attach(event, fn_name, lib.path, offsets[name], ret)
            f.events.append(event)

        try:
            for kind, name, prog in LAUNCHES:
                if kind == lib.kind and name in offsets:
                    attach(prog, name, False)
            for i, (kind, name) in enumerate(CALLS):
                if kind == lib.kind and name in offsets:
                    attach(f"cuda_call_{i}", name, False)
                    attach("cuda_call_return", name, True)
            for name in NAMING if lib.kind == DRIVER else ():
                if name in offsets:
                    attach("cuda_name_enter", name, False)
                    attach("cuda_name_return", name, True)
        except Exception as e:  # BCC raises bare Exception; the kernel's refusal is an OSError
            self._detach_all(f)
            self._refuse(lib.key, "attach_failed", lib.path, e)
            return None
        self._files[lib.key] = f
        log.info("CUDA probes on %s (%s): %d functions", lib.path, lib.kind, len(offsets))
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

    def _set_runtime_text(self, pid: int, ranges: list[tuple[int, int]]) -> None:
        text = CudaRuntimeText()
        for i, (start, end) in enumerate(ranges[:4]):
            text.start[i], text.end[i] = start, end
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
            # at most the launches seen: CounterDeltas bounds it per window (sampler.STAT_FOLLOW_UPS)
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
