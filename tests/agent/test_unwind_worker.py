"""The agent's side of unwind tables without BPF: the worker process that builds them (answers, refusals,
deadlines, restarts) and the ranges they are written to."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from fleetprof.agent.process.rootfs import MALFORMED, TOO_LARGE
from fleetprof.agent.symbols.elf import ElfError, ElfFile
from fleetprof.agent.unwind.ranges import RangeAllocator
from fleetprof.agent.unwind.table import build_table
from fleetprof.agent.unwind.worker import TableWorker

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def test_the_worker_builds_the_same_table_as_this_process() -> None:
    worker = TableWorker()
    try:
        table, delta = worker.build(os.open(LIBC, os.O_RDONLY))
        with ElfFile(LIBC) as elf:
            here = build_table(elf)
        assert len(table) == len(here) > 10_000
        assert np.array_equal(table.pcs, here.pcs) and np.array_equal(table.rules, here.rules)
        assert delta == 0  # libc's code segment: p_vaddr == p_offset
        with pytest.raises(ElfError) as info:
            worker.build(os.open("/etc/hostname", os.O_RDONLY))
        assert info.value.reason in (MALFORMED, "truncated")
        assert worker.running  # a refused file is an answer, not a failure
    finally:
        worker.close()
    assert not worker.running


def test_a_worker_that_dies_or_misses_its_deadline_is_replaced() -> None:
    worker = TableWorker()
    try:
        worker.build(os.open(LIBC, os.O_RDONLY))
        assert worker._proc is not None
        worker._proc.kill()
        worker._proc.wait()
        table, _ = worker.build(os.open(LIBC, os.O_RDONLY))  # a new worker answers
        assert len(table) > 10_000
        big = max(glob.glob("/usr/lib/x86_64-linux-gnu/libLLVM-*.so*"), key=os.path.getsize)
        slow = TableWorker(deadline_s=0.001)  # libLLVM takes ~0.5 s
        with pytest.raises(ElfError) as info:
            slow.build(os.open(big, os.O_RDONLY))
        assert info.value.reason == TOO_LARGE and not slow.running  # killed
        slow.close()
    finally:
        worker.close()


def test_ranges_are_handed_out_first_fit_and_merged_when_given_back() -> None:
    a = RangeAllocator(100)
    x, y, z = a.alloc(30), a.alloc(30), a.alloc(30)
    assert (x, y, z, a.used) == (0, 30, 60, 90)
    assert a.alloc(20) is None  # 10 left
    a.free(y, 30)
    assert a.alloc(40) is None and a.largest_free == 30
    a.free(x, 30)  # merges with y's range: 60 in one piece
    assert a.largest_free == 60 and a.alloc(50) == 0
    a.free(z, 30)
    with pytest.raises(ValueError):
        a.free(z, 30)  # twice
    a.free(0, 50)
    assert a.used == 0 and a.largest_free == 100
