"""Commits chunks to the database: one transaction per chunk with its rows, the definitions they need and its
dedupe entries; nothing is remembered as written unless the transaction commits."""

from __future__ import annotations

from collections.abc import Callable

import duckdb
import nanoarrow as na
import numpy as np

from fleetprof.collector.model.ids import ContentIds, labels_json
from fleetprof.collector.model.rows import BUCKET_S
from fleetprof.collector.store.cold.chunk import Chunk
from fleetprof.collector.store.cold.database import Database, rollback
from fleetprof.collector.store.stack_definitions import joined, new_frames, stack_definitions


class ChunkWriter:
    """The flusher thread's side of the database."""

    def __init__(self, db: Database, ids: ContentIds, fault: Callable[[str], None] | None = None):
        self._db = db
        self._ids = ids  # frame ids: ingest interned these frames moments ago
        # The fault seam: called at each step of a flush ("definitions", "rows", "commit", "committed");
        # tests raise from it to fail a flush there, as a full disk or an I/O error would.
        self._fault = fault or (lambda step: None)

    def insert(self, chunk: Chunk) -> None:
        """All of a chunk in one transaction: its rows, the definitions they need, its dedupe entries.
        On any error the transaction is rolled back and nothing is remembered as written."""
        with self._db.write_lock:
            con = self._db.con
            con.execute("BEGIN")
            try:
                self._fault("definitions")
                added_stacks, added_frames = self._insert_definitions(con, chunk)
                self._fault("rows")
                if chunk.rows:
                    con.register("chunk_samples", chunk.sample_columns())
                    con.execute(
                        f"INSERT INTO samples SELECT {BUCKET_S}, bucket, lid, sid, freq, sum(count) "
                        "FROM chunk_samples GROUP BY bucket, lid, sid, freq"
                    )
                    con.unregister("chunk_samples")
                if chunk.sys_rows:
                    con.executemany(
                        f"INSERT INTO syscalls VALUES ({BUCKET_S}, ?, ?, ?, ?, ?, ?)", chunk.sys_rows
                    )
                if chunk.hist_rows:
                    con.executemany(
                        f"INSERT INTO syscall_hist VALUES ({BUCKET_S}, ?, ?, ?, ?, ?)", chunk.hist_rows
                    )
                if chunk.seen:
                    con.execute(
                        "INSERT INTO seen SELECT unnest($1::VARCHAR[]), unnest($2::BIGINT[]), "
                        "unnest($3::DOUBLE[])",
                        [
                            [a for a, _, _ in chunk.seen],
                            [q for _, q, _ in chunk.seen],
                            [t for _, _, t in chunk.seen],
                        ],
                    )
                self._fault("commit")
                con.execute("COMMIT")
            except BaseException:
                rollback(con)
                raise
            known = self._db.known
            known.stacks.add(added_stacks, np.zeros(len(added_stacks), dtype=np.int64))
            known.frames.add(added_frames, np.zeros(len(added_frames), dtype=np.int64))
            known.labels.update(chunk.labels)
        self._fault("committed")

    def committed(self, chunk: Chunk) -> bool:
        """Whether a chunk whose commit reported an error is in the database all the same (its dedupe
        entries are, then: they commit with its rows). A chunk without entries is never found."""
        if not chunk.seen:
            return False
        (n,) = (
            self._db.cursor()
            .execute(
                "SELECT count(*) FROM seen JOIN (SELECT unnest($1::VARCHAR[]) AS a, "
                "unnest($2::BIGINT[]) AS q) c ON seen.agent_id = c.a AND seen.sequence = c.q",
                [[a for a, _, _ in chunk.seen], [q for _, q, _ in chunk.seen]],
            )
            .fetchone()
        )
        return n >= len(chunk.seen)

    def _insert_definitions(
        self, con: duckdb.DuckDBPyConnection, chunk: Chunk
    ) -> tuple[np.ndarray, np.ndarray]:
        """Insert the stack, frame and label definitions the database lacks; returns the new stack and
        frame ids (remembered as known only once the transaction commits)."""
        ids = chunk.stack_ids()
        new_ids = ids[self._db.known.stacks.get(ids) < 0]
        added_frames = np.zeros(0, dtype=np.int64)
        if len(new_ids):
            added_frames = self._insert_stacks(con, chunk, new_ids)
        new_labels = {lid: lb for lid, lb in chunk.labels.items() if lid not in self._db.known.labels}
        if new_labels:
            con.execute(
                "INSERT INTO label_sets SELECT * FROM (SELECT unnest($1::BIGINT[]) AS id, "
                "unnest($2::VARCHAR[])) n WHERE n.id NOT IN (SELECT id FROM label_sets)",
                [list(new_labels), [labels_json(lb) for lb in new_labels.values()]],
            )
        return new_ids, added_frames

    def _insert_stacks(self, con: duckdb.DuckDBPyConnection, chunk: Chunk, new_ids: np.ndarray) -> np.ndarray:
        """Stacks (and frames) as columns, the frame lists built by DuckDB. The stacks ingest decoded come
        with their frames' ids (stack_definitions.py); only the others (stacks ingest knew before this
        database did: after a restart, or a dropped duplicate's) have their frames flattened and looked up
        here. A frame's definition is read only for frames new to the database."""
        parts = stack_definitions(chunk.stack_tables, new_ids, self._ids)
        sids, lengths, fids = joined(parts)
        new_fids, frames = new_frames(parts, self._db.known.frames)
        if len(new_fids):
            con.execute(
                "INSERT INTO frames SELECT * FROM (SELECT unnest($1::BIGINT[]) AS id, "
                "unnest($2::VARCHAR[]), unnest($3::VARCHAR[]), unnest($4::BOOLEAN[])) n "
                "WHERE n.id NOT IN (SELECT id FROM frames)",
                [
                    new_fids.tolist(),
                    [f.function for f in frames],
                    [f.module for f in frames],
                    [bool(f.kernel) for f in frames],
                ],
            )
        con.register("new_stacks", _stack_lists(sids, lengths, fids))
        con.execute(
            "INSERT INTO stacks SELECT sid, frames FROM new_stacks WHERE sid NOT IN (SELECT id FROM stacks)"
        )
        con.unregister("new_stacks")
        return new_fids


_FRAME_LISTS = na.large_list(na.int64())
_STACK_LISTS = na.struct({"sid": na.int64(), "frames": _FRAME_LISTS})


def _stack_lists(sids: np.ndarray, lengths: np.ndarray, fids: np.ndarray) -> na.ArrayStream:
    """Stacks (ids `sids`, `lengths[i]` frames each in `fids`, one after another) as an Arrow table of
    (sid, frames list) that DuckDB scans in place: the lists are the frame column and its offsets, where
    building them in SQL (`list(fid ORDER BY pos)` over one row per frame) took 3x the CPU (bench/README.md,
    "Durable at 5% new stacks", fifth pass)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    frames = na.c_array_from_buffers(
        _FRAME_LISTS,
        len(lengths),
        [None, offsets],
        children=[na.c_array(np.ascontiguousarray(fids, dtype=np.int64), na.int64())],
    )
    table = na.c_array_from_buffers(
        _STACK_LISTS,
        len(sids),
        [None],
        children=[na.c_array(np.ascontiguousarray(sids, dtype=np.int64), na.int64()), frames],
    )
    return na.ArrayStream(table)
