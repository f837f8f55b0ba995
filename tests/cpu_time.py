"""For tests that compare a workload's samples with its CPU time: run it alone on a CPU, and the time the
hypervisor stole meanwhile; for tests whose in-process agent must keep its pace on a busy machine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def run_alone(argv: list) -> list:
    """`argv` under SCHED_FIFO priority 1: no ordinary (SCHED_OTHER) process preempts it, so it runs in a
    few long stretches whatever else keeps the CPUs busy; the kernel's RT throttling (by default 50 ms of
    every second left to the rest) still bounds it."""
    return ["chrt", "--fifo", "1", *map(str, argv)]


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
