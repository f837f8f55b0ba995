"""Rows not yet in the database: the flusher's unit of work, queried with the database until committed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleetprof.collector.model.profile import Labels, Stack
from fleetprof.collector.model.rows import BUCKET_S, ProfileRows
from fleetprof.collector.store.stack_definitions import stacks_for, used_ids


@dataclass
class Chunk:
    """Rows not yet in the database, in numpy column parts ready for one bulk insert (the flusher's unit
    of work), with the definitions they use."""

    bucket_s: int = BUCKET_S
    # parts of (bucket, lid, sid, freq, count) columns; bucket and freq are one value per part
    parts: list[tuple[int, np.ndarray, np.ndarray, int, np.ndarray]] = field(default_factory=list)
    # each window's stack table with its content ids: definitions are read only for stacks new to the
    # database (at flush) or asked for by a query, never copied per window
    stack_tables: list[tuple[np.ndarray, Sequence[tuple[int, Stack]]]] = field(default_factory=list)
    labels: dict[int, Labels] = field(default_factory=dict)
    sys_rows: list[tuple] = field(default_factory=list)  # (bucket, lid, syscall, count, timed, timed_ns)
    hist_rows: list[tuple] = field(default_factory=list)  # (bucket, lid, syscall, i, n)
    seen: list[tuple[str, int, float]] = field(default_factory=list)  # (agent id, sequence, window start)
    rows: int = 0
    wal_segment: int = 0  # the newest write-ahead log segment holding this chunk's batches (0: none)
    failed: int = 0  # commits tried and failed: the next try first checks whether one went through

    def add(self, profile: ProfileRows) -> None:
        b = int((profile.start + profile.end) / 2 // self.bucket_s * self.bucket_s)
        # Label definitions seen again just overwrite themselves.
        self.stack_tables.append((profile.stack_table_ids, profile.stacks))
        self.labels.update(profile.label_sets)
        if len(profile.counts):
            lids, sids = profile.label_ids(), profile.stack_ids()
            self.parts.append((b, lids, sids, profile.frequency_hz, profile.counts))
            self.rows += len(profile.counts)
        if profile.syscalls:
            ids = {lset: lid for lid, lset in profile.label_sets}
            for lset, name, agg in profile.syscalls:
                lid = ids[lset]  # a syscall row's label set is in the window's table
                self.sys_rows.append((b, lid, name, agg.count, agg.timed, agg.timed_ns))
                self.hist_rows.extend((b, lid, name, i, v) for i, v in enumerate(agg.hist) if v)

    def frozen(self) -> Chunk:
        """A copy that later adds to this chunk do not change (the parts' arrays are never modified)."""
        return Chunk(
            self.bucket_s,
            list(self.parts),
            list(self.stack_tables),
            dict(self.labels),
            list(self.sys_rows),
            list(self.hist_rows),
            list(self.seen),
            self.rows,
        )

    @property
    def empty(self) -> bool:
        return not (self.rows or self.sys_rows or self.seen)

    def stack_ids(self) -> np.ndarray:
        """The distinct content ids of the stacks in this chunk's windows."""
        return used_ids(self.stack_tables)

    def stacks_for(self, ids: Iterable[int]) -> dict[int, Stack]:
        """The frames of those of `ids` that this chunk's windows define (each read from one window)."""
        return stacks_for(self.stack_tables, ids)

    def sample_columns(self) -> dict[str, np.ndarray]:
        parts = self.parts
        if not parts:
            return _empty_columns()
        sizes = [len(p[4]) for p in parts]
        return {
            "bucket": np.repeat(np.array([p[0] for p in parts], dtype=np.int64), sizes),
            "lid": np.concatenate([p[1] for p in parts]),
            "sid": np.concatenate([p[2] for p in parts]),
            "freq": np.repeat(np.array([p[3] for p in parts], dtype=np.int32), sizes),
            "count": np.concatenate([p[4] for p in parts]),
        }


def _empty_columns() -> dict[str, np.ndarray]:
    return {
        "bucket": np.zeros(0, np.int64),
        "lid": np.zeros(0, np.int64),
        "sid": np.zeros(0, np.int64),
        "freq": np.zeros(0, np.int32),
        "count": np.zeros(0, np.int64),
    }


def merged_columns(chunks: Sequence[Chunk]) -> dict[str, np.ndarray]:
    cols = [c.sample_columns() for c in chunks if c.rows]
    if not cols:
        return _empty_columns()
    return {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
