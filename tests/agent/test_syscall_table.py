"""Syscall names per architecture: the generated table matches Linux's headers, and each architecture
names its own numbers (arm64's are asm-generic's, not x86-64's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetprof.agent.syscall_names import syscall_name, syscall_table
from tests.conftest import REPO


def test_the_checked_in_table_is_what_the_generator_makes_from_the_headers() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/gen_syscalls.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("machine", "numbers"),
    [
        # The same calls have different numbers: a table of the wrong architecture names them wrongly.
        ("x86_64", {0: "read", 1: "write", 110: "getppid", 257: "openat", 230: "clock_nanosleep"}),
        ("aarch64", {63: "read", 64: "write", 173: "getppid", 56: "openat", 115: "clock_nanosleep"}),
    ],
)
def test_each_architecture_names_its_own_numbers(machine: str, numbers: dict[int, str]) -> None:
    table = syscall_table(machine)
    assert {nr: table.get(nr) for nr in numbers} == numbers
    # The numbers added since 5.x are shared by every architecture (clone3, openat2, futex_waitv).
    assert (table[435], table[437], table[449]) == ("clone3", "openat2", "futex_waitv")


def test_arm64_has_only_the_calls_asm_generic_gives_a_64_bit_kernel() -> None:
    arm64 = syscall_table("aarch64")
    names = set(arm64.values())
    # No legacy calls that asm-generic leaves out (open, fork, stat...), which x86-64 still has.
    assert not names & {"open", "fork", "stat", "poll", "select", "pipe"}
    assert {"open", "fork", "stat"} <= set(syscall_table("x86_64").values())
    # 64-bit names chosen by asm-generic's __SC_3264 (fcntl, not fcntl64) and arm64's __ARCH_WANT_* sets.
    assert (arm64[25], arm64[79], arm64[80]) == ("fcntl", "newfstatat", "fstat")
    assert arm64[38] == "renameat" and arm64[163] == "getrlimit" and arm64[435] == "clone3"


def test_an_architecture_without_a_table_names_numbers_only() -> None:
    assert syscall_table("riscv64") == {}
    assert syscall_name(99999) == "syscall_99999"
    machine = os.uname().machine
    assert syscall_name(0) == syscall_table(machine).get(0, "syscall_0")
