"""For tests that compare a workload's samples with its CPU time: run it alone on a CPU, and the time the
hypervisor stole meanwhile; for tests whose in-process agent must keep its pace on a busy machine."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# How long to wait for a workload sized by its own CPU time (two_funcs, py_story, unwind_chain cpu): the
# less CPU a machine gives it, the longer it runs. 5.5 s of CPU took over 60 s of wall time under
# `taskset -c 0` on a machine at load 15. Only a hung workload meets this.
CPU_BOUND_TIMEOUT_S = 600


def alone_possible() -> bool:
    """Whether this process may use two CPUs or more. On the only one (`taskset -c 0`) a SCHED_FIFO
    workload leaves the agent and the collector it is measured through 50 ms a second: the disk-full test
    timed out waiting for its first samples."""
    return len(os.sched_getaffinity(0)) >= 2


def run_alone(argv: list) -> list:
    """`argv` under SCHED_FIFO priority 1: no ordinary (SCHED_OTHER) process preempts it, so it runs in a
    few long stretches whatever else keeps the CPUs busy; the kernel's RT throttling (by default 50 ms of
    every second left to the rest) still bounds it. With one CPU (alone_possible), an ordinary process."""
    return ["chrt", "--fifo", "1", *map(str, argv)] if alone_possible() else list(map(str, argv))


def sample_band(expected: float) -> float:
    """The relative half-width of the band for the samples of a run_alone workload, `expected` = its CPU
    seconds x frequency. Each unbroken stretch on a CPU gets its samples to within one (variance <= 1/4).
    Run alone it breaks only for RT throttling, ~once a second: for a 6-14 s run sigma <= 2 samples, and
    3% (42-90 samples) is > 20 sigma; one lost or doubled 1 s window (7-17%) falls outside. Time-sliced
    (one CPU) it runs in thousands of stretches of a few ms, each one sampled or not: its count varies at
    most like a Poisson count, sigma <= sqrt(expected), and the band is 4.5 sigma (8% of 2,994 samples,
    12% of 1,386); a lost window may then hide in it, but the tests' exact checks still count every
    sample the agent drained."""
    return 0.03 if alone_possible() else 4.5 / math.sqrt(expected)


def steal_seconds() -> float:
    """Time the hypervisor took from this VM's CPUs since boot (/proc/stat, all CPUs)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


@contextmanager
def favoured(nice: int = -10) -> Iterator[None]:
    """This process's threads, and the threads and processes they start meanwhile, at `nice` (a larger
    share of a busy CPU than ordinary processes get), then back. For tests that run an agent in-process:
    on a machine with 8 busy processes on 2 CPUs its GPU poll thread (every 0.1 s) waited for a CPU, or
    for the GIL held by a preempted drain thread, long enough to leave 0.2 s gaps between polls, and
    samples in a gap carry no GPU state (by design: the agent does not guess across a gap)."""
    before = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in _threads()}
    for tid in before:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    try:
        yield
    finally:
        for tid in _threads():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, before.get(tid, before[threading.get_native_id()]))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]
