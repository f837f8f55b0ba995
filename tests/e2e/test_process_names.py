"""The profiler names itself: a real collector and a real agent (with its unwind-table worker) read as
fleetprof-* in /proc/PID/comm, and their threads by what they do, never as python3 (fleetprof/procname.py;
the kernel keeps 15 bytes of a name)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetprof.procname import thread_comm
from tests.conftest import (
    RunningAgent,
    RunningCollector,
    free_port,
    http_get,
    settled_profile,
    stop_process,
    wait_until,
)
from tests.support.collector_process import start_collector_process
from tests.support.wire import make_batch, push


def comms(pid: int) -> dict[int, str]:
    """Each thread's comm, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().rstrip("\n")
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return kids


def test_thread_names_drop_our_prefix_and_fit_the_kernels_15_bytes() -> None:
    assert thread_comm("fleetprof-unwind-tables") == "unwind-tables"
    assert thread_comm("http-query:7471_12") == "http-query:7471"
    assert thread_comm("abcdefghijklmné") == "abcdefghijklmn"  # é would be cut in two at 15 bytes


def test_the_collector_process_and_its_threads_are_named(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    proc = start_collector_process(tmp_path / "data", grpc_port, http_port)
    try:
        push(f"127.0.0.1:{grpc_port}", [make_batch()])  # ingest's threads start with the first stream
        http_get(f"http://127.0.0.1:{http_port}/api/v1/top?since=5m")  # and the HTTP workers with a query
        named = comms(proc.pid)
        assert named[proc.pid] == "fleetprof-colle"  # "fleetprof-collector", as the kernel keeps it
        names = set(named.values())
        assert {"store-flusher", f"http:{http_port}", f"http-query:{http_port}"[:15], "ingest_0"} <= names, (
            names
        )
        assert not any(n.startswith("python") for n in names), names
    finally:
        stop_process(proc, 15)
        proc.stderr.close()


@pytest.mark.bpf
def test_the_agent_its_threads_and_its_unwind_worker_are_named(
    agent: RunningAgent, no_fp_bin: Callable[[str], Path]
) -> None:
    # A binary new to the node: the agent tables it, in its worker process, once it has sampled it.
    workload = subprocess.Popen([str(no_fp_bin("two_funcs")), "20", "50"], stdout=subprocess.DEVNULL)
    try:
        pid = agent.proc.pid

        def named_worker() -> int | None:
            """The worker once it has named itself (it does after its imports, ~0.3 s)."""
            for kid in children(pid):
                try:
                    cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
                    if b"fleetprof.agent.unwind.worker" in cmdline and comms(kid)[kid] != "python":
                        return kid
                except (FileNotFoundError, KeyError):
                    pass
            return None

        # The worker lives while it builds tables and 30 s after its last one: look while it is there.
        table_worker = wait_until(named_worker, 60, "the agent's unwind-table worker, named", every=0.05)
        assert comms(table_worker)[table_worker] == "fleetprof-unwin"  # "fleetprof-unwind", 15 bytes
        named = comms(pid)
        assert named[pid] == "fleetprof-agent"
        names = set(named.values())
        assert {"shipper", "unwind-tables", "process-events", f"http:{agent.http_port}"} <= names, names
        assert not any(n.startswith("python") for n in names), names
    finally:
        workload.kill()
        workload.wait()


@pytest.mark.bpf
def test_a_process_that_names_itself_after_it_was_described_is_profiled_under_its_new_name(
    module_collector: RunningCollector, agent: RunningAgent, workload_bin: Callable[[str], Path]
) -> None:
    """The agent describes a process at its first sample, which for a Python program comes before it
    names itself (its imports run first): the unwind worker could read "python" for good. The main
    thread's name at sample time renames the process. (A C workload: a Python one maps new code as it
    runs, and the re-read of its maps that this causes would rename it anyway.)"""
    proc = subprocess.Popen([str(workload_bin("rename_self")), "2.0", "renamed-later"])
    assert proc.wait(timeout=60) == 0
    query = f'{{pid="{proc.pid}"}}'
    settled_profile(module_collector, query, agent)
    by_comm = module_collector.json("/api/v1/top", query=query, since="5m", by="comm")["groups"]
    samples = {g["labels"]["comm"]: g["samples"] for g in by_comm}
    # 2 s of CPU at 99 Hz on each side of the rename. The agent's 1 s window that holds the rename goes to
    # one name whole (a batch has one entry per process), so each side has at least 1 s of its own: 99
    # samples expected, Poisson sigma ~10; 40 is 5.9 sigma below.
    assert samples.get("renamed-later", 0) > 40 and samples.get("rename_self", 0) > 40, samples
