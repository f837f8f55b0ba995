"""The definitions of the stacks a store lacks, as columns, read from the stack tables of the windows it
writes: the durable store's flush (cold/writer.py) and the ClickHouse store's group insert
(clickhouse/writer.py) both need every new stack's frame ids in order and each new frame's names once.

Ingest already computed the frame ids of the stacks it decoded (StackTable.decoded), so those come as
columns with no Python call per frame; only stacks ingest knew before the store did (after a restart, a
new day's partition, a dropped duplicate's) have their frames flattened and looked up. A frame's names are
read only for frames new to the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from fleetprof.collector.model.id_index import IdIndex, distinct
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey, Stack
from fleetprof.collector.model.rows import contents_at

# a window's stack table with its content ids (ProfileRows.stack_table_ids, ProfileRows.stacks)
Tables = Sequence[tuple[np.ndarray, Sequence[tuple[int, Stack]]]]


class StackDefinitions(NamedTuple):
    """Stacks as columns (stack i: `ids[i]`, `lengths[i]` frames in `frame_ids`, one after another), and
    the FrameKeys of frame rows j as `frames_at(rows[j])` (rows: an int64 column)."""

    ids: np.ndarray
    lengths: np.ndarray
    frame_ids: np.ndarray
    rows: np.ndarray
    frames_at: Callable[[np.ndarray], list[FrameKey]]


def stack_definitions(tables: Tables, ids: np.ndarray, content_ids: ContentIds) -> list[StackDefinitions]:
    """The definitions of `ids` (sorted, distinct, each in some table): those ingest decoded as its
    columns, then the others flattened (at most two parts)."""
    decoded, rest = decoded_stacks(tables, ids)
    parts = [] if decoded is None else [decoded]
    if len(rest):
        parts.append(flattened(stacks_for(tables, rest.tolist()), content_ids))
    return parts


def used_ids(tables: Tables) -> np.ndarray:
    """The distinct content ids (sorted) of the stacks in `tables`."""
    return distinct(np.concatenate([np.zeros(0, np.int64)] + [ids for ids, _ in tables]))


def joined(parts: Sequence[StackDefinitions]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stacks of `parts` as one set of columns: (ids, lengths, frame_ids)."""
    return (
        np.concatenate([p.ids for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.frame_ids for p in parts]),
    )


def stacks_for(tables: Tables, ids: Iterable[int]) -> dict[int, Stack]:
    """The frames of those of `ids` that `tables` define (each read from the first table that does)."""
    wanted = np.unique(np.fromiter(ids, dtype=np.int64))
    found = np.zeros(len(wanted), dtype=bool)
    out: dict[int, Stack] = {}
    for table_ids, table in tables:
        if found.all():
            break
        at = _first_hits(wanted, found, table_ids)
        out.update(zip(table_ids[at].tolist(), contents_at(table, at), strict=True))
    return out


def decoded_stacks(tables: Tables, ids: np.ndarray) -> tuple[StackDefinitions | None, np.ndarray]:
    """The definitions of those of `ids` (sorted, distinct) that the windows of `tables` decoded, as
    columns (each stack taken from the first window that decoded it), and the ids left: those no window
    decoded (stacks_for has them). All windows' columns are joined first, so this costs a few numpy passes
    over them, not a few per window."""
    decoded = [d for _, t in tables if (d := getattr(t, "decoded", None)) is not None]
    found = np.zeros(len(ids), dtype=bool)
    if not decoded:
        return None, ids
    all_ids = np.concatenate([d.ids for d in decoded])
    all_lengths = np.concatenate([d.lengths for d in decoded])
    at = _first_hits(ids, found, all_ids)
    lengths = all_lengths[at]
    starts = np.cumsum(all_lengths) - all_lengths
    # the frame rows of the stacks at `at`, one stack after another
    shift = np.repeat(starts[at] - (np.cumsum(lengths) - lengths), lengths)
    rows = np.arange(int(lengths.sum()), dtype=np.int64) + shift
    frame_ids = np.concatenate([d.frame_ids for d in decoded])[rows]

    def frames_at(at_rows: np.ndarray) -> list[FrameKey]:
        """The frames at rows of the windows' joined frame columns: each row's stack among all the
        windows' stacks, then its place in that stack."""
        stack_ends = np.cumsum(all_lengths)
        k = np.searchsorted(stack_ends, at_rows, side="right")
        place = at_rows - (stack_ends[k] - all_lengths[k])
        stacks = list(chain.from_iterable(d.stacks for d in decoded))
        return [stacks[i][j] for i, j in zip(k.tolist(), place.tolist(), strict=True)]

    return StackDefinitions(all_ids[at], lengths, frame_ids, rows, frames_at), ids[~found]


def flattened(stacks: dict[int, Stack], content_ids: ContentIds) -> StackDefinitions:
    """Stacks given by their frames as columns: every frame of every stack in one flat column, each
    distinct frame's id looked up once. Frames are told apart by object identity first (ingest shares
    one FrameKey per frame), a numpy pass instead of a hash per frame."""
    lengths = np.fromiter(map(len, stacks.values()), dtype=np.int64, count=len(stacks))
    flat = list(chain.from_iterable(stacks.values()))
    addresses = np.fromiter(map(id, flat), dtype=np.int64, count=len(flat))
    _, first, which = np.unique(addresses, return_index=True, return_inverse=True)
    fids = np.array(content_ids.frame_ids([flat[i] for i in first.tolist()]), dtype=np.int64)
    return StackDefinitions(
        np.fromiter(stacks.keys(), dtype=np.int64, count=len(stacks)),
        lengths,
        fids[which.reshape(-1)],
        np.arange(len(flat), dtype=np.int64),
        lambda rows: list(map(flat.__getitem__, rows.tolist())),
    )


def new_frames(parts: Sequence[StackDefinitions], known: IdIndex) -> tuple[np.ndarray, list[FrameKey]]:
    """The distinct ids of the frames of `parts` not in `known`, and each one's FrameKey, read from its
    first row: found among the rows of new frames only. Columnar throughout: a group of ClickHouse
    inserts has ~15,000 frame rows of ~12,000 distinct frames, a flush's chunk ~600,000 rows (a Python set
    of them cost 1-4 ms a group)."""
    fids = np.concatenate([np.zeros(0, np.int64)] + [p.frame_ids for p in parts])
    used = distinct(fids)
    new_fids = used[known.get(used) < 0]
    if not len(new_fids):
        return new_fids, []
    pos = np.minimum(np.searchsorted(new_fids, fids), len(new_fids) - 1)
    hit = np.flatnonzero(new_fids[pos] == fids)
    _, first = np.unique(pos[hit], return_index=True)
    at = hit[first]
    sizes = np.array([len(p.frame_ids) for p in parts], dtype=np.int64)
    which = np.searchsorted(np.cumsum(sizes), at, side="right")
    local = at - (np.cumsum(sizes) - sizes)[which]
    ids, frames = [], []
    for w, part in enumerate(parts):
        mine = which == w
        ids.append(fids[at[mine]])
        frames.extend(part.frames_at(part.rows[local[mine]]))
    return np.concatenate(ids), frames


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
