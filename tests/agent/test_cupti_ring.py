"""The ring between our CUPTI library and the agent: the Python reader (agent/gpu/cupti_ring.py) against the
C layout, and against the real library writing in a real process (the CUDA stand-ins drive it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fleetprof.agent.gpu.cupti_ring import (
    COUNTERS,
    HEADER_SIZE,
    MAGIC,
    RECORD_DTYPE,
    RECORD_SIZE,
    ProcessMemory,
    RingBatch,
    RingReader,
    header_offsets,
    record_checks,
)
from tests.cuda_standin import CudaStandins, build_standins

RING_H = "agent/cupti/fleetprof_cupti_ring.h"

# The C side of every field the reader uses: (python name, C member path).
RECORD_FIELDS = {
    "seq": "seq", "kind": "kind", "subkind": "subkind", "correlation_id": "correlation_id",
    "start_ns": "u.activity.start_ns", "end_ns": "u.activity.end_ns", "bytes": "u.activity.bytes",
    "device_id": "u.activity.device_id", "context_id": "u.activity.context_id",
    "stream_id": "u.activity.stream_id", "name_ref": "u.activity.name_ref",
    "name_hash": "u.activity.name_hash",
    "enter_ns": "u.launch.enter_ns", "exit_ns": "u.launch.exit_ns", "weight": "u.launch.weight",
    "inner_correlation_id": "u.launch.inner_correlation_id", "tid": "u.launch.tid",
    "inner_cbid": "u.launch.inner_cbid", "domains": "u.launch.domains", "result": "u.launch.result",
    "check": "u.activity.check",
}  # fmt: skip
LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "fleetprof_cupti_ring.h"
int main(void) {
    printf("{\"header_size\": %zu, \"record_size\": %zu, \"records_offset\": %u, \"magic\": %llu,\n",
           sizeof(struct fp_cupti_header), sizeof(struct fp_cupti_record), FP_CUPTI_RECORDS_OFFSET,
           (unsigned long long)FP_CUPTI_MAGIC);
    printf("\"header\": {");
    HEADER_FIELDS
    printf("\"end\": 0}, \"record\": {");
    RECORD_FIELDS
    printf("\"end\": 0}, \"counters\": {");
    COUNTER_FIELDS
    printf("\"end\": 0}, \"checks\": [");
    for (int r = 0; r < 4; r++) {  // records of known bytes, and what fp_cupti_check makes of them
        struct fp_cupti_record rec;
        for (size_t i = 0; i < sizeof rec; i++)
            ((unsigned char *)&rec)[i] = (unsigned char)(i * 7 + r * 31 + 3);
        printf("%s%u", r ? ", " : "", fp_cupti_check(&rec));
    }
    printf("]}\n");
    return 0;
}
"""


def pattern_records(n: int) -> np.ndarray:
    raw = bytes((i * 7 + r * 31 + 3) & 0xFF for r in range(n) for i in range(RECORD_SIZE))
    return np.frombuffer(raw, dtype=RECORD_DTYPE)


def test_the_reader_mirrors_the_c_layout_and_check(tmp_path) -> None:
    from tests.cuda_standin import REPO

    def offset(struct: str, key: str, member: str) -> str:
        return f'printf("\\"{key}\\": %zu, ", offsetof(struct {struct}, {member}));'

    header = "".join(offset("fp_cupti_header", name, name) for name in header_offsets())
    record = "".join(offset("fp_cupti_record", py, c) for py, c in RECORD_FIELDS.items())
    src = tmp_path / "layout.c"
    counters = "".join(f'printf("\\"{name}\\": %d, ", FP_C_{name.upper()});' for name in COUNTERS)
    layout = LAYOUT_C.replace("HEADER_FIELDS", header).replace("RECORD_FIELDS", record)
    src.write_text(layout.replace("COUNTER_FIELDS", counters))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-I", str(REPO / "agent" / "cupti"), "-o", str(exe), str(src)], check=True)
    c = json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
    assert (c["header_size"], c["record_size"], c["magic"]) == (HEADER_SIZE, RECORD_SIZE, MAGIC)
    assert c["records_offset"] >= HEADER_SIZE
    del c["header"]["end"], c["record"]["end"], c["counters"]["end"]
    assert c["counters"] == {name: i for i, name in enumerate(COUNTERS)}
    assert c["header"] == header_offsets()
    assert c["record"] == {name: RECORD_DTYPE.fields[name][1] for name in RECORD_FIELDS}
    assert record_checks(pattern_records(4)).tolist() == c["checks"]


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


def wait_for_ring(pid: int, timeout: float = 30) -> RingReader:
    deadline = time.monotonic() + timeout
    while True:
        try:
            reader = RingReader.open(pid)
            if reader.header().state == "running":
                return reader
        except Exception:  # not loaded or not initialised yet
            if time.monotonic() > deadline:
                raise
        time.sleep(0.005)


def test_the_ring_drops_and_counts_when_nobody_reads_and_the_workload_never_waits(cuda: CudaStandins) -> None:
    env = cuda.env(HOLD="1", WAIT_AFTER_INIT="1", FLEETPROF_CUPTI_SAMPLE_EVERY="1",
                   FLEETPROF_CUPTI_SAMPLE_CAP="0")  # fmt: skip
    pipe = subprocess.PIPE
    proc = subprocess.Popen([str(cuda.launcher), "loop", "0.2"], stdin=pipe, stdout=pipe, text=True, env=env)
    try:
        assert json.loads(proc.stdout.readline())["ev"] == "initialised"
        reader = wait_for_ring(proc.pid)
        first = reader.poll()  # before the first launch
        start = reader.position - len(first.activities) - len(first.launches) - first.lost - first.torn
        # Sized by count, not time (a loaded machine launches fewer in a second): at least one record per
        # launch, so three rings' worth of launches laps the ring at least twice.
        proc.stdin.write(f"{3 * first.header.capacity}\n")
        proc.stdin.flush()
        lines = []
        for line in proc.stdout:
            lines.append(json.loads(line))
            if lines[-1]["ev"] == "holding":
                break
        # Nobody read while it ran. Now read to the end (after a flush, so every record is in).
        held = time.monotonic_ns()
        batches = [first]
        while batches[-1].header.flushed_ns <= held:
            time.sleep(0.05)
            batches.append(reader.poll())
        header = batches[-1].header
        (loop,) = [e for e in lines if e["ev"] == "loop"]
        counters = header.counters
        assert counters["launches"] == loop["launches"]  # the workload ran every launch it meant to
        # Every record written is in write_seq; the reader accounts for each one after `start` exactly once.
        assert header.write_seq == counters["kernels"] + counters["copies"] + counters["sampled"]
        got = sum(len(b.activities) + len(b.launches) for b in batches)
        assert got + reader.stats.lost + reader.stats.torn == header.write_seq - start
        assert reader.stats.lost > header.capacity  # the writer lapped the ring many times meanwhile
        assert got >= header.capacity  # and the last lap was read whole
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


class RacingMemory:
    """The process's real memory, except that right after the reader copies records the (stopped) writer
    is let run a whole lap of the ring: the race a reader meets when it is slower than the writer, made
    certain instead of rare."""

    def __init__(self, real: ProcessMemory, pid: int, write_seq_at: int, capacity: int) -> None:
        self.real, self.pid, self.write_seq_at, self.capacity = real, pid, write_seq_at, capacity
        self.armed = False
        self.laps = 0

    def write_seq(self) -> int:
        return int.from_bytes(self.real.read(self.write_seq_at, 8), "little")

    def read(self, address: int, size: int) -> bytes:
        data = self.real.read(address, size)
        if self.armed and size >= RECORD_SIZE * 16:  # a copy of records
            self.armed = False
            before = self.write_seq()
            os.kill(self.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while self.write_seq() < before + self.capacity + size // RECORD_SIZE:
                assert time.monotonic() < deadline, "the writer did not lap the ring"
                time.sleep(0.001)
            os.kill(self.pid, signal.SIGSTOP)
            self.laps += 1
        return data

    def close(self) -> None:
        self.real.close()


def test_a_copy_the_writer_overtook_is_detected_and_never_returned(cuda: CudaStandins) -> None:
    env = cuda.env(FLEETPROF_CUPTI_SAMPLE_EVERY="1", FLEETPROF_CUPTI_SAMPLE_CAP="0")
    proc = subprocess.Popen([str(cuda.launcher), "loop", "30"], stdout=subprocess.DEVNULL, env=env)
    try:
        reader = wait_for_ring(proc.pid)
        while reader.header().write_seq < 4 * reader.header().capacity:
            time.sleep(0.01)
        reader.poll()  # catch up with the writer
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.05)
        h = reader.header()
        racing = RacingMemory(reader.memory, proc.pid, reader.location.address + 704, h.capacity)
        reader.memory = racing
        racing.armed = True
        batch = reader.poll()
        assert racing.laps == 1
        # Everything copied before the lap is refused: torn (copied while being rewritten) or lost.
        assert batch.torn > 0
        assert len(batch.activities) + len(batch.launches) == 0
        # The next poll reads the writer's new lap; what it skipped is counted, and every record it
        # returns passes its own check.
        racing.armed = False
        after = reader.poll()
        assert after.lost > 0 and len(after.activities) > 0
        for rows in (after.activities, after.launches):
            assert rows.dtype == RECORD_DTYPE and (record_checks(rows) == rows["check"]).all()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


class UnpublishedMemory:
    """The process's real memory, except that one record reads as claimed but not yet written (its slot's
    sequence number still the previous lap's): what a reader sees while a launch thread is preempted between
    claiming a slot and publishing it, and a flush on another thread publishes the records after it."""

    def __init__(self, real: ProcessMemory, records_at: int, capacity: int, index: int) -> None:
        self.real, self.records_at, self.capacity, self.index = real, records_at, capacity, index
        self.armed = True

    def read(self, address: int, size: int) -> bytes:
        data = bytearray(self.real.read(address, size))
        at = self.records_at + (self.index % self.capacity) * RECORD_SIZE
        if self.armed and address <= at < address + size:
            data[at - address : at - address + 8] = bytes(8)  # seq 0: never written
        return bytes(data)

    def close(self) -> None:
        self.real.close()


def test_a_flush_is_trusted_only_once_every_record_before_it_is_read(cuda: CudaStandins) -> None:
    env = cuda.env(FLEETPROF_CUPTI_SAMPLE_EVERY="1", FLEETPROF_CUPTI_SAMPLE_CAP="0")
    proc = subprocess.Popen([str(cuda.launcher), "phases", "60", "5"], stdout=subprocess.DEVNULL, env=env)
    try:
        reader = wait_for_ring(proc.pid)

        def whole() -> RingBatch:
            """A poll that read every record up to the flush it saw (the workload's threads may stand
            between a claim and its publication at any one poll, never for long)."""
            deadline = time.monotonic() + 30
            while (
                batch := reader.poll()
            ).complete_until != batch.header.flushed_ns or not batch.complete_until:
                assert time.monotonic() < deadline, "no poll read up to a flush"
                time.sleep(0.01)
            return batch

        first = whole()
        while (
            reader.header().flushed_ns <= first.header.flushed_ns
            or reader.header().write_seq < (reader.position or 0) + 16
        ):
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)
        h = reader.header()
        stuck = (reader.position or 0) + 8
        reader.memory = UnpublishedMemory(reader.memory, reader.location.address + h.records_offset,
                                          h.capacity, stuck)  # fmt: skip
        short = reader.poll()
        # It stopped at (or before) the unpublished record: the flush's records after it are not read yet,
        # so what the batches cover stays where the last whole read left it, though the header says more.
        assert reader.position is not None and reader.position <= stuck < short.header.write_seq
        assert short.header.flushed_ns > first.header.flushed_ns
        assert short.complete_until == first.header.flushed_ns
        reader.memory.armed = False  # published now
        os.kill(proc.pid, signal.SIGCONT)
        assert whole().complete_until >= short.header.flushed_ns
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


# Kernels with long names, through the driver API: fills the names area (1 MiB) and cuts names over 8 KiB.
MANY_NAMES = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, module = ctypes.c_void_p(), ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuModuleLoadData(ctypes.byref(module), b"m") == 0
dur = ctypes.c_uint64(1000)
args = (ctypes.c_void_p * 1)(ctypes.addressof(dur))
for i in range(int(sys.argv[1])):
    f = ctypes.c_void_p()
    name = (b"k%05d_" % i) + b"x" * int(sys.argv[2])
    assert cuda.cuModuleGetFunction(ctypes.byref(f), module, name) == 0
    assert cuda.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, None, args, None) == 0
assert cuda.cuCtxSynchronize() == 0
print("holding", flush=True)
sys.stdin.readline()
"""


def test_names_are_bounded_cut_and_counted(cuda: CudaStandins) -> None:
    # 200 names of 6 KB: the 1 MiB area holds ~170; then 5 names of 10 KB, cut to 8 KiB.
    runs = {}
    for count, length in ((200, 6000), (5, 10_000)):
        proc = subprocess.Popen([sys.executable, "-c", MANY_NAMES, str(count), str(length)], env=cuda.env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout.readline().strip() == "holding"
            reader, held = RingReader.open(proc.pid), time.monotonic_ns()
            batches = [reader.poll()]
            while batches[-1].header.flushed_ns <= held:
                time.sleep(0.02)
                batches.append(reader.poll())
            runs[length] = (batches[-1].header, [k for b in batches for k in b.kernels()])
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    header, kernels = runs[6000]
    named = [k for k in kernels if k.name is not None]
    assert len(kernels) == 200 and 100 < len(named) < 200
    assert header.counters["names_full"] == 200 - len(named)
    assert all(k.name == (b"k%05d_" % int(k.name[1:6])).decode() + "x" * 6000 for k in named)
    assert len({k.name_hash for k in kernels}) == 200  # unnamed kernels still tell apart by hash
    assert header.names_used <= header.names_size
    header, kernels = runs[10_000]
    assert header.counters["names_cut"] == 5 and {len(k.name) for k in kernels} == {8192}


FORKS = """
import ctypes, os, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx, module, f = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuModuleLoadData(ctypes.byref(module), b"m") == 0
assert cuda.cuModuleGetFunction(ctypes.byref(f), module, b"before_fork") == 0
for _ in range(10):
    assert cuda.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
assert cuda.cuCtxSynchronize() == 0
time.sleep(0.5)  # a flush or more: the records are in the ring before the fork copies it
pid = os.fork()
if pid == 0:
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_is_marked_and_its_copy_of_the_ring_ignored(cuda: CudaStandins) -> None:
    proc = subprocess.Popen([sys.executable, "-c", FORKS], env=cuda.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        child = int(proc.stdout.readline())
        parent = RingReader.open(proc.pid).poll()
        assert parent.header.state == "running" and len(parent.kernels()) == 10
        copy = RingReader.open(child).poll()
        assert copy.header.state == "forked" and copy.header.write_seq == parent.header.write_seq
        assert len(copy.activities) == len(copy.launches) == 0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_header_of_another_layout_is_refused() -> None:
    from fleetprof.agent.gpu.cupti_ring import RingError, parse_header

    with pytest.raises(RingError) as err:
        parse_header(bytes(HEADER_SIZE))
    assert err.value.reason == "bad_header" and "magic" in str(err.value)
    raw = bytearray(HEADER_SIZE)
    raw[0:8] = MAGIC.to_bytes(8, "little")
    raw[8:12] = (99).to_bytes(4, "little")
    with pytest.raises(RingError, match="layout 99"):
        parse_header(bytes(raw))
