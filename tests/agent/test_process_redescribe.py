"""When a process is described again, and when it must not be forgotten: a walk that left its mappings
makes the agent re-read them (and describe it again only if they changed), a late exit event of an
earlier process with the same pid does not end a live process's description (its table walks would turn
into frame-pointer walks), and a stack read against a process's old mappings is read again once it is
described anew. Over a /proc tree written by the test (tests/agent/test_process_table.py's)."""

from __future__ import annotations

import time
from pathlib import Path

from fleetprof.agent.model import STACK_NONE, Drain, ProcessInfo, SampleCount
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.resolver import UNSEEN_MAPPING, Resolver
from fleetprof.agent.symbols.symbolizer import Symbolizer
from tests.agent.test_process_table import MAPS, POD_A, POD_B, FakeProc

JIT_PAGE = "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n"


def test_an_exit_older_than_the_capture_is_an_earlier_process_and_is_ignored(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    forgotten: list[int] = []
    table = ProcessTable(proc_root=str(tmp_path), on_forget=forgotten.append)
    proc.write(100, "old", POD_A, start_ticks=1)
    table.refresh(100)
    exited_ns = time.monotonic_ns()  # the old process exits; its pid comes round again at once
    proc.write(100, "new", POD_B, start_ticks=2)
    new = table.refresh(100)  # the sampler's event for the new process, handled first
    table.mark_exited(100, exited_ns)  # the syscall tracer's exit event of the old one, handled after
    table.end_window()
    table.end_window()
    assert table.get(100) is new and forgotten == []


def test_an_exit_after_the_capture_ends_it_two_drains_later(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    forgotten: list[int] = []
    table = ProcessTable(proc_root=str(tmp_path), on_forget=forgotten.append)
    proc.write(100, "worker", POD_A)
    table.refresh(100)
    table.mark_exited(100, time.monotonic_ns())
    table.end_window()
    assert forgotten == []
    table.end_window()
    assert forgotten == [100]


def test_a_walk_outside_the_mappings_describes_it_again_only_if_they_changed(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    captured: list[ProcessInfo] = []
    table = ProcessTable(proc_root=str(tmp_path), on_capture=captured.append)
    proc.write(100, "worker", POD_A)
    first = table.refresh(100)
    assert first is not None and captured == [first]
    assert not table.remap_if_changed(100)  # a walk met garbage: the mappings are the same, nothing redone
    assert captured == [first]
    (tmp_path / "100" / "maps").write_text(MAPS + JIT_PAGE)  # a JIT mapped a page of code
    assert table.remap_if_changed(100)
    again = table.get(100)
    assert again is not None and captured == [first, again]
    assert [m.start for m in again.mappings] == [0x55D0C0000000, 0x7F0000000000]
    table.mark_exited(100)
    assert not table.remap_if_changed(100)  # exited: what it had stays
    assert not table.remap_if_changed(999)  # never described: its first sample does that


def test_a_stack_read_against_old_mappings_is_read_again_once_the_process_is_described_again(
    tmp_path: Path,
) -> None:
    """The resolver keeps each stack's frames by (pid, start time, stack id) across windows. A process
    described again keeps its pid and start time (an exec: another image; a dlopen). A stack first met
    before the description that maps its code (a fork's child that exec'd, sampled in its new vDSO before
    the exec event was handled) must be read again against the new mappings, not answered from the old."""
    proc = FakeProc(tmp_path)
    proc.write(100, "worker", POD_A)
    table = ProcessTable(proc_root=str(tmp_path))
    resolver = Resolver(table, Symbolizer(proc_root=str(tmp_path)))
    described = table.refresh(100)
    assert described is not None
    jit = 0x7F0000000010  # in JIT_PAGE, which the process has not mapped yet
    drain = Drain(0, 10**9, [SampleCount(100, 100, 0, "worker", 7, STACK_NONE, 3)], {7: (jit,)})

    def leaf() -> str:
        (sample,) = resolver.resolve(drain).samples
        return sample.frames[0].function

    before = leaf()
    assert before.startswith(f"[unknown] ({UNSEEN_MAPPING}+"), before
    assert table.get(100).mappings is described.mappings  # read again, unchanged: the same object kept
    (tmp_path / "100" / "maps").write_text(MAPS + JIT_PAGE)  # the exec's new image maps it
    table.refresh(100)  # the exec event
    after = leaf()
    assert UNSEEN_MAPPING not in after, after
