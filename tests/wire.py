"""Reading agent batches in tests: their sample rows, whichever form (Sample messages or SampleColumns)."""

from __future__ import annotations

from typing import NamedTuple

from fleetprof.v1 import ingest_pb2 as pb


class Row(NamedTuple):
    process: int
    tid: int
    stack: int
    count: int
    gpu: int


def sample_rows(batch: pb.Batch) -> list[Row]:
    """Every sample row of the batch: the Sample messages first, then the columns."""
    rows = [Row(s.process, s.tid, s.stack, s.count, s.gpu) for s in batch.samples]
    c = batch.sample_columns
    n = len(c.process)
    tids = list(c.tid) or [0] * n
    gpus = list(c.gpu) or [pb.GPU_STATE_NONE] * n
    rows += [Row(*r) for r in zip(c.process, tids, c.stack, c.count, gpus, strict=True)]
    return rows
