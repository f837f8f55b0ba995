"""The sampler's stack maps hold kernel memory by need where the kernel allows it, and still store stacks."""

from __future__ import annotations

import ctypes as ct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetprof.agent.model import STACK_LOST, STACK_RESERVED
from fleetprof.agent.sampler import BPF_F_NO_PREALLOC, CpuSampler, SamplerConfig, StackTrace

STACK_MAPS = ("stacks0", "stacks1", "python_stacks0", "python_stacks1")


def test_stack_maps_go_by_need_from_kernel_6_1_and_only_when_asked() -> None:
    by_need = SamplerConfig()
    assert by_need.stacks_map_flags("6.18.0-1-cloud-amd64") == BPF_F_NO_PREALLOC
    assert by_need.stacks_map_flags("6.1.0") == BPF_F_NO_PREALLOC
    assert by_need.stacks_map_flags("5.15.0-91-generic") == 0  # its verifier refuses them in perf_event
    assert by_need.stacks_map_flags("garbage") == 0
    assert SamplerConfig(stacks_by_need=False).stacks_map_flags("6.18.0") == 0


def fdinfo(fd: int) -> dict[str, str]:
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.mark.bpf
def test_stack_maps_by_need_hold_what_they_store_and_stacks_are_still_stored() -> None:
    from tests.conftest import require_bpf

    require_bpf()
    entry = ct.sizeof(StackTrace) + 8  # value and key, without the kernel's own element header
    sampler = CpuSampler(SamplerConfig(frequency_hz=99, interval_s=1.0, off_cpu=False, unwind="fp"))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for name in STACK_MAPS:
            info = fdinfo(sampler._bpf[name].map_fd)
            assert int(info["map_flags"], 16) & BPF_F_NO_PREALLOC, name
            # Preallocated, the map would hold max_entries x entry bytes from the start; by need it holds
            # the few stacks sampled since the load (at most 2 a sample: 99 Hz x CPUs x a second or two).
            assert int(info["memlock"]) < int(info["max_entries"]) * entry // 4, (name, info)
        time.sleep(1.5)
        drain = sampler.drain()
    finally:
        spin.kill()
        spin.wait()
        sampler.close()
    rows = [s for s in drain.samples if s.tgid == spin.pid]
    # 99 Hz x 1.5 s of a busy loop: ~148 samples; even on a loaded machine, some.
    assert sum(s.count for s in rows) > 0
    for s in rows:  # every stack id a row names was stored, or the row says it was lost
        assert s.user_stack == STACK_LOST or s.user_stack < STACK_RESERVED or s.user_stack in drain.stacks
    assert any(s.user_stack in drain.stacks for s in rows)


@pytest.mark.bpf
def test_stack_maps_preallocated_when_asked() -> None:
    from tests.conftest import require_bpf

    require_bpf()
    sampler = CpuSampler(SamplerConfig(frequency_hz=19, off_cpu=False, unwind="fp", stacks_by_need=False))
    try:
        info = fdinfo(sampler._bpf["stacks0"].map_fd)
        assert not int(info["map_flags"], 16) & BPF_F_NO_PREALLOC
        assert int(info["memlock"]) >= int(info["max_entries"]) * 1024  # every entry held from the start
    finally:
        sampler.close()
