"""Rows not yet in the database: the flusher's unit of work, queried with the database until committed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from fleetprof.collector.model.id_index import distinct
from fleetprof.collector.model.profile import FrameKey, Labels, Stack
from fleetprof.collector.model.rows import BUCKET_S, ProfileRows, contents_at


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
        return distinct(np.concatenate([np.zeros(0, np.int64)] + [ids for ids, _ in self.stack_tables]))

    def stacks_for(self, ids: Iterable[int]) -> dict[int, Stack]:
        """The frames of those of `ids` that this chunk's windows define (each read from one window)."""
        wanted = np.unique(np.fromiter(ids, dtype=np.int64))
        found = np.zeros(len(wanted), dtype=bool)
        out: dict[int, Stack] = {}
        for table_ids, table in self.stack_tables:
            if found.all():
                break
            at = _first_hits(wanted, found, table_ids)
            out.update(zip(table_ids[at].tolist(), contents_at(table, at), strict=True))
        return out

    def decoded_stacks(self, ids: np.ndarray) -> tuple[StackDefinitions | None, np.ndarray]:
        """The definitions of those of `ids` (sorted, distinct) that this chunk's windows decoded, as
        columns (each stack taken from the first window that decoded it), and the ids left: those no
        window decoded (stacks_for has them). All windows' columns are joined first, so this costs a few
        numpy passes over the chunk, not a few per window."""
        decoded = [d for _, t in self.stack_tables if (d := getattr(t, "decoded", None)) is not None]
        found = np.zeros(len(ids), dtype=bool)
        if not decoded:
            return None, ids
        all_lengths = np.concatenate([d.lengths for d in decoded])
        at = _first_hits(ids, found, np.concatenate([d.ids for d in decoded]))
        lengths = all_lengths[at]
        starts = np.cumsum(all_lengths) - all_lengths
        # the frame rows of the stacks at `at`, one stack after another
        shift = np.repeat(starts[at] - (np.cumsum(lengths) - lengths), lengths)
        rows = np.arange(int(lengths.sum()), dtype=np.int64) + shift
        frame_ids = np.concatenate([d.frame_ids for d in decoded])[rows]
        window_ends = np.cumsum([len(d.frame_ids) for d in decoded])

        def frame_at(row: int) -> FrameKey:  # the window, then the stack, then the frame of a row
            w = int(np.searchsorted(window_ends, row, side="right"))
            d = decoded[w]
            local = row - int(window_ends[w]) + len(d.frame_ids)
            stack_ends = np.cumsum(d.lengths)
            k = int(np.searchsorted(stack_ends, local, side="right"))
            return d.stacks[k][local - int(stack_ends[k]) + int(d.lengths[k])]

        chosen = StackDefinitions(
            np.concatenate([d.ids for d in decoded])[at], lengths, frame_ids, rows, frame_at
        )
        return chosen, ids[~found]

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


class StackDefinitions(NamedTuple):
    """Stacks as columns (stack i: `ids[i]`, `lengths[i]` frames in `frame_ids`, one after another), and
    frame row j's FrameKey as `frame_at(rows[j])`."""

    ids: np.ndarray
    lengths: np.ndarray
    frame_ids: np.ndarray
    rows: np.ndarray
    frame_at: Callable[[int], FrameKey]


def _first_hits(wanted: np.ndarray, found: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Positions in `ids` of the `wanted` (sorted) ids not `found` yet, the first of each; marks them
    found."""
    if not len(wanted) or not len(ids):
        return np.zeros(0, dtype=np.int64)
    pos = np.minimum(np.searchsorted(wanted, ids), len(wanted) - 1)
    hit = np.flatnonzero((wanted[pos] == ids) & ~found[pos])
    _, first = np.unique(pos[hit], return_index=True)  # an id twice in one table: its first entry
    hit = hit[first]
    found[pos[hit]] = True
    return hit


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
