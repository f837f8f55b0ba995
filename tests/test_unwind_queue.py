"""The unwind table builder's queue: a file a walk asked for (large, so not built when first mapped) is built
before the small files queued eagerly in the meantime. A node that keeps mapping new small files would
otherwise keep it at the back of a smallest-first queue for good (measured: 50-100 eager builds waiting,
libpython among the walked-but-untabled). Real BPF maps; the table builder replaced by one that records the
order (the worker process and its parser are tested in tests/test_unwind_worker.py)."""

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


def test_a_table_a_walk_asked_for_is_built_before_eager_ones() -> None:
    require_bpf()
    libs = [
        p for p in Path("/usr/lib/x86_64-linux-gnu").glob("lib*.so.*") if p.is_file() and not p.is_symlink()
    ]
    large = next(
        p for p in sorted(libs, key=lambda p: -p.stat().st_size) if p.stat().st_size > EAGER_MAX_BYTES
    )
    small = [p for p in sorted(libs, key=lambda p: p.stat().st_size) if 20_000 < p.stat().st_size][:3]
    built: list[int] = []

    def build(fd: int) -> tuple[UnwindTable, int]:
        built.append(os.fstat(fd).st_ino)
        os.close(fd)
        return UnwindTable(np.array([0x1000], dtype=np.uint32), np.array([2], dtype=np.uint32)), 0

    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False, unwind_files=16))
    maps = sampler.unwind_maps()
    assert maps is not None
    unwinder = Unwinder(maps, build=build)
    try:
        me = os.getpid()
        unwinder.describe(process(me, [large]))  # too large to table before a walk needs it
        unwinder.describe(process(me, [large, *small]))  # a new process: three small files, queued at once
        for fid in range(16):  # what BPF does when a walk meets a file without rows
            maps._wanted[ct.c_int(fid)] = ct.c_uint8(1)
        assert unwinder.collect_wanted() == 1  # only the large file waits for a walk
        assert unwinder.build_pending() == 4
    finally:
        unwinder.stop()
        sampler.close()
    assert built[0] == large.stat().st_ino, (large, built)
    assert sorted(built[1:]) == sorted(p.stat().st_ino for p in small)
