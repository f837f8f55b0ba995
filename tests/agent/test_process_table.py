"""The agent's process table over a /proc tree written by the test: whole captures for sampled processes,
label-only captures for processes the syscall tracer meets, and which capture wins when events race."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from fleetprof.agent.process.table import ProcessTable

POD_A = "a1b2c3d4-0000-4000-8000-000000000001"
POD_B = "a1b2c3d4-0000-4000-8000-000000000002"
MAPS = "55d0c0000000-55d0c0001000 r-xp 00001000 08:01 1234 /usr/bin/worker\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, pid: int, comm: str, pod: str, start_ticks: int = 4242, flags: int = 0) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        self.stat(pid, comm, start_ticks, flags)
        (d / "maps").write_text(MAPS)
        slice_ = f"kubepods-pod{pod.replace('-', '_')}.slice"
        (d / "cgroup").write_text(f"0::/kubepods.slice/{slice_}/cri-x.scope\n")
        exe = d / "exe"
        exe.unlink(missing_ok=True)
        exe.symlink_to(f"/usr/bin/{comm}")

    def stat(self, pid: int, comm: str, start_ticks: int = 4242, flags: int = 0) -> None:
        fields = ["S"] + ["0"] * 5 + [str(flags)] + ["0"] * 12 + [str(start_ticks)] + ["0"] * 10
        (self.root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")

    def remove(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


def test_a_process_met_by_the_syscall_tracer_is_captured_for_its_labels_only(proc: FakeProc) -> None:
    captured = []
    table = ProcessTable(proc_root=str(proc.root), on_capture=captured.append)
    proc.write(100, "worker", POD_A)
    table.note(100, time.monotonic_ns())
    info = table.get(100, mappings=False)
    assert info is not None and not info.mapped and info.mappings == ()
    assert (info.comm, info.exe, info.start_ticks) == ("worker", "/usr/bin/worker", 4242)
    assert info.cgroup.pod_uid == POD_A
    assert captured == []  # the capture hook (CPython detection) needs mappings: not run

    whole = table.get(100)  # a sample of it: captured whole now
    assert whole is not None and whole.mapped and [m.path for m in whole.mappings] == ["/usr/bin/worker"]
    assert captured == [whole]
    assert table.get(100, mappings=False) is whole


def test_its_labels_outlive_it(proc: FakeProc) -> None:
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(100, "worker", POD_A)
    table.note(100, time.monotonic_ns())
    proc.remove(100)  # exited before any drain
    table.mark_exited(100)
    info = table.get(100)  # a sample asks for mappings: none can be read now, the labels stay
    assert info is not None and info.cgroup.pod_uid == POD_A and not info.mapped
    table.end_window()
    table.end_window()
    assert table.get(100) is None  # forgotten two drains after its exit


def test_a_first_syscall_keeps_a_whole_capture(proc: FakeProc) -> None:
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(100, "worker", POD_A)
    whole = table.refresh(100)
    proc.write(100, "worker", POD_B)
    table.note(100, time.monotonic_ns())  # nothing changed for the process: nothing is re-read
    assert table.get(100) is whole


def test_an_exec_after_the_capture_is_read_again_and_forgets_what_the_maps_told(proc: FakeProc) -> None:
    forgotten = []
    table = ProcessTable(proc_root=str(proc.root), on_forget=forgotten.append)
    proc.write(100, "sh", POD_A)
    assert table.refresh(100) is not None
    exec_ns = time.monotonic_ns()
    proc.write(100, "worker", POD_B)  # moved into the pod's cgroup, then exec'd
    table.note(100, exec_ns, exec_=True)
    info = table.get(100, mappings=False)
    assert info is not None and (info.comm, info.cgroup.pod_uid, info.mapped) == ("worker", POD_B, False)
    assert forgotten == [100]


def test_an_exec_that_a_later_capture_covers_is_not_read_again(proc: FakeProc) -> None:
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(100, "worker", POD_B)
    exec_ns = time.monotonic_ns()
    whole = table.refresh(100)  # the sampler's exec event, handled first
    proc.write(100, "other", POD_A)
    table.note(100, exec_ns, exec_=True)  # the tracer's event for the same exec, handled second
    assert table.get(100) is whole


def test_a_reused_pid_is_read_again(proc: FakeProc) -> None:
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(100, "old", POD_A, start_ticks=1)
    table.note(100, time.monotonic_ns())
    table.mark_exited(100)
    proc.write(100, "new", POD_B, start_ticks=2)
    table.note(100, time.monotonic_ns())
    info = table.get(100, mappings=False)
    assert info is not None and (info.comm, info.start_ticks, info.cgroup.pod_uid) == ("new", 2, POD_B)


def test_a_process_reported_new_while_it_exits_keeps_the_capture_taken_while_it_ran(proc: FakeProc) -> None:
    """A CPU sample between a process's exit event and its end reports it as new again. Read then, its
    maps are empty (its memory is gone); that capture must not replace the one its samples resolve by."""
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(300, "worker", POD_A)
    ran = table.get(300)
    assert ran is not None and ran.mappings
    table.mark_exited(300)
    proc.write(300, "worker", POD_A, flags=0x4)  # PF_EXITING: in do_exit
    (proc.root / "300" / "maps").write_text("")
    assert table.refresh(300) is None
    assert table.get(300) is ran
    table.end_window()
    table.end_window()
    assert table.get(300) is None  # forgotten two windows after its exit, and not captured again


def test_a_process_that_begins_to_exit_while_its_maps_are_read_keeps_the_capture_taken_while_it_ran(
    proc: FakeProc,
) -> None:
    """Its stat read before it began to exit, its maps after (empty: its memory map gone). /proc/PID/maps is
    a FIFO here, so the exit lands between the two reads every time: the writer opens it once the reader
    does, marks the process exiting (PF_EXITING, set before the kernel tears its memory map down), then
    gives the reader an empty file. In the emulated arm64 guest a workload captured so, as it exited right
    after its 500 CUDA launches, had every launch resolved without its mappings."""
    table = ProcessTable(proc_root=str(proc.root))
    proc.write(300, "worker", POD_A)
    ran = table.get(300)
    assert ran is not None and ran.mappings
    maps = proc.root / "300" / "maps"
    maps.unlink()
    os.mkfifo(maps)

    def exit_while_read() -> None:
        with open(maps, "w"):  # returns once the capture opens the maps to read them
            proc.stat(300, "worker", flags=0x4)

    writer = threading.Thread(target=exit_while_read)
    writer.start()
    try:
        assert table.refresh(300) is None  # gone, as far as a capture goes
    finally:
        writer.join(timeout=10)
    assert not writer.is_alive()
    assert table.get(300) is ran  # its samples still resolve by the capture taken while it ran
