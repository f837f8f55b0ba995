"""The unwind table builder's queue: a file a walk asked for is built before the small files queued eagerly in
the meantime, whether it is large (not built when first mapped) or small and still waiting in the queue. A
node that keeps mapping new small files would otherwise keep a large one at the back of a smallest-first
queue for good (measured: 50-100 eager builds waiting, libpython among the walked-but-untabled); and a fresh
agent on a busy node queues hundreds of small files at once (Python extension modules), so libc waited
behind them while the samples of the processes that ran lost their callers. Real BPF maps; the table
builder replaced by one that records the order (the worker process and its parser are tested in
tests/agent/test_unwind_worker.py)."""

from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path

import numpy as np
import pytest

from fleetprof.agent.model import CgroupIdentity, Mapping, ProcessInfo
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.unwind.table import UnwindTable
from fleetprof.agent.unwind.unwinder import EAGER_MAX_BYTES, Unwinder
from tests.conftest import require_bpf

pytestmark = [pytest.mark.bpf]


def process(pid: int, files: list[Path]) -> ProcessInfo:
    """A process mapping `files` (read through its root: the test's own, so the files are real)."""
    mappings = tuple(
        Mapping(0x10000000 * (i + 1), 0x10000000 * (i + 1) + 0x1000, 0, 0, 0, f.stat().st_ino, str(f), "r-xp")
        for i, f in enumerate(files)
    )
    return ProcessInfo(pid, 1, "fake", str(files[0]), CgroupIdentity(path=""), mappings)


LIBS = sorted(
    (p for p in Path("/usr/lib/x86_64-linux-gnu").glob("lib*.so.*") if p.is_file() and not p.is_symlink()),
    key=lambda p: p.stat().st_size,
)


def recording_builder() -> tuple[list[int], object]:
    """A table builder that records the inode of each file it is given, in order."""
    built: list[int] = []

    def build(fd: int) -> tuple[UnwindTable, int]:
        built.append(os.fstat(fd).st_ino)
        os.close(fd)
        return UnwindTable(np.array([0x1000], dtype=np.uint32), np.array([2], dtype=np.uint32)), 0

    return built, build


def walk_met(unwinder: Unwinder, maps, files: list[Path]) -> None:
    """What BPF does when a walk meets a file without rows: flag its id in unwind_wanted."""
    ids = {f.key[2]: f.id for f in unwinder._files.values()}
    for path in files:
        maps._wanted[ct.c_int(ids[path.stat().st_ino])] = ct.c_uint8(1)


def test_a_table_a_walk_asked_for_is_built_before_eager_ones() -> None:
    require_bpf()
    large = next(p for p in reversed(LIBS) if p.stat().st_size > EAGER_MAX_BYTES)
    small = [p for p in LIBS if 20_000 < p.stat().st_size][:3]
    built, build = recording_builder()
    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False, unwind_files=16))
    maps = sampler.unwind_maps()
    assert maps is not None
    unwinder = Unwinder(maps, build=build)
    try:
        me = os.getpid()
        unwinder.describe(process(me, [large]))  # too large to table before a walk needs it
        unwinder.describe(process(me, [large, *small]))  # a new process: three small files, queued at once
        walk_met(unwinder, maps, [large])
        assert unwinder.collect_wanted() == 1  # only the large file waits for a walk
        unwinder.build_pending()
    finally:
        unwinder.stop()
        sampler.close()
    assert built[0] == large.stat().st_ino, (large, built)
    assert sorted(built[1:]) == sorted(p.stat().st_ino for p in small)


def test_a_small_file_a_walk_met_in_the_queue_goes_to_its_front() -> None:
    require_bpf()
    small = [p for p in LIBS if 20_000 < p.stat().st_size][:6]  # queued smallest first
    needed = small[-1]
    built, build = recording_builder()
    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False, unwind_files=16))
    maps = sampler.unwind_maps()
    assert maps is not None
    unwinder = Unwinder(maps, build=build)
    try:
        unwinder.describe(process(os.getpid(), small))
        walk_met(unwinder, maps, [needed])
        assert unwinder.collect_wanted() == 0  # no large file: nothing new to open
        unwinder.build_pending()
    finally:
        unwinder.stop()
        sampler.close()
    # Built first, and once: its first place in the queue is skipped.
    assert built[0] == needed.stat().st_ino, (needed, built)
    assert sorted(built) == sorted(p.stat().st_ino for p in small)


def test_files_queued_counts_the_tables_still_to_build_until_each_is_built() -> None:
    """`files_queued` (the agent's unwind_files_queued gauge, what waits before a process's samples are
    walked by tables): the small files a process maps from its description on, the large one once a walk
    asks for it, the one being built while it is, none once all are built."""
    require_bpf()
    large = next(p for p in reversed(LIBS) if p.stat().st_size > EAGER_MAX_BYTES)
    small = [p for p in LIBS if 20_000 < p.stat().st_size][:3]
    built, record = recording_builder()
    seen_while_building: list[int] = []
    unwinder: Unwinder | None = None

    def build(fd: int) -> tuple[UnwindTable, int]:
        seen_while_building.append(unwinder.stats().files_queued)
        return record(fd)

    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False, unwind_files=16))
    maps = sampler.unwind_maps()
    assert maps is not None
    unwinder = Unwinder(maps, build=build)
    try:
        assert unwinder.stats().files_queued == 0
        unwinder.describe(process(os.getpid(), [large, *small]))
        assert unwinder.stats().files_queued == len(small)  # the large one waits for a walk
        walk_met(unwinder, maps, [large])
        assert unwinder.collect_wanted() == 1
        assert unwinder.stats().files_queued == len(small) + 1
        unwinder.build_pending()
        assert unwinder.stats().files_queued == 0
        assert unwinder.stats().files_tabled == len(small) + 1
    finally:
        unwinder.stop()
        sampler.close()
    # each build saw itself and the files still behind it
    assert seen_while_building == [4, 3, 2, 1], seen_while_building
    assert len(built) == 4
