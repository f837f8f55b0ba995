"""The BPF CPython walker does not follow what is not a frame chain: a chain that comes round (stale frames
pointing back at each other) gives no Python frames at all, counted; a frame whose code is not a code object,
or whose owner is out of range (freed memory, reused), ends the walk with the frames before it, counted.
The target is tests/workloads/fake_cpython.c, which lays out a thread state and frames with 3.12's offsets
in its own memory: a real CPython never shows such a chain long enough to be sampled on purpose."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetprof.agent.model import STACK_NONE
from fleetprof.agent.python.offsets import TABLE, to_bpf
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from tests.conftest import own_scope, require_bpf

pytestmark = [pytest.mark.bpf]

FREQUENCY = 499
SECONDS = 2


@pytest.fixture(scope="module")
def sampler() -> Iterator[CpuSampler]:
    require_bpf()
    s = CpuSampler(
        SamplerConfig(frequency_hz=FREQUENCY, interval_s=1.0, off_cpu=False, unwind="fp", scope=own_scope())
    )
    yield s
    s.close()


def walk(sampler: CpuSampler, binary: Path, mode: str) -> tuple[Counter, Counter, list[int]]:
    """Run the fake interpreter in `mode`, registered with the walker as a 3.12; (its Python stacks as
    tuples of code addresses -> samples, the walker's counters, the code addresses in chain order)."""
    proc = subprocess.Popen([str(binary), mode, str(SECONDS)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    layout = json.loads(proc.stdout.readline())
    st = os.stat(f"/proc/{proc.pid}/ns/pid")
    pidns = ((os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino)
    sampler.set_python_process(
        proc.pid, to_bpf(TABLE[(3, 12)], layout["runtime"], pidns, (3, 12), layout["code_type"])
    )
    sampler.drain()  # before it was registered
    stacks: Counter = Counter()
    stats: Counter = Counter()
    while True:
        done = proc.poll() is not None
        time.sleep(0.3)
        drain = sampler.drain()
        stats.update(drain.stats)
        for s in drain.samples:
            if s.tgid == proc.pid:
                frames = drain.python_stacks.get(s.python_stack, ()) if s.python_stack != STACK_NONE else ()
                stacks[tuple(code for code, _, _ in frames)] += s.count
        if done:
            break
    assert proc.returncode == 0
    return stacks, stats, layout["codes"]


def test_a_whole_chain_is_walked(sampler: CpuSampler, workload_bin: Callable[[str], Path]) -> None:
    """The control: the same layout without a fault gives its three frames, leaf first."""
    stacks, stats, codes = walk(sampler, workload_bin("fake_cpython"), "ok")
    total = sum(stacks.values())
    print(stacks.most_common(2), {k: v for k, v in stats.items() if k.startswith("python")})
    # ~SECONDS x 499 samples of the spinning thread (SECONDS of its own CPU time); each walks the 3 frames.
    assert total > 100 and stacks[tuple(codes)] >= 0.95 * total, (stacks, codes)
    assert stats["python_cycle"] == stats["python_stale"] == 0


def test_a_chain_that_comes_round_gives_no_python_frames(
    sampler: CpuSampler, workload_bin: Callable[[str], Path]
) -> None:
    stacks, stats, _ = walk(sampler, workload_bin("fake_cpython"), "cycle")
    total = sum(stacks.values())
    print(stacks.most_common(2), {k: v for k, v in stats.items() if k.startswith("python")})
    # Without the check: 64 frames of B, C, B, C ... (the depth limit), counted as truncated.
    assert total > 100 and stacks[()] == total, stacks
    # Every walk of it (the only process registered with this sampler) ended so; counters and samples are
    # read a moment apart at each drain, so they are compared with the walks counted beside them.
    # (All but the walks at the run's edges: 985 of 986 in one run, the other one at the process's exit.)
    assert stats["python_samples"] > 100 and stats["python_cycle"] >= 0.98 * stats["python_samples"], stats


@pytest.mark.parametrize("mode", ["stale", "bad_owner"])
def test_a_stale_frame_ends_the_walk_with_the_frames_before_it(
    sampler: CpuSampler, workload_bin: Callable[[str], Path], mode: str
) -> None:
    stacks, stats, codes = walk(sampler, workload_bin("fake_cpython"), mode)
    total = sum(stacks.values())
    print(stacks.most_common(2), {k: v for k, v in stats.items() if k.startswith("python")})
    # Never a frame past the stale one. A sample may find no Python frame at all at the edges of the run (in
    # a make test beside another BPF test, 1 of 915 did, at the process's exit): those are no walk past
    # anything, and stay few.
    assert set(stacks) <= {(codes[0],), ()}, (stacks, codes)
    assert total > 100 and stacks[(codes[0],)] >= 0.98 * total, (stacks, codes)
    assert stats["python_samples"] > 100 and stats["python_stale"] >= 0.98 * stats["python_samples"], stats
