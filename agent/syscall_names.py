"""Syscall numbers as names, on the running architecture (the tables: agent/syscall_table.py, generated).

Its own module, apart from the syscall tracer that loads BCC: the resolver names the syscall a long wait was
in, and needs no BPF loader for it."""

from __future__ import annotations

import os
from functools import cache

from fleetprof.agent.syscall_table import TABLES


def syscall_table(machine: str) -> dict[int, str]:
    """Number -> name of the 64-bit syscalls of an architecture (`uname -m`); empty for one we have no
    table of. From Linux's own headers (agent/syscall_table.py, made by scripts/gen_syscalls.py): the
    numbers differ between architectures (getppid is 110 on x86-64, 173 on arm64)."""
    return TABLES.get(machine, {})


@cache
def syscall_name(nr: int) -> str:
    """The syscall's name on the running architecture; "syscall_<nr>" when its table has none (a newer
    syscall than the table's headers, or an architecture without a table)."""
    return syscall_table(os.uname().machine).get(nr) or f"syscall_{nr}"
