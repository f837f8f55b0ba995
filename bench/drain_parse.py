"""The agent's per-row drain work, before and after issue 31: parsing drained map entries, and hashing a
row's stack in the encoder.

    .venv/bin/python bench/drain_parse.py        # seconds; no root, no BPF

* parse: 16,384 sample keys and 4,096 stacks of 25 frames, as bytes the way BPF_MAP_LOOKUP_AND_DELETE_BATCH
  hands them over, made into SampleCount rows and id -> addresses: copied into a ctypes object an entry
  and read field by field (the agent before), against agent/sampler.py's struct/array parsing (after).
* hash: a 25-frame stack keyed in a dict, as agent/batch.py does for every row: frames hashing themselves
  afresh (a frozen dataclass's own __hash__, before) against Frame's cached hash (after).
Process CPU time, best of 5 rounds each, alternating.
"""

from __future__ import annotations

import array
import ctypes as ct
import random
import time
from dataclasses import dataclass

from fleetprof.agent import sampler as S
from fleetprof.agent.bpfmaps import _copy
from fleetprof.agent.model import Frame

N_KEYS, N_STACKS, DEPTH = 16384, 4096, 25


def inputs() -> tuple[bytes, bytes, bytes, bytes]:
    rng = random.Random(1)
    keys = (S.SampleKey * N_KEYS)()
    for i in range(N_KEYS):
        k = keys[i]
        k.tgid, k.tid, k.user_stack, k.comm = 1000 + i % 50, i, rng.getrandbits(63), b"worker%d" % (i % 50)
    stacks = (S.StackTrace * N_STACKS)()
    for i in range(N_STACKS):
        stacks[i].len = DEPTH
        for j in range(DEPTH):
            stacks[i].ip[j] = 0x400000 + i * 64 + j
    ids = (ct.c_uint64 * N_STACKS)(*range(N_STACKS))
    return bytes(keys), bytes((ct.c_uint64 * N_KEYS)(*range(N_KEYS))), bytes(ids), bytes(stacks)


def parse_ctypes(keys: bytes, counts: bytes, ids: bytes, stacks: bytes) -> tuple:
    """What the drain did before (agent/bpfmaps.py drain_map, then sampler.py's list and dict): each entry of
    the batch's ctypes buffers copied out into an object of its own, then read field by field."""
    nk, ns = len(keys) // ct.sizeof(S.SampleKey), len(ids) // 8
    karr = (S.SampleKey * nk).from_buffer_copy(keys)
    carr = (ct.c_uint64 * nk).from_buffer_copy(counts)
    entries = [(_copy(karr[i]), _copy(carr[i])) for i in range(nk)]
    rows = [
        OldSampleCount(
            tgid=k.tgid,
            tid=k.tid,
            cgroup_id=k.cgroup_id,
            comm=k.comm.decode("utf-8", "replace"),
            user_stack=k.user_stack,
            kernel_stack=k.kernel_stack,
            count=v,
            python_stack=k.python_stack,
            gpu_slot=k.gpu_slot,
            idle=False,
        )
        for k, v in entries
    ]
    iarr = (ct.c_uint64 * ns).from_buffer_copy(ids)
    sarr = (S.StackTrace * ns).from_buffer_copy(stacks)
    drained = [(_copy(iarr[i]), _copy(sarr[i])) for i in range(ns)]
    return rows, {k: tuple(v.ip[: min(v.len, S.MAX_DEPTH)]) for k, v in drained}


def parse_bytes(keys: bytes, counts: bytes, ids: bytes, stacks: bytes) -> tuple:
    return S._sample_counts(keys, array.array("Q", counts).tolist()), S._stacks(ids, stacks)


@dataclass(frozen=True)
class OldSampleCount:  # SampleCount as it was: a frozen dataclass
    tgid: int
    tid: int
    cgroup_id: int
    comm: str
    user_stack: int
    kernel_stack: int
    count: int
    python_stack: int = 0
    gpu_slot: int = 0
    idle: bool = False


@dataclass(frozen=True)
class OldFrame:  # Frame as it was: the dataclass's own hash, made afresh each time
    function: str
    module: str
    kernel: bool = False


def best(fn, *args, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        t = time.process_time()
        fn(*args)
        times.append(time.process_time() - t)
    return min(times)


def main() -> None:
    data = inputs()
    entries = N_KEYS + N_STACKS
    before = best(parse_ctypes, *data) / entries * 1e6
    after = best(parse_bytes, *data) / entries * 1e6
    print(f"parse: {before:.2f} us an entry before, {after:.2f} after ({after / before:.2f}x)")
    for label, cls in (("before", OldFrame), ("after", Frame)):
        stack = tuple(cls(f"function_{i}", "/usr/lib/libexample.so.1") for i in range(DEPTH))

        def keyed(stack=stack) -> None:
            d: dict = {}
            for _ in range(10000):
                d.get((stack, DEPTH))

        print(f"hash: a {DEPTH}-frame row {label}: {best(keyed) / 10000 * 1e6:.2f} us")


if __name__ == "__main__":
    main()
