"""For tests that compare a workload's samples with its CPU time: run it alone on a CPU, and the time the
hypervisor stole meanwhile."""

from __future__ import annotations

import os


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
