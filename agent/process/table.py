"""What the agent knows of each sampled process: identity, cgroup attribution, executable mappings."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from fleetprof.agent.model import ProcessInfo
from fleetprof.agent.process.cgroups import read_cgroup
from fleetprof.agent.symbols.maps import read_maps

log = logging.getLogger(__name__)

PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit (/proc/PID/stat field 9, flags)


def read_process(pid: int, proc_root: str = "/proc", mappings: bool = True) -> ProcessInfo:
    """Capture a live process (without its mappings unless `mappings`); raises ProcessLookupError when it
    is gone."""
    base = f"{proc_root}/{pid}"
    captured_ns = time.monotonic_ns()  # before reading: what was read is at least this recent
    try:
        comm, fields = _stat(base, pid)
        start_ticks = int(fields[19])
        try:
            exe = os.readlink(f"{base}/exe")
        except OSError:
            exe = ""  # kernel threads, or a zombie
        maps = ()
        if mappings:
            maps = tuple(read_maps(pid, proc_root, exec_only=True))
            # Read again: it may have begun to exit since (PF_EXITING is set before its memory map goes),
            # and then the maps just read were empty. Likely what happened under emulation, where reads
            # are slow: a process that exited right after 500 CUDA launches had them all resolved
            # without mappings.
            _stat(base, pid)
        cgroup = read_cgroup(pid, proc_root)
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessLookupError(f"process {pid} is gone") from exc
    return ProcessInfo(pid, start_ticks, comm, exe, cgroup, maps, mappings, captured_ns)


def _stat(base: str, pid: int) -> tuple[str, list[str]]:
    """The process's name and the fields of /proc/PID/stat after it; raises ProcessLookupError once it is
    exiting: its memory map may be gone already (maps empty, exe unreadable), and a capture then would
    replace the one taken while it ran. A sample taken between its exit event and its end reports it as
    new again: that must not cost its last windows their symbols."""
    with open(f"{base}/stat", "rb") as f:
        stat = f.read().decode("utf-8", "replace")
    # comm may contain spaces and parentheses: the fields after it start after the last ')'.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    if int(fields[6]) & PF_EXITING or fields[0] in ("Z", "X"):
        raise ProcessLookupError(f"process {pid} is exiting")
    return comm, fields


class ProcessTable:
    """pid → ProcessInfo, fed by the sampler's and the syscall tracer's new/exec/exit events and by
    lookups at drain time.

    Sampled processes are captured whole (mappings included, for symbols). Processes the syscall tracer
    meets are captured for their labels only (`note`: stat, exe, cgroup; no maps): every process on the
    node makes syscalls, and most are never sampled. A sample of such a process captures it whole
    (`get`). An exited process is kept until `end_window()` has been called twice after its exit, so the
    drain that holds its last samples still symbolizes them. Bounded by `max_processes` (LRU).
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        max_processes: int = 32768,
        on_capture: Callable[[ProcessInfo], None] | None = None,
        on_forget: Callable[[int], None] | None = None,
    ):
        """on_capture(info) runs after each capture (e.g. CPython detection), on_forget(pid) when a
        process leaves the table; both outside the table's lock."""
        self._on_capture = on_capture
        self._on_forget = on_forget
        self._proc_root = proc_root
        self._max = max_processes
        self._lock = threading.Lock()
        self._procs: OrderedDict[int, ProcessInfo] = OrderedDict()
        self._exited: dict[int, int] = {}  # pid -> windows left before eviction
        self.capture_failures = 0

    def __len__(self) -> int:
        return len(self._procs)

    def refresh(self, pid: int, mappings: bool = True) -> ProcessInfo | None:
        """(Re)capture a process now (for its labels only unless `mappings`); None if it is already gone."""
        try:
            info = read_process(pid, self._proc_root, mappings)
        except ProcessLookupError:
            return None
        except (OSError, ValueError, IndexError) as exc:
            self.capture_failures += 1
            log.debug("cannot describe process %d: %s", pid, exc)
            return None
        evicted = []
        with self._lock:
            old = self._procs.get(pid)
            if old is not None and old.mapped and not mappings:
                evicted.append(pid)  # its image changed (exec): what was detected from its maps is stale
            if old is not None and old.start_ticks == info.start_ticks and old.mappings == info.mappings:
                # The same mappings object, not an equal copy: the resolver's caches know which mappings a
                # stack was read against by identity (agent/resolver.py _Described), and a read that found
                # nothing new must not make them read every stack of the process again.
                info = replace(info, mappings=old.mappings)
            self._procs[pid] = info
            self._procs.move_to_end(pid)
            self._exited.pop(pid, None)
            while len(self._procs) > self._max:
                old, _ = self._procs.popitem(last=False)
                self._exited.pop(old, None)
                evicted.append(old)
        if self._on_capture is not None and mappings:
            try:
                self._on_capture(info)
            except Exception:  # a hook must not keep the process from being described
                log.exception("describing process %d: capture hook failed", pid)
        self._forgotten(evicted)
        return info

    def renamed(self, pid: int, comm: str) -> ProcessInfo | None:
        """The capture of `pid` with the name its main thread has now (a process that named itself, with
        prctl PR_SET_NAME, after it was captured); None if the table does not hold it."""
        with self._lock:
            info = self._procs.get(pid)
            if info is not None and info.comm != comm:
                info = self._procs[pid] = replace(info, comm=comm)
        return info

    def _forgotten(self, pids: list[int]) -> None:
        if self._on_forget is not None:
            for pid in pids:
                self._on_forget(pid)

    def mark_exited(self, pid: int, since_ns: int | None = None) -> None:
        """The process exited (at `since_ns`, CLOCK_MONOTONIC, where the event says). An exit older than the
        capture held is an earlier process's with the same pid and is ignored: pids are reused (pid_max can
        be 32768), and the sampler's and the syscall tracer's events come through two ring buffers, so the
        old process's exit can arrive after the new process was captured."""
        with self._lock:
            info = self._procs.get(pid)
            if info is not None and (since_ns is None or info.captured_ns <= since_ns):
                self._exited[pid] = 2

    def note(self, pid: int, since_ns: int, exec_: bool = False) -> None:
        """The syscall tracer met the process at `since_ns` (CLOCK_MONOTONIC): its first syscall, or
        (`exec_`) an exec. Captured for its labels unless the table holds a capture that already covers
        it: one taken after that moment, or for a first syscall any capture of the live process."""
        with self._lock:
            info = self._procs.get(pid)
            live = info is not None and pid not in self._exited
        if live and (info.captured_ns >= since_ns or not exec_):
            return
        self.refresh(pid, mappings=False)

    def get(self, pid: int, mappings: bool = True) -> ProcessInfo | None:
        """The process as last captured, capturing it now if it was never seen (event lost), or if
        `mappings` are wanted and it was captured for its labels only (kept as is once it is gone)."""
        with self._lock:
            info = self._procs.get(pid)
            exited = pid in self._exited
        if info is None or (mappings and not info.mapped and not exited):
            info = self.refresh(pid, mappings) or info
        return info

    def remap(self, pid: int) -> ProcessInfo | None:
        """Re-read a live process's mappings (an address fell outside them: a dlopen since)."""
        with self._lock:
            if pid in self._exited:
                return self._procs.get(pid)
        return self.refresh(pid) or self.get(pid)

    def remap_if_changed(self, pid: int) -> bool:
        """Re-read a live process's executable mappings and capture it again if they changed (a walk left
        them: a dlopen since, or a bad step); whether it was. One read of /proc/PID/maps when unchanged."""
        with self._lock:
            info = self._procs.get(pid)
            if info is None or pid in self._exited or not info.mapped:
                return False
        try:
            mappings = tuple(read_maps(pid, self._proc_root, exec_only=True))
        except OSError:
            return False
        if mappings == info.mappings:
            return False
        return self.refresh(pid) is not None

    def end_window(self) -> None:
        """Called after each drain: forget processes that exited before the previous drain."""
        gone = []
        with self._lock:
            for pid in list(self._exited):
                self._exited[pid] -= 1
                if self._exited[pid] <= 0:
                    del self._exited[pid]
                    self._procs.pop(pid, None)
                    gone.append(pid)
        self._forgotten(gone)
