"""Syscalls through the whole path: real tracepoints in the agent, the wire, the collector's API."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import RunningAgent, RunningCollector, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def syscall_rows(col: RunningCollector, pid: int) -> dict[str, dict]:
    data = col.json("/api/v1/syscalls", query=f'{{pid="{pid}"}}', since="10m", by="syscall", limit="500")
    return {r["labels"]["syscall"]: r for r in data["syscalls"]}


@pytest.mark.parametrize("calls", [23_456, 5_001])
def test_exact_getppid_count_for_a_pid_reaches_the_collector(
    calls: int, agent: RunningAgent, module_collector: RunningCollector, workload_bin
) -> None:
    p = subprocess.Popen([workload_bin("getppid_n"), str(calls), "40"])
    p.wait(timeout=60)
    rows = wait_until(
        lambda: (r := syscall_rows(module_collector, p.pid)).get("getppid", {}).get("count") == calls and r,
        30,
        f"{calls} getppid calls of pid {p.pid} at the collector",
    )
    assert rows["getppid"]["count"] == calls
    assert rows["getppid"]["timed"] <= calls
