"""agent/gpu/cupti_reader.py on a real workload (tests/cuda_standin, our real CUPTI library): the process is
found from its capture, its ring read window after window while it runs, and the windows' kernel time, idle
time and gaps add up to the simulated device's truth, each gap counted once; a garbled ring is refused by
reason and never read again, and the window logic keeps the wire's rules on records made here."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from fleetprof.agent.gpu.activity import MIN_GAP_NS
from fleetprof.agent.gpu.cupti_reader import (
    CUDA_PREFIXES,
    CudaWindow,
    CuptiReaders,
    kernel_ns_by_name,
    maps_library,
)
from fleetprof.agent.gpu.cupti_ring import (
    KIND_KERNEL,
    LIBRARY_PREFIX,
    RECORD_DTYPE,
    RingBatch,
    RingError,
    RingHeader,
)
from fleetprof.agent.process.table import read_process
from fleetprof.gpu_families import GAP_BUCKETS_NS
from tests.agent.test_cupti_library import CLOCK_TOLERANCE_NS, EXACT, kernel_bounds
from tests.conftest import wait_until
from tests.cuda_standin import CudaStandins, build_standins

MS = 1_000_000
WINDOW_NS = 100 * MS


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


class Workload:
    """The launcher run with HOLD=1, its JSON log read on a thread while the test drains."""

    def __init__(self, cuda: CudaStandins, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [str(cuda.launcher), *argv],
            env=cuda.env(HOLD="1", **EXACT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict] = []
        self.holding = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))
            if self.events[-1]["ev"] == "holding":
                self.holding.set()

    def logged(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Drainer:
    """Windows of WINDOW_NS one after another, each drained at its end as the agent does."""

    def __init__(self, readers: CuptiReaders) -> None:
        self.readers = readers
        self.t0 = time.monotonic_ns()
        self.windows: list[CudaWindow] = []

    def rows(self) -> list:
        return [d for w in self.windows for p in w.processes for d in p.devices]

    def until(self, done, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "timed out draining"
            t1 = self.t0 + WINDOW_NS
            time.sleep(max(0.0, (t1 - time.monotonic_ns()) / 1e9))
            self.windows.append(self.readers.drain(self.t0, t1))
            self.t0 = t1


def maps_cuda(pid: int):
    info = read_process(pid)
    return info if maps_library(info, (*CUDA_PREFIXES, LIBRARY_PREFIX)) else None


def test_windows_add_up_to_the_simulated_device(cuda: CudaStandins) -> None:
    readers = CuptiReaders()
    drainer = Drainer(readers)
    run = Workload(cuda, ["phases", "1.5", "5,12,20"])
    try:
        # Captured as the agent's process table captures it: once its program has mapped libcuda (before
        # cuInit loads our library, it is a candidate probed at each drain).
        info = wait_until(lambda: maps_cuda(run.proc.pid), 30, "the workload to map libcuda")
        readers.on_capture(info)
        drainer.until(run.holding.is_set)
        held = time.monotonic_ns()
        # Then until the stretches reported pass the moment it held (every kernel ran before it).
        drainer.until(lambda: any(d.start_ns + d.known_ns > held for d in drainer.rows()))
        run.release()
        drainer.until(lambda: len(readers) == 0)
    finally:
        run.kill()
    windows = drainer.windows
    assert readers.counters.errors["gone"] == 1 and readers.counters.processes_opened == 1
    assert readers.counters.records_lost == 0
    rows = [d for w in windows for p in w.processes for d in p.devices]
    assert rows and {d.device for d in rows} == {0}
    launches = run.logged("launch")
    loads = run.logged("load")

    # Kernel time per name: exactly what the device ran, to the ns, summed over the windows.
    truth: dict[str, int] = defaultdict(int)
    for e in launches:
        truth[e["kernel"]] += e["dur"]
    ours: dict[str, int] = defaultdict(int)
    for w in windows:
        for p in w.processes:
            for name, ns in p.kernel_ns.items():
                ours[name] += ns
    assert ours == truth
    assert sum(w.kernels for w in windows) == len(launches)

    # The stretches follow one another, each at most a window long: nothing is covered twice or skipped.
    for a, b in zip(rows, rows[1:], strict=False):
        assert b.start_ns == a.start_ns + a.known_ns
    assert all(0 < d.known_ns <= WINDOW_NS and d.idle_ns <= d.known_ns for d in rows)
    # The first stretch starts with the window in which the ring was first read (or at its first record, if
    # that is later): what ran before is kernel time, not a timeline.
    bounds = kernel_bounds(launches)
    first_start = rows[0].start_ns
    assert first_start >= bounds[0][0] - CLOCK_TOLERANCE_NS
    tol = CLOCK_TOLERANCE_NS
    # Kernel time inside the stretches, from the log: each kernel's extent is known to within its launch
    # call, so one that may straddle first_start counts between none and all of it.
    busy_lo = sum(e["dur"] for e, b in zip(launches, bounds, strict=True) if b[0] - tol >= first_start)
    busy_hi = sum(e["dur"] for e, b in zip(launches, bounds, strict=True) if b[3] + tol > first_start)
    known = sum(d.known_ns for d in rows)
    idle = sum(d.idle_ns for d in rows)
    # Idle is what is known less the kernels (one stream, never overlapping); a stretch under 1 µs between
    # two kernels counts as busy, so idle may be short of that by under 1 µs a kernel.
    assert known - busy_hi - MIN_GAP_NS * len(launches) <= idle <= known - busy_lo

    # Gaps: each loader pause between two kernels is one gap, at its length, counted in one window.
    gaps = sum(d.gaps.count for d in rows)
    hist = np.sum([d.gaps.histogram for d in rows if d.gaps.count], axis=0)
    assert gaps == int(hist.sum())
    between = [ld for ld in loads if ld["start"] > first_start and ld["end"] < launches[-1]["enter"]]
    # Which gaps of 1 ms or more the log says must exist and which may (the CPU may pause between launches
    # on a busy machine), among those that end in the stretches: a kernel's start and end are known to
    # within its launch call (kernel_bounds).
    must = may = 0
    for (_, _, lo_end, hi_end), (lo_next, hi_next, _, _) in zip(bounds, bounds[1:], strict=False):
        must += lo_next - hi_end - 2 * tol >= MS and lo_next - tol > first_start
        may += hi_next - lo_end + 2 * tol >= MS and hi_next + tol > first_start
    long_gaps = int(hist[GAP_BUCKETS_NS.index(MS) + 1 :].sum())
    assert len(between) >= 20 and must >= len(between)
    assert must <= long_gaps <= may
    longest = max(d.gaps.longest_ns for d in rows)
    assert longest >= max(ld["end"] - ld["start"] for ld in between)
    assert sum(d.gaps.count for d in rows) <= sum(d.known_ns for d in rows) // MIN_GAP_NS + len(rows)


def header(flushed_ns: int) -> RingHeader:
    return RingHeader("running", 0, "", 130001, "", 1, 0, 100, 0, flushed_ns, {}, 65536, 4096, 0, 0, 0, 0)


class ScriptedReader:
    """A RingReader's face (poll, close) over batches given by the test: the window logic alone."""

    def __init__(self, batches: list[RingBatch]) -> None:
        self.batches = batches

    def poll(self, max_records: int | None = None) -> RingBatch:
        return self.batches.pop(0)

    def close(self) -> None:
        pass


def kernels(rows: list[tuple[int, int]], flushed_ns: int) -> RingBatch:
    acts = np.zeros(len(rows), dtype=RECORD_DTYPE)
    for i, (s, e) in enumerate(rows):
        acts[i]["kind"], acts[i]["name_ref"], acts[i]["start_ns"], acts[i]["end_ns"] = KIND_KERNEL, 1, s, e
    return RingBatch(1, header(flushed_ns), acts, np.zeros(0, dtype=RECORD_DTYPE), {1: "gemm"}, 0, 0)


def test_a_gap_across_windows_is_counted_once_in_the_window_it_ends_in(monkeypatch) -> None:
    from fleetprof.agent.gpu import cupti_reader

    # Busy [0, 1 ms), idle 1 ms to 25 ms, busy [25, 26 ms), idle [26, 26.5 ms), busy [26.5, 27 ms), idle
    # [27, 27.5 ms), busy [27.5, 28.4 ms): that kernel was still running at the flush at 28 ms, so it comes
    # with the flush after. The library's flushes lag the windows by a few ms.
    script = [
        kernels([(0, 1 * MS)], 8 * MS),
        kernels([], 18 * MS),
        kernels([(25 * MS, 26 * MS), (26_500_000, 27 * MS)], 28 * MS),
        kernels([(27_500_000, 28_400_000)], 38 * MS),
    ]
    readers = CuptiReaders()
    info = read_process(os.getpid())
    monkeypatch.setattr(cupti_reader.RingReader, "open", lambda pid, root="/proc": ScriptedReader(script))
    readers._found[info.pid] = info
    rows, kernel_ns = [], []
    for i in range(4):
        w = readers.drain(i * 10 * MS, (i + 1) * 10 * MS)
        rows.append([d for p in w.processes for d in p.devices])
        kernel_ns.append([p.kernel_ns for p in w.processes])
    # Kernel time goes with the poll that read it.
    assert kernel_ns == [[{"gemm": MS}], [{}], [{"gemm": 1_500_000}], [{"gemm": 900_000}]]
    flat = [r[0] if r else None for r in rows]
    # Each stretch ends the longest kernel so far (1 ms) before the flush: [0, 7 ms), [7, 17), [17, 27) and
    # [27, 37). Had the third reached the flush at 28 ms, [27.5, 28) would have been called idle and the
    # gap before the late kernel never counted.
    assert [(d.start_ns, d.known_ns) for d in flat] == [(0, 7 * MS), (7 * MS, 10 * MS), (17 * MS, 10 * MS),
                                                         (27 * MS, 10 * MS)]  # fmt: skip
    assert [d.gaps.count for d in flat] == [0, 0, 2, 1]
    assert flat[2].gaps.longest_ns == 24 * MS and flat[2].gaps.idle_ns == 24 * MS + 500_000
    assert flat[3].gaps.idle_ns == 500_000 and flat[3].gaps.histogram[2] == 1  # [100 µs, 1 ms)
    # Idle: [1, 7 ms); all of [7, 17); [17, 25) and [26, 26.5); [27, 27.5) and [28.4, 37).
    assert [d.idle_ns for d in flat] == [6 * MS, 10 * MS, 8 * MS + 500_000, 500_000 + 8_600_000]


class FailingReader(ScriptedReader):
    """Polls as scripted, then fails as `error` says."""

    def __init__(self, batches: list[RingBatch], error: Exception) -> None:
        super().__init__(batches)
        self.error = error

    def poll(self, max_records: int | None = None) -> RingBatch:
        if not self.batches:
            raise self.error
        return super().poll(max_records)


@pytest.mark.parametrize(
    "error, reason, reopened",
    [
        (RingError("gone", "pid 1: exited"), "gone", True),
        (RingError("bad_header", "magic 0 is not ..."), "bad_header", False),
        (ValueError("a fault of ours"), "internal", True),
    ],
)
def test_a_failing_ring_is_dropped_counted_and_its_last_stretch_still_reported(
    monkeypatch, error: Exception, reason: str, reopened: bool
) -> None:
    from fleetprof.agent.gpu import cupti_reader

    opened: list[int] = []

    def open_ring(pid: int, root: str = "/proc") -> FailingReader:
        opened.append(pid)
        return FailingReader([kernels([(0, MS), (3 * MS, 4 * MS)], 6 * MS)], error)

    monkeypatch.setattr(cupti_reader.RingReader, "open", open_ring)
    readers = CuptiReaders()
    info = read_process(os.getpid())
    readers.on_capture(replace(info, mappings=(*info.mappings, library_mapping())))
    # Reports [0, 4 ms): the window ends there (flushed to 6 ms, less the longest kernel: 5 ms).
    first = readers.drain(0, 4 * MS)
    assert [d.known_ns for p in first.processes for d in p.devices] == [4 * MS]
    second = readers.drain(4 * MS, 8 * MS)  # the poll fails: the ring is dropped, never raised out of here
    assert len(readers) == 0 and readers.counters.errors[reason] == 1
    # What was read before the failure is still reported: [4, 5 ms) for a ring that failed on its poll, and
    # the process's samples of this window are still tagged by its timeline.
    rows = [d for p in second.processes for d in p.devices]
    if reason == "internal":
        assert rows == []  # nothing of a ring we could not make sense of
    else:
        assert [(d.start_ns, d.known_ns, d.idle_ns) for d in rows] == [(4 * MS, MS, MS)]
        assert readers.state(info.pid, 2 * MS) == "idle" and readers.state(info.pid, 3_500_000) == "busy"
    # Captured again (a re-capture after a dlopen, say): a garbled ring is not opened again.
    readers.on_capture(replace(info, mappings=(*info.mappings, library_mapping())))
    readers.drain(8 * MS, 12 * MS)
    assert len(opened) == (2 if reopened else 1)


def library_mapping():
    from fleetprof.agent.symbols.maps import Mapping

    path = "/opt/fleetprof/libfleetprof_cupti.so"
    return Mapping(0x7F0000000000, 0x7F0000010000, 0, 8, 1, 1234, path, "r-xp")


def test_kernel_time_per_name_tells_unnamed_kernels_apart_by_their_hash() -> None:
    rows = [(1, 0, 100, 1), (1, 100, 250, 1), (1, 0, 7, 0), (1, 10, 30, 0), (1, 50, 50, 1)]
    acts = np.zeros(len(rows), dtype=RECORD_DTYPE)
    hashes = [0x11, 0x11, 0xAB, 0xCD, 0x11]
    for i, ((kind, s, e, ref), h) in enumerate(zip(rows, hashes, strict=True)):
        acts[i]["kind"], acts[i]["start_ns"], acts[i]["end_ns"] = kind, s, e
        acts[i]["name_ref"], acts[i]["name_hash"] = ref, h
    batch = RingBatch(1, header(0), acts, np.zeros(0, dtype=RECORD_DTYPE), {1: "gemm"}, 0, 0)
    # The zero-length gemm counts as a kernel but adds no time; names the library could not store keep
    # apart by hash, named as activity.kernel_time names them.
    ns, count, kernels = kernel_ns_by_name(batch)
    assert ns == {"gemm": 250, "[kernel 000000ab]": 7, "[kernel 000000cd]": 20}
    assert count == {"gemm": 3, "[kernel 000000ab]": 1, "[kernel 000000cd]": 1} and kernels == 5


def test_the_drain_reports_what_read_polled_before_the_samplers_maps(monkeypatch) -> None:
    """The agent polls the rings (`read`) before it reads the sampler's maps, then drains: records flushed
    between the two are the next window's, whose samples hold their launches' stacks. A ring found between
    the two is first polled by the next `read`. A failure of the early poll is the drain's to count."""
    from fleetprof.agent.gpu import cupti_reader

    script = [kernels([(0, MS)], 2 * MS), kernels([(3 * MS, 4 * MS)], 5 * MS), kernels([], 9 * MS)]
    reader = FailingReader(script, RingError("gone", "pid 1: exited"))
    monkeypatch.setattr(cupti_reader.RingReader, "open", lambda pid, root="/proc": reader)
    readers = CuptiReaders()
    info = read_process(os.getpid())
    readers.read()  # before the first drain: nothing to poll
    readers.on_capture(replace(info, mappings=(*info.mappings, library_mapping())))
    assert readers.drain(0, 2 * MS).processes == [] and len(readers) == 1  # opened, not polled
    assert len(reader.batches) == 3
    readers.read()
    assert [p.kernel_ns for p in readers.drain(2 * MS, 4 * MS).processes] == [{"gemm": MS}]
    readers.read()  # polls the second batch; the third is flushed after it
    readers.read()  # a second read before the drain polls nothing more
    assert len(reader.batches) == 1
    assert [p.kernel_ns for p in readers.drain(4 * MS, 6 * MS).processes] == [{"gemm": MS}]
    readers.drain(6 * MS, 8 * MS)  # without a read first, the drain polls itself
    assert reader.batches == []
    readers.read()  # the ring is gone: raised nowhere, counted by the drain, the ring dropped
    assert len(readers) == 1
    readers.drain(8 * MS, 10 * MS)
    assert readers.counters.errors["gone"] == 1 and len(readers) == 0
