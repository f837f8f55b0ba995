"""CPU time the hypervisor stole from this VM, for tests that compare samples with a workload's CPU time."""

from __future__ import annotations

import os


def steal_seconds() -> float:
    """Time the hypervisor took from this VM's CPUs since boot (/proc/stat, all CPUs)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
