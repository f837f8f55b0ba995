"""The agent's side of our CUPTI library: find the processes that load it, read each one's ring every drain
(agent/gpu/cupti_ring.py), keep its activity timeline (agent/gpu/activity.py) and hand the window's GPU
activity and kernel time to the encoder as plain data.

Rules this file keeps:
  * Finding processes costs no extra /proc reads for processes without CUDA: the process table's capture
    hook (`on_capture`, every capture and re-capture after a dlopen) sees the executable mappings already
    read. A process mapping our library is opened at the next drain; one mapping libcuda or libcudart but not
    (yet) our library is a candidate whose maps are read again once per drain (the library is loaded by
    cuInit, after the capture), at most MAX_PROBES_PER_DRAIN of them.
  * Order: the agent polls every ring (`read`) before it reads the sampler's maps, and `drain` then reports
    what was polled, so a kernel's launch stack (taken before its record was flushed) is never a window
    behind it. A ring opened by `read` is polled at once; one opened by `drain` first by the next `read`.
  * Bounded work and memory: at most MAX_PROCESSES rings, each polled for at most POLL_RECORDS records per
    drain; each timeline keeps HORIZON_WINDOWS windows of intervals.
  * A ring that cannot be read (garbled header, process gone, permission) never raises out of `drain`:
    the error is counted by reason and the process is dropped (a garbled ring is not opened again).
  * Time: the ring's records are on CLOCK_MONOTONIC; the window is turned into it with one offset read per
    drain. Each (process, device) row covers the next stretch of what the records make known, after the
    stretch the previous batch covered, never longer than a window and never past the window's end, so each
    gap is counted exactly once: in the batch whose stretch holds its end. A stretch ends the longest kernel
    so far before the library's last flush (a kernel running at a flush arrives later; see _report).
  * `state` answers for the drain's own thread (encode tags samples with it after `drain`): the sampler's
    fine GPU slots of processes with a ring are judged by their timelines.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from fleetprof.agent.gpu.activity import ProcessActivity
from fleetprof.agent.gpu.cupti_ring import KIND_KERNEL, LIBRARY_PREFIX, RingBatch, RingError, RingReader
from fleetprof.agent.model import CudaWindow, DeviceActivity, GapStats, ProcessCuda, ProcessInfo

log = logging.getLogger(__name__)

MAX_PROCESSES = 256
MAX_PROBES_PER_DRAIN = 64
POLL_RECORDS = 65_536  # one ring of the library's default build per drain
HORIZON_WINDOWS = 6
SAMPLED_KEPT = 65_536  # sampled launches per process waiting for their kernel's record
# Why a ring was not read: RingError's reasons, then too many rings, then a fault of ours.
ERROR_REASONS = ("gone", "no_ring", "bad_header", "unreadable", "too_many", "internal")
# Files whose mapping makes a process a candidate: the CUDA driver loads our library (CUDA_INJECTION64_PATH)
# at cuInit, so it is mapped only after one of these.
CUDA_PREFIXES = ("libcuda.so", "libcudart.so")


@dataclass
class ReaderCounters:
    """Running totals, exported on /metrics."""

    records_read: int = 0
    records_lost: int = 0  # lapped, torn, and CUPTI's own drops
    processes_opened: int = 0
    # ERROR_REASONS -> count; every key made up front, so a scrape can copy it while a drain adds to it
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0))

    def error(self, reason: str) -> None:
        key = reason if reason in self.errors else "unreadable"
        self.errors[key] += 1


class _Tracked:
    def __init__(self, info: ProcessInfo, reader: RingReader, horizon_ns: int) -> None:
        self.info = info
        self.opened_ns: int | None = None  # the start of the window whose drain reports its first poll
        self.reader = reader
        self.activity = ProcessActivity(horizon_ns=horizon_ns)
        self.cursor: int | None = None  # CLOCK_MONOTONIC: what the batches so far covered ends here
        self.longest_ns = 0  # the longest kernel or copy of the process so far
        # correlation id (outer or inner) of a sampled launch -> (its outer id: the marker's, its weight),
        # kept until its kernel is read (a kernel record comes after its launch record), at most SAMPLED_KEPT
        self.sampled: dict[int, tuple[int, int]] = {}
        self.cupti_dropped = 0
        self.read: RingBatch | RingError | None = None  # polled by CuptiReaders.read, used by the drain


def kernel_ns_by_name(batch: RingBatch) -> tuple[dict[str, int], dict[str, int], int]:
    """Nanoseconds of the batch's kernels per name (those > 0), how many kernels per name (of those), and
    how many kernels in all: grouped in numpy, as thousands of records a second come through here."""
    kern = batch.activities[batch.activities["kind"] == KIND_KERNEL]
    if not len(kern):
        return {}, {}, 0
    start = kern["start_ns"].astype(np.int64)
    dur = np.maximum(kern["end_ns"].astype(np.int64), start) - start
    # A name the library could not store (name_ref 0) is told apart by its hash.
    key = (kern["name_ref"].astype(np.uint64) << np.uint64(32)) | kern["name_hash"].astype(np.uint64)
    keys, inverse = np.unique(key, return_inverse=True)
    totals = np.zeros(len(keys), dtype=np.int64)
    np.add.at(totals, inverse, dur)  # exact integers (bincount's weights would be float64)
    counts = np.bincount(inverse, minlength=len(keys))
    out: dict[str, int] = {}
    count: dict[str, int] = {}
    for k, ns, n in zip(keys.tolist(), totals.tolist(), counts.tolist(), strict=True):
        ref, name_hash = k >> 32, k & 0xFFFFFFFF
        name = batch.names.get(ref) or f"[kernel {name_hash:08x}]"  # as activity.kernel_time names it
        if ns > 0:
            out[name] = out.get(name, 0) + ns
            count[name] = count.get(name, 0) + n
    return out, count, len(kern)


def sampled_kernels(sampled: dict[int, tuple[int, int]], batch: RingBatch) -> list[tuple[int, str, int, int]]:
    """(outer correlation id, kernel name, ns, weight) of the batch's kernels whose launch the library sampled
    (and so called its marker with that outer id, where the agent's uprobe took the stack). A kernel record
    carries the outer or the inner launch call's id (CUPTI documents either); the launch record names both,
    so the join is exact. `sampled` carries launch records over to the batches their kernels arrive in."""
    for r in batch.launches:
        outer, weight = int(r["correlation_id"]), int(r["weight"])
        sampled[outer] = (outer, weight)
        if int(r["inner_correlation_id"]):
            sampled[int(r["inner_correlation_id"])] = (outer, weight)
    while len(sampled) > SAMPLED_KEPT:
        del sampled[next(iter(sampled))]  # the oldest: its kernel's record was lost
    kern = batch.activities[batch.activities["kind"] == KIND_KERNEL]
    out = []
    for r in kern[np.isin(kern["correlation_id"], np.fromiter(sampled, dtype=np.int64, count=len(sampled)))]:
        outer, weight = sampled.pop(int(r["correlation_id"]))
        name = batch.names.get(int(r["name_ref"])) or f"[kernel {int(r['name_hash']):08x}]"
        out.append((outer, name, max(0, int(r["end_ns"]) - int(r["start_ns"])), weight))
    return out


def maps_library(info: ProcessInfo, prefixes: tuple[str, ...]) -> bool:
    return any(m.is_file and os.path.basename(m.file_path).startswith(prefixes) for m in info.mappings)


class CuptiReaders:
    """Every ring on the node. `on_capture` and `forget` may be called from any thread; `drain` from one."""

    def __init__(self, proc_root: str = "/proc", max_processes: int = MAX_PROCESSES) -> None:
        self._proc_root = proc_root
        self._max = max_processes
        self._lock = threading.Lock()
        self._found: dict[int, ProcessInfo] = {}  # mapping our library: open at the next drain
        self._candidates: dict[int, ProcessInfo] = {}  # mapping CUDA only: probe at each drain
        self._gone: set[int] = set()
        self._refused: set[tuple[int, int]] = set()  # (pid, start_ticks) whose ring is garbled: not retried
        self._tracked: dict[int, _Tracked] = {}
        # Rings dropped at the last drain (their process exited): their timelines still tag that window's
        # samples (`state`), then are let go at the next drain.
        self._retired: dict[int, ProcessActivity] = {}
        self._next: tuple[int, int] | None = None  # (start, length) of the window after the last drained
        self._reading = False  # the agent calls `read` before each drain
        self.counters = ReaderCounters()

    def on_capture(self, info: ProcessInfo) -> None:
        """The process table captured `info` (its executable mappings)."""
        if maps_library(info, (LIBRARY_PREFIX,)):
            with self._lock:
                self._found[info.pid] = info
                self._candidates.pop(info.pid, None)
        elif maps_library(info, CUDA_PREFIXES):
            with self._lock:
                self._candidates[info.pid] = info

    def forget(self, pid: int) -> None:
        """The process table forgot the process (it exited two drains ago, or was evicted)."""
        with self._lock:
            self._found.pop(pid, None)
            self._candidates.pop(pid, None)
            self._gone.add(pid)

    def __len__(self) -> int:
        return len(self._tracked)

    def pids(self) -> set[int]:
        """The processes whose ring is read (their samples are tagged from their timelines)."""
        return set(self._tracked)

    def state(self, pid: int, t: int) -> str | None:
        """ "busy" or "idle": the process's GPUs at CLOCK_MONOTONIC time t by its records; None where they
        do not cover t (before its ring was read, past what the library had flushed at the last drain,
        lost records) or the process has no ring. Called on the drain's thread, after `drain`."""
        tracked = self._tracked.get(pid)
        act = tracked.activity if tracked is not None else self._retired.get(pid)
        return act.state(t) if act is not None else None

    def _open(self, info: ProcessInfo, horizon_ns: int) -> int | None:
        """Starts reading the ring of `info`; its pid, if it is newly tracked."""
        key = (info.pid, info.start_ticks)
        old = self._tracked.get(info.pid)
        if key in self._refused or (old is not None and old.info.start_ticks == info.start_ticks):
            return None
        if old is not None:  # the pid was reused
            self._drop(info.pid)
        if len(self._tracked) >= self._max:
            self.counters.error("too_many")
            return None
        try:
            reader = RingReader.open(info.pid, self._proc_root)
        except RingError as e:
            self.counters.error(e.reason)
            if e.reason == "bad_header":
                self._refused.add(key)
            return None
        self._tracked[info.pid] = _Tracked(info, reader, horizon_ns)
        self.counters.processes_opened += 1
        return info.pid

    def _drop(self, pid: int) -> None:
        t = self._tracked.pop(pid, None)
        if t is not None:
            t.reader.close()
            self._retired[pid] = t.activity

    def _discover(self, horizon_ns: int, drop_gone: bool = True, probe: bool = True) -> set[int]:
        """Opens the rings of processes found since (and of candidates that now map our library, with
        `probe`); the pids newly tracked."""
        opened: set[int] = set()
        with self._lock:
            found, self._found = self._found, {}
            candidates = list(self._candidates.items())[:MAX_PROBES_PER_DRAIN] if probe else []
            if drop_gone:
                gone, self._gone = self._gone, set()
            else:
                gone = set()
        for pid in gone:
            self._drop(pid)
            self._refused = {k for k in self._refused if k[0] != pid}
        for info in found.values():
            if (pid := self._open(info, horizon_ns)) is not None:
                opened.add(pid)
        for pid, info in candidates:
            if pid in self._tracked:
                continue
            try:
                RingReader.open(pid, self._proc_root).close()  # reads its maps: is the library there now?
            except RingError as e:
                if e.reason == "gone":
                    with self._lock:
                        self._candidates.pop(pid, None)
                continue
            with self._lock:
                self._candidates.pop(pid, None)
            if self._open(info, horizon_ns) is not None:
                opened.add(pid)
        return opened

    def read(self) -> None:
        """Poll every tracked ring now, before the sampler's maps are read for the same window. A kernel's
        record is flushed after its launch call returned, and so after the library called the marker whose
        uprobe took the launch's stack: read first, every kernel in a window's records has its launch's
        stack in that window's samples. Read after the maps, a flush between the two reads (the library's
        last, at exit, comes right after the last launches) left those kernels' time under the kernel
        alone. Rings found since the last drain are opened here too, and polled with the rest."""
        self._reading = True
        if self._next is None:  # before the first drain: it opens and polls everything itself
            return
        start_ns, window = self._next
        self._discover(HORIZON_WINDOWS * window, drop_gone=False)  # the drain retires the gone
        for t in self._tracked.values():
            if t.read is None:
                if t.opened_ns is None:
                    t.opened_ns = start_ns
                try:
                    t.read = t.reader.poll(POLL_RECORDS)
                except RingError as e:
                    t.read = e  # raised where the drain polls it, and handled there

    def drain(self, start_ns: int, end_ns: int) -> CudaWindow:
        """The window [start_ns, end_ns) of CLOCK_MONOTONIC: every tracked ring polled once, and what each
        process's records say about it."""
        window = max(1, end_ns - start_ns)
        self._retired = {}
        # With `read` in use it probes the candidates (their maps read once a drain, not twice).
        fresh = self._discover(HORIZON_WINDOWS * window, probe=not self._reading)
        self._next = (end_ns, window)
        out = []
        for pid in list(self._tracked):
            t = self._tracked[pid]
            if pid in fresh and self._reading:
                continue  # opened after `read`: first polled by the next one, before the maps
            try:
                got = self._poll(t, start_ns, end_ns, window)
            except RingError as e:
                self.counters.error(e.reason)
                if e.reason == "bad_header":
                    self._refused.add((pid, t.info.start_ticks))
                got = self._report(t, ProcessCuda(t.info), end_ns, window, 0)  # what was read before
                self._drop(pid)
            except Exception:  # a ring we cannot make sense of must not cost the window
                log.exception("reading the CUPTI ring of process %d failed", pid)
                self.counters.error("internal")
                self._drop(pid)
                continue
            if got.devices or got.kernel_ns:
                out.append(got)
        return CudaWindow(out)

    def _poll(self, t: _Tracked, start_ns: int, end_ns: int, window: int) -> ProcessCuda:
        batch, t.read = (t.read if t.read is not None else t.reader.poll(POLL_RECORDS)), None
        if isinstance(batch, RingError):
            raise batch
        t.activity.add(batch)
        acts = batch.activities
        if len(acts):
            t.longest_ns = max(t.longest_ns, int((acts["end_ns"] - acts["start_ns"]).max()))
        dropped = batch.header.counters.get("cupti_dropped", 0)
        lost = batch.lost + batch.torn + max(0, dropped - t.cupti_dropped)
        t.cupti_dropped = max(t.cupti_dropped, dropped)
        self.counters.records_read += len(batch.activities) + len(batch.launches)
        self.counters.records_lost += lost
        got = ProcessCuda(t.info)
        got.kernel_ns, got.kernel_count, got.kernels = kernel_ns_by_name(batch)
        got.sampled_kernels = sampled_kernels(t.sampled, batch)
        if t.opened_ns is None:
            t.opened_ns = start_ns
        if t.cursor is None and t.activity.known_from is not None:
            # What the ring held from before the window of its first poll is history: its kernel time is
            # counted, its timeline is not (a first stretch reaching back further would lag every later one).
            t.cursor = max(t.activity.known_from, t.opened_ns)
        return self._report(t, got, end_ns, window, lost)

    def _report(self, t: _Tracked, got: ProcessCuda, end_ns: int, window: int, lost: int) -> ProcessCuda:
        """The next stretch of what is known, per device: [cursor, hi), at most a window long."""
        act = t.activity
        if t.cursor is None:
            return got
        lo = t.cursor
        # The library's flush hands over what had *ended* by then: a kernel still running at the flush
        # comes with a later one, though it began before. Had the stretch reached the flush, the time it ran
        # would have been called idle and the gap before it never counted. The stretch stops short of the
        # flush by the longest kernel or copy the process has run, so such a kernel began after it: exact
        # while no kernel runs longer than those before it (one that does can still cost a gap).
        holdback = min(t.longest_ns, window)
        hi = min(act.complete_until - holdback, end_ns, lo + window)
        if hi <= lo:
            if lost:
                got.devices = [DeviceActivity(d, lo, 0, 0, GapStats.of([]), lost if i == 0 else 0)
                               for i, d in enumerate(sorted(act.devices))]  # fmt: skip
            return got
        known = act.known_ns(lo, hi)
        for i, dev in enumerate(sorted(act.devices)):
            gaps = GapStats.of(act.ended_gaps(lo, hi, dev))
            # Lost records have no device: they are said once per process, on its first device's row.
            got.devices.append(
                DeviceActivity(dev, lo, known, act.idle_ns(lo, hi, dev), gaps, lost if i == 0 else 0)
            )
        t.cursor = hi
        return got

    def close(self) -> None:
        for pid in list(self._tracked):
            self._drop(pid)
