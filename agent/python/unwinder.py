"""The Python-stack stage of the agent: detects CPython processes as they are described, registers them
with the BPF walker, and turns the walker's frames into named frames merged into native stacks."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from fleetprof.agent.process.rootfs import FileErrors
from fleetprof.agent.python.codes import CodeNames
from fleetprof.agent.python.detect import Detector, PythonProcess
from fleetprof.agent.python.merge import PythonFrames, merge
from fleetprof.agent.python.offsets import ENTRY_TAG, FRAME_OWNED_BY_CSTACK, PyProc, to_bpf

if TYPE_CHECKING:
    from fleetprof.agent.model import ProcessInfo
from fleetprof.agent.model import Frame

log = logging.getLogger(__name__)

LOST_PYTHON_STACK = Frame("[python stack lost: stack map full or busy]", "[fleetprof]")


class WalkerMaps(Protocol):
    """The sampler's face for this stage (CpuSampler implements it)."""

    def set_python_process(self, pid: int, proc: PyProc) -> None: ...

    def forget_python_process(self, pid: int) -> None: ...


class PythonStacks:
    """pid -> its CPython (if any); thread-safe. Disabled, it detects nothing and merges nothing."""

    def __init__(
        self, enabled: bool = True, proc_root: str = "/proc", file_errors: FileErrors | None = None
    ) -> None:
        """`file_errors` counts interpreter files refused (agent/process/rootfs.py): the symbolizer's."""
        self.enabled = enabled
        self._detector = Detector(proc_root, file_errors=file_errors)
        self.codes = CodeNames(proc_root)
        self._lock = threading.Lock()
        self._procs: dict[int, PythonProcess] = {}
        self._maps: WalkerMaps | None = None
        self._outcomes: Counter[str] = Counter()  # processes detected, by outcome, since the last window

    def attach(self, maps: WalkerMaps) -> None:
        """Register with the BPF walker; processes detected before this are registered now."""
        with self._lock:
            self._maps = maps
            procs = list(self._procs.values())
        for p in procs:
            self._register(p)

    def on_capture(self, info: ProcessInfo) -> None:
        """A process was (re)described: detect its CPython once per process start (cheap: see detect.py)."""
        if not self.enabled:
            return
        pid, start_ticks, mappings = info.pid, info.start_ticks, info.mappings
        with self._lock:
            known = self._procs.get(pid)
        if known is not None and known.start_ticks == start_ticks and known.supported:
            return  # detected; an unsupported verdict is revisited (libpython may not have been mapped yet)
        found = self._detector.detect(pid, start_ticks, mappings)
        if found is None:
            if known is not None:
                self.forget(pid)
            return
        with self._lock:
            self._procs[pid] = found
            if known is None or known.start_ticks != start_ticks or known.outcome != found.outcome:
                self._outcomes[found.outcome] += 1
        if found.supported:
            self._register(found)
        else:
            log.debug("pid %d runs CPython %s: %s, native frames only", pid, found.version, found.outcome)

    def _register(self, p: PythonProcess) -> None:
        if self._maps is not None and p.supported and p.offsets is not None:
            proc = to_bpf(p.offsets, p.runtime, p.pidns, p.version or (0, 0), p.code_type)
            self._maps.set_python_process(p.pid, proc)

    def forget(self, pid: int) -> None:
        """The process table forgot `pid` (exited and drained, or evicted)."""
        with self._lock:
            gone = self._procs.pop(pid, None)
        if gone is not None:
            self.codes.forget(pid)
            if self._maps is not None and gone.supported:
                self._maps.forget_python_process(pid)

    def process(self, pid: int, start_ticks: int) -> PythonProcess | None:
        with self._lock:
            p = self._procs.get(pid)
        return p if p is not None and p.start_ticks == start_ticks else None

    def begin_window(self) -> dict[str, int]:
        """Start resolving a window; returns processes detected since the last one, by outcome."""
        self.codes.begin_window()
        with self._lock:
            out, self._outcomes = dict(self._outcomes), Counter()
        return out

    def announced(self, pid: int, walked: Sequence[tuple[int, int, int]]) -> None:
        """BPF stored a new stack of `pid` (leaf first): read its code objects now, while they and the
        process live (agent/python/codes.py says why)."""
        with self._lock:
            p = self._procs.get(pid)
        if p is None or not p.supported:
            return
        for code, _instr, tag in walked:
            if (tag >> 24) & 0x7F != FRAME_OWNED_BY_CSTACK:
                self.codes.prename(p, code, tag & 0xFFFFFF)

    def take_unnamed(self) -> dict[str, int]:
        """Sampled frames whose code object could not be named since the last call, by reason."""
        return self.codes.take_unnamed()

    def frames(
        self, p: PythonProcess, walked: Sequence[tuple[int, int, int]], weight: int = 1
    ) -> PythonFrames:
        """Named Python frames, root first, from the walker's frames (leaf first), in groups: one per C call
        into the interpreter (3.12+ mark each with a shim frame, dropped here; 3.11 flags its first frame).
        `weight`: the samples they stand for (frames that cannot be named are counted by reason)."""
        groups: list[list[Frame]] = []
        opened = False  # a shim just opened the last group
        for code, instr, tag in reversed(walked):
            if (tag >> 24) & 0x7F == FRAME_OWNED_BY_CSTACK:
                groups.append([])
                opened = True
                continue
            if not groups or (tag & ENTRY_TAG and not opened):
                groups.append([])
            opened = False
            groups[-1].append(self.codes.frame(p, code, instr, tag & 0xFFFFFF, weight))
        return tuple(tuple(g) for g in groups if g)

    def merged(self, native: tuple[Frame, ...], python: PythonFrames) -> tuple[Frame, ...]:
        return merge(native, python)
