"""Off-CPU user stacks walked by the same tables as CPU samples (issue 29, item 2), and long waits recorded
exactly once at their length whatever the sampling (item 3): real eBPF, workloads that block through
glibc's wrappers (no frame pointer) under known call chains and measure their own waits."""

from __future__ import annotations

import collections
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetprof.agent.model import ResolvedSample
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.python.unwinder import PythonStacks
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.symbols.symbolizer import Symbolizer
from fleetprof.agent.unwind.unwinder import Unwinder
from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.query.waits import wait_reason
from tests.conftest import maps_libc, own_scope, require_bpf, wait_until
from tests.support.cpu_time import favoured

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

ENTRY = ("_start", "__libc_start_main", "__libc_start_call_main")
OURS = {"main", "loon_outer", "loon_wait", "loon_long", "loon_gap", "helper_tick", "now_ns", "wait_for_go"}


def _base(name: str) -> str:
    """A symbol without its version (`__libc_start_main@@GLIBC_2.34`)."""
    return name.split("@", 1)[0]


@dataclass
class Run:
    pid: int
    rows: list[ResolvedSample]
    stats: collections.Counter = field(default_factory=collections.Counter)
    truth: dict = field(default_factory=dict)
    windows: list[list[ResolvedSample]] = field(default_factory=list)  # the rows, drain by drain

    def user_stacks(self, tid: int) -> collections.Counter:
        """Root-first user function names of thread `tid`'s off-CPU rows -> ns."""
        out: collections.Counter = collections.Counter()
        for r in self.rows:
            if r.tid == tid:
                out[tuple(_base(f.function) for f in r.frames[: r.kernel_start])] += r.count
        return out


class Pipeline:
    """Sampler (off-CPU on), process table, table unwinder, symbolizer and resolver in this process, as the
    agent wires them; a workload's tables are built before it is let go (it waits for a line on stdin)."""

    def __init__(self, config: SamplerConfig):
        require_bpf()
        self.sampler = CpuSampler(config)
        maps = self.sampler.unwind_maps()
        self.unwinder = Unwinder(maps) if maps is not None else None
        self.python = PythonStacks(enabled=True)
        self.python.attach(self.sampler)
        self.table = ProcessTable(on_capture=self._captured, on_forget=self.python.forget)
        symbolizer = Symbolizer()
        symbolizer.load_kernel_symbols()
        self.resolver = Resolver(self.table, symbolizer, python=self.python)

    def _captured(self, info) -> None:
        self.python.on_capture(info)
        if self.unwinder is not None:
            self.unwinder.describe(info)

    def run(self, argv: list[str]) -> Run:
        with favoured():  # drains at nice -10: see tests/agent/test_offcpu_bpf.py Pipeline.run
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            wait_until(lambda: maps_libc(proc.pid), 30, f"pid {proc.pid} to map libc", every=0.005)
            self.table.refresh(proc.pid)
            if self.unwinder is not None:
                self.unwinder.build_pending()
            self.sampler.drain()  # the wait for the gate
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
            run = Run(proc.pid, [])
            while proc.poll() is None:
                time.sleep(0.5)
                self._collect(run)
            self._collect(run)
            assert proc.returncode == 0, argv
            assert proc.stdout is not None
            run.truth = json.loads(proc.stdout.read())
            proc.stdout.close()
            return run

    def _collect(self, run: Run) -> None:
        window = self.resolver.resolve(self.sampler.drain())
        rows = [r for r in window.offcpu if r.process.pid == run.pid]
        run.rows += rows
        run.windows.append(rows)
        run.stats.update(window.stats)

    def close(self) -> None:
        if self.unwinder is not None:
            self.unwinder.stop()
        self.sampler.close()


@pytest.fixture(scope="module")
def glibc_bin(workload_bin: Callable[[str], Path]) -> Path:
    return workload_bin("offcpu_glibc")


@pytest.fixture(scope="module")
def every_wait() -> Iterator[Pipeline]:
    """Every switch-out recorded (1/1), user stacks by the tables."""
    # Every switch-out of the node lands in the count table: room for a busy shared machine's window.
    p = Pipeline(
        SamplerConfig(
            frequency_hz=19, interval_s=1.0, offcpu_sample_every=1, offcpu_counts=1 << 16, scope=own_scope()
        )
    )
    yield p
    p.close()


def blocked_in_glibc(stack: tuple[str, ...]) -> bool:
    """The innermost user frame is glibc's, not ours: the thread blocked inside a wrapper."""
    return bool(stack) and stack[-1] not in OURS


def whole(stack: tuple[str, ...], chain: list[str]) -> bool:
    """Entry point, then `chain` (ours), then only glibc's frames down to the blocking call."""
    n = len(ENTRY) + len(chain)
    return (
        stack[: len(ENTRY)] == ENTRY
        and list(stack[len(ENTRY) : n]) == chain
        and len(stack) > n
        and not OURS & set(stack[n:])
    )


@pytest.mark.parametrize("mode", ["read", "cond", "epoll", "nanosleep"])
def test_a_wait_through_glibc_keeps_the_wrappers_caller_and_a_whole_root(
    every_wait: Pipeline, glibc_bin: Path, mode: str
) -> None:
    run = every_wait.run([str(glibc_bin), mode, "2"])
    tid, total = run.truth["tid"], run.truth["total_ns"]
    stacks = run.user_stacks(tid)
    in_glibc = {s: ns for s, ns in stacks.items() if blocked_in_glibc(s)}
    good = sum(ns for s, ns in in_glibc.items() if whole(s, ["main", "loon_outer", "loon_wait"]))
    # Judged: the waits under loon_outer (where the frame-pointer walk also lands, loon_wait skipped) or cut
    # short inside glibc; main's pthread_join of the helper at the end is its own, whole, stack.
    bad = {
        s: ns
        for s, ns in in_glibc.items()
        if not whole(s, ["main", "loon_outer", "loon_wait"]) and "__pthread_clockjoin_ex" not in s
    }
    # Every wait is recorded (1/1): no sampling noise. The blocks' own total (CLOCK_MONOTONIC around each
    # loon_wait) bounds their off-CPU time from above; the CPU time of ~400 syscall paths (~20 us each, 0.4%
    # of 2 s) and any wait a preemption split off in loon_outer's own code are the only shortfall.
    top = sorted(stacks.items(), key=lambda kv: -kv[1])[:5]
    assert good >= 0.9 * total, f"{mode}: {good} of {total} ns whole; {top}; {why(run)}"
    # A walk by frame pointer puts every one of them here (the control below); the tables, none. 1% of the
    # time is left for a walk that a read fault cut short (none seen in the runs so far).
    assert sum(bad.values()) <= 0.01 * total, f"{mode}: {bad}; {why(run)}"


def why(run: Run) -> str:
    """What a failure needs told (a fresh-clone run once found 0.53 s of 2 s under a lone clock_nanosleep
    frame, once): how the walks ended, stack-table trouble, and per drain the main thread's off-CPU ns whose
    stack is not whole under main."""
    tid = run.truth["tid"]
    per_drain = [
        sum(r.count for r in rows if r.tid == tid and "main" not in {_base(f.function) for f in r.frames})
        for rows in run.windows
    ]
    stats = {k: v for k, v in run.stats.items() if k.startswith(("unwind_", "stack", "offcpu")) and v}
    return f"rootless ns per drain {per_drain}, stats {stats}"


def test_by_frame_pointer_the_same_wait_loses_the_wrappers_caller(glibc_bin: Path) -> None:
    """The control: the frame-pointer walk of the same workload skips loon_wait (why item 2 exists)."""
    p = Pipeline(
        SamplerConfig(frequency_hz=19, interval_s=1.0, offcpu_sample_every=1, unwind="fp", scope=own_scope())
    )
    try:
        run = p.run([str(glibc_bin), "read", "1"])
    finally:
        p.close()
    stacks = run.user_stacks(run.truth["tid"])
    in_glibc = {s: ns for s, ns in stacks.items() if blocked_in_glibc(s)}
    assert sum(in_glibc.values()) >= 0.9 * run.truth["total_ns"]
    assert not any("loon_wait" in s for s in in_glibc), in_glibc


# -- Long waits, exactly (item 3) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_in_eight() -> Iterator[Pipeline]:
    """The agent's defaults: 1 switch-out in 8 sampled, waits of 10 ms and more recorded exactly."""
    p = Pipeline(SamplerConfig(frequency_hz=19, interval_s=1.0, scope=own_scope()))
    yield p
    p.close()


LONG = ["main", "loon_long"]


def long_waits(run: Run) -> list[int]:
    """Per drain that has any, the off-CPU ns of the main thread under main -> loon_long, root whole (the
    blocks end seconds apart, and a drain runs every 0.5 s: at most one ends in a drain)."""
    return _long_waits(run)[0]


def _long_waits(run: Run) -> tuple[list[int], list[list[str]]]:
    """long_waits(), and per drain counted, each of the thread's rows: its ns, its reason and its kernel
    frames (what a failed check prints)."""
    tid = run.truth["tid"]
    found, seen = [], []
    for rows in run.windows:
        ns = 0
        told = []
        for r in rows:
            if r.tid == tid:
                kernel = [_base(f.function) for f in r.frames[r.kernel_start :]]
                told.append(f"{r.count} ns {wait_reason(_keys(r))}: {kernel}")
            stack = tuple(_base(f.function) for f in r.frames[: r.kernel_start])
            if r.tid == tid and "loon_long" in stack:
                if wait_reason(_keys(r)) != "clock_nanosleep":
                    # Not the block: on a machine whose CPUs something else keeps busy, waits for a CPU
                    # in the code around it (the clock reads, the wrapper), preempted, sampled 1 in 8 and
                    # scaled (+39 ms once, in a fresh-clone run) or recorded exactly. The query stage's
                    # classifier says which wait is which (collector/query/waits.py).
                    continue
                assert whole(stack, LONG), stack  # under its own function, the root whole
                ns += r.count
        if ns:
            found.append(ns)
            seen.append(told)
    return found, seen


def _keys(r: ResolvedSample) -> tuple[FrameKey, ...]:
    return tuple(FrameKey(f.function, f.module, i >= r.kernel_start) for i, f in enumerate(r.frames))


def assert_exact(run: Run) -> None:
    """Each block is there once, at its length. From above: the wait (switch-out to switch-in) lies inside the
    workload's two CLOCK_MONOTONIC reads around nanosleep(), and bpf_ktime_get_ns() is that clock. From below:
    the kernel arms the timer for the requested length just before the switch-out (microseconds; 1 ms is
    the margin). A wait counted 8x (sampled and scaled) or twice would be far above; one missed, absent."""
    found, rows = _long_waits(run)
    requested = run.truth["ms"] * 1_000_000
    blocks = run.truth["blocks"]
    assert len(found) == len(blocks), (found, blocks, rows)
    for ns, (t0, t1), told in zip(found, blocks, rows, strict=True):
        assert requested - 1_000_000 <= ns <= t1 - t0, (ns, requested, t1 - t0, told)


def test_every_long_wait_is_recorded_once_at_its_length_under_its_function(
    one_in_eight: Pipeline, glibc_bin: Path
) -> None:
    # Three 3 s waits, 50 ms of 1 ms sleeps around each. Without the exact path each would be kept with
    # probability 1/8 (all three: 1/512) and then count 8x.
    run = one_in_eight.run([str(glibc_bin), "long", "3000", "3"])
    assert_exact(run)
    assert run.stats["offcpu_exact"] >= 3


def test_a_single_long_wait_is_there_in_every_run(one_in_eight: Pipeline, glibc_bin: Path) -> None:
    # Eight runs of one 300 ms wait each: each run must have it (1/8 chance each without the exact path).
    for _ in range(8):
        run = one_in_eight.run([str(glibc_bin), "long", "300", "1"])
        assert_exact(run)


PY_UPSTREAM = """
import json, socket, sys, threading, time
sys.stdin.readline()
a, b = socket.socketpair()
def wait_for_upstream():
    t0 = time.monotonic_ns()
    a.recv(1)
    return t0, time.monotonic_ns()
threading.Timer(3.0, lambda: b.send(b"x")).start()
t0, t1 = wait_for_upstream()
print(json.dumps({"tid": threading.get_native_id(), "blocks": [[t0, t1]]}))
time.sleep(1.5)  # alive at the next drains, which read the code objects' names from its memory
"""


def test_a_long_python_wait_is_recorded_at_its_length_under_its_python_function(
    one_in_eight: Pipeline,
) -> None:
    """The issue's case: a Python thread blocked 3 s in socket.recv inside wait_for_upstream (Debian's
    python3.11, no frame pointers) is there, once, with its Python function and a whole native root."""
    run = one_in_eight.run(["/usr/bin/python3.11", "-c", PY_UPSTREAM])
    tid = run.truth["tid"]
    ((t0, t1),) = run.truth["blocks"]
    under = [
        r
        for r in run.rows
        if r.tid == tid and any(f.function.startswith("wait_for_upstream (") for f in r.frames)
    ]
    # The block is the recv; the thread's other waits under the function (for a CPU, around the call: a
    # preempted one sampled 1 in 8 counts 8x its length, +100 us once in a fresh-clone run) are not it.
    reasons = {id(r): wait_reason(_keys(r)) for r in under}
    block = reasons[id(max(under, key=lambda r: r.count))] if under else None
    ns = sum(r.count for r in under if reasons[id(r)] == block)
    told = [(r.frames, r.count, reasons[id(r)]) for r in under]
    assert block is not None and block.startswith("recv"), told
    # From above: the wait lies inside the two CLOCK_MONOTONIC reads. From below: the sender fires 3 s
    # after the timer started, which was before t0; the recv blocks within the interpreter's few microseconds
    # after t0, unless it was preempted there (a load of 15 on 2 CPUs: tens of ms at worst; 100 ms allowed).
    # Counted 8x, or missed (7 in 8 without the exact path), it is far outside.
    assert 2_900_000_000 <= ns <= t1 - t0, (ns, t1 - t0, told)
    for r in under:
        names = [_base(f.function) for f in r.frames[: r.kernel_start]]
        assert tuple(names[: len(ENTRY)]) == ENTRY, names
