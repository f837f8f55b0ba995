"""Known profiles pushed through the real gRPC ingest, for the query and format tests."""

from __future__ import annotations

import time
import uuid

import grpc

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from tests.support.wire import BatchBuilder

Row = tuple[int, str, dict[str, str], list[tuple[str, str]], int, int]
"""(pid, comm, labels, frames root first as (function, module), index of the first kernel frame, samples)."""

FREQUENCY_HZ = 100  # 10 ms per sample: CPU times come out round

# hot_loop 300 self, cold_path 60 + 40, sys_read (kernel) 40; 400 samples, 4 s of CPU.
PROFILE: list[Row] = [
    (101, "worker", {"namespace": "ml", "pod": "trainer-0"},
     [("main", "/app/worker"), ("run", "/app/worker"), ("hot_loop", "/app/worker")], 3, 300),
    (101, "worker", {"namespace": "ml", "pod": "trainer-0"},
     [("main", "/app/worker"), ("run", "/app/worker"), ("cold_path", "/app/worker")], 3, 60),
    (202, "server", {"namespace": "web", "pod": "api-0"},
     [("main", "/app/server"), ("accept_loop", "/app/server"), ("cold_path", "/app/server"),
      ("sys_read", "")], 3, 40),
]  # fmt: skip


def profile_batch(
    rows: list[Row], ago_s: float = 0.0, window_s: float = 10.0, frequency_hz: int = FREQUENCY_HZ
) -> pb.Batch:
    """rows as one agent batch covering window_s seconds that ended ago_s seconds ago."""
    b = BatchBuilder(
        "test-node", f"formats-{uuid.uuid4()}", 1, time.time_ns() - int(ago_s * 1e9), window_s, frequency_hz
    )
    processes: dict[int, int] = {}
    for pid, comm, labels, frames, kernel_start, count in rows:
        if pid not in processes:
            processes[pid] = b.process(pid, comm, labels, exe=frames[0][1])
        b.sample(processes[pid], b.stack(frames, kernel_start), count)
    return b.build()


def push_profile(
    grpc_target: str,
    rows: list[Row],
    ago_s: float = 0.0,
    window_s: float = 10.0,
    frequency_hz: int = FREQUENCY_HZ,
) -> None:
    batch = profile_batch(rows, ago_s, window_s, frequency_hz)
    with grpc.insecure_channel(grpc_target) as channel:
        acks = list(pb_grpc.IngestStub(channel).Push(iter([batch]), timeout=10))
    assert [a.sequence for a in acks] == [1]


def wide_rows(fanout: int, depth: int, comm: str = "wide") -> list[Row]:
    """A bushy profile (fanout ** depth leaf stacks, distinct weights) to exercise max_nodes."""
    paths: list[list[tuple[str, str]]] = [[]]
    for level in range(depth):
        paths = [p + [(f"f{level}_{i}", "/app/wide")] for p in paths for i in range(fanout)]
    return [(303, comm, {"pod": "wide-0"}, p, len(p), 1 + (n * 7919) % 97) for n, p in enumerate(paths)]
