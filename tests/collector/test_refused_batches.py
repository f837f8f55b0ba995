"""A refused batch leaves nothing behind: every table ingest keeps across batches (stacks, frames, frame
strings, wire ids, processes and label sets by content, the per-node label quota, the frames interned under
the content-id key) has the same size after a refusal as before it, whatever part of the batch was wrong."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.validate import BatchError, IngestLimits
from fleetprof.collector.model.ids import ContentIds
from tests.conftest import RunningCollector, http_get, start_collector
from tests.support.wire import BatchBuilder, push

AGENT = "a11ce0000000000000000000000000aa"
NAME_CHARS = 65_000  # just under the 65,535 a frame name keeps: nothing of it is cut


def attack_batch(seq: int, node: str = "node-a", stacks: int = 16) -> pb.Batch:
    """The attack of 2026-11-27: `stacks` new stacks whose names are ~65 KB each (unique per batch), then
    a bad sample row. The stack cache learned the stacks before it read the rows: 80 such batches took the
    collector's RSS from 179 to 247 MiB."""
    b = BatchBuilder(node, AGENT, seq)
    proc = b.process(42, "worker", {"pod": "p-1"})
    for i in range(stacks):
        b.sample(proc, b.stack([("main", "app"), (f"{seq:06d}-{i:02d}-" + "x" * NAME_CHARS, "app")]), 1)
    batch = b.build()
    batch.sample_columns.count[-1] = 0  # the bad row, last
    return batch


def good_batch(seq: int, node: str = "node-a") -> pb.Batch:
    b = BatchBuilder(node, AGENT, seq)
    b.sample(b.process(42, "worker", {"pod": "p-1"}), b.stack([("main", "app"), ("work", "app")]), 3)
    return b.build()


def _new_stacks_then(spoil: Callable[[pb.Batch, BatchBuilder], None]) -> Callable[[int], pb.Batch]:
    """A batch with new stacks and new processes, spoiled by `spoil` in a part read after them."""

    def make(seq: int) -> pb.Batch:
        b = BatchBuilder("node-a", AGENT, seq)
        procs = [b.process(1000 + seq * 10 + k, f"w{k}", {"pod": f"p-{seq}-{k}"}) for k in range(3)]
        for k, p in enumerate(procs):
            b.sample(p, b.stack([("main", "app"), (f"new-{seq}-{k}", "app")]), 2)
        spoil(b.batch, b)
        return b.build()

    return make


def _bad_offcpu(batch: pb.Batch, b: BatchBuilder) -> None:
    b.offcpu(0, 0, 1_000)
    b.offcpu(0, 7, 1_000)  # no stack 7


def _bad_syscall(batch: pb.Batch, b: BatchBuilder) -> None:
    batch.syscalls.append(pb.SyscallStats(process=0, syscall=b.string("read"), count=1, timed=2))


def _bad_gpu(batch: pb.Batch, b: BatchBuilder) -> None:
    batch.gpu_processes.append(pb.GpuProcessUsage(process=0, device=3))  # there is no device


def _bad_label_last(batch: pb.Batch, b: BatchBuilder) -> None:
    b.process(77, "late", {"node": "victim"})  # a derived label, on the last process


def _too_many_labels(batch: pb.Batch, b: BatchBuilder) -> None:
    b.process(78, "late", {f"l{i}": "v" for i in range(65)})


def _long_comm(batch: pb.Batch, b: BatchBuilder) -> None:
    b.process(79, "c" * 2000)


SPOILED = {
    "sample row": attack_batch,
    "off-CPU row": _new_stacks_then(_bad_offcpu),
    "syscall row": _new_stacks_then(_bad_syscall),
    "GPU row": _new_stacks_then(_bad_gpu),
    "derived label on the last process": _new_stacks_then(_bad_label_last),
    "too many labels": _new_stacks_then(_too_many_labels),
    "2,000-byte comm": _new_stacks_then(_long_comm),
}


@pytest.mark.parametrize("spoiled", list(SPOILED), ids=list(SPOILED))
def test_a_refused_batch_changes_no_table(spoiled: str) -> None:
    decoder = Decoder(ContentIds())
    limits = IngestLimits()
    decoder.decode(good_batch(1), limits)  # the agent is known: its tables exist
    before = decoder.sizes()
    for seq in range(2, 6):
        with pytest.raises(BatchError):
            decoder.decode(SPOILED[spoiled](seq), limits)
    assert decoder.sizes() == before
    # A good batch afterwards is decoded and learned as usual.
    rows = decoder.decode(_new_stacks_then(lambda *_: None)(9), limits)
    assert rows.total == 6 and decoder.sizes()["stacks"] == before["stacks"] + 3


def test_a_batch_over_the_label_quota_changes_no_table() -> None:
    limits = IngestLimits(max_series_per_node=4)
    decoder = Decoder(ContentIds())
    decoder.decode(good_batch(1), limits)
    before = decoder.sizes()
    with pytest.raises(BatchError, match="would have 5 label sets"):
        decoder.decode(_new_stacks_then(lambda b, bb: bb.process(90, "x"))(2), limits)  # 1 + 4 new
    assert decoder.sizes() == before


def test_eighty_attack_batches_pin_no_memory() -> None:
    """The attack's numbers: 80 refused batches of 16 stacks with ~65 KB names (83 MB of names) leave the
    tables as they were and under 1 MiB of traced memory behind (before: every name kept)."""
    decoder = Decoder(ContentIds())
    limits = IngestLimits()
    decoder.decode(good_batch(1), limits)
    before = decoder.sizes()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for seq in range(2, 82):
            batch = attack_batch(seq)
            with pytest.raises(BatchError, match="has count 0"):
                decoder.decode(batch, limits)
            del batch
        kept = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert decoder.sizes() == before
    assert kept < 1 << 20, f"{kept} bytes kept"


_ENTRY = re.compile(r'^fleetprof_ingest_cache_entries\{table="(\w+)"\} (\S+)$', re.M)


def cache_entries(col: RunningCollector) -> dict[str, float]:
    return {t: float(v) for t, v in _ENTRY.findall(http_get(f"{col.url}/metrics").decode())}


@pytest.fixture(params=["memory", "data-dir"])
def any_collector(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningCollector]:
    overrides = {"data_dir": str(tmp_path / "data")} if request.param == "data-dir" else {}
    col = start_collector(**overrides)
    yield RunningCollector(col)
    col.stop()


def test_refused_batches_over_grpc_leave_the_collectors_tables_as_they_were(
    any_collector: RunningCollector,
) -> None:
    """Through a real collector (in memory, and with --data-dir), read from its own metrics."""
    col = any_collector
    assert push(col.grpc_target, [good_batch(1)]) == [1]
    before = cache_entries(col)
    assert before["stacks"] == 1 and before["frames"] == 2
    for seq in range(2, 12):
        with pytest.raises(grpc.RpcError) as info:
            push(col.grpc_target, [attack_batch(seq)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert cache_entries(col) == before
    assert col.collector.ingest.stats.rejected == {"bad_count": 10}
    assert col.json("/api/v1/top", since="1h")["total"] == 3
