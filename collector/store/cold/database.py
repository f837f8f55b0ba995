"""The cold tier's database: one DuckDB file, its schema, its connection (reopened after a fatal I/O error)
and what is known to be in it.


Tables (ids are the content ids of collector/model/ids.py under the data directory's key, so nothing needs
an id allocator; rows from before keyed ids keep unkeyed ones, see collector/store/durable.py):

- `frames(id, function, module, kernel)`, `stacks(id, frames BIGINT[])`, `label_sets(id, labels JSON)`:
  every distinct frame, stack and label set once under each key's id (one id, but for rows from before
  keyed ids or from a lost key file).
- `samples(res, bucket, lid, sid, freq, count)`: samples per (label set, stack) in a bucket of `res`
  seconds starting at `bucket`. Rollup moves rows from res 10 to 60 and from 60 to 600, so the tiers never
  overlap in time and a query sums all of them.
- `syscalls(res, bucket, lid, syscall, count, timed, timed_ns)` and `syscall_hist(res, bucket, lid,
  syscall, i, n)` (the non-zero log2 latency buckets): the same for syscall rows.
- `seen(agent_id, sequence, start)`: the deduplication state with each batch's window start (unix
  seconds; NULL for rows written before it was kept), committed in the same transaction as the rows.

One writer (the durable store's flusher thread) holds the main connection; each query uses its own cursor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from fleetprof.collector.model.id_index import IdIndex

SCHEMA = """
CREATE TABLE IF NOT EXISTS frames (id BIGINT, function VARCHAR, module VARCHAR, kernel BOOLEAN);
CREATE TABLE IF NOT EXISTS stacks (id BIGINT, frames BIGINT[]);
CREATE TABLE IF NOT EXISTS label_sets (id BIGINT, labels VARCHAR);
CREATE TABLE IF NOT EXISTS samples (res INTEGER, bucket BIGINT, lid BIGINT, sid BIGINT, freq INTEGER,
                                    count BIGINT);
CREATE TABLE IF NOT EXISTS syscalls (res INTEGER, bucket BIGINT, lid BIGINT, syscall VARCHAR, count BIGINT,
                                     timed BIGINT, timed_ns BIGINT);
CREATE TABLE IF NOT EXISTS syscall_hist (res INTEGER, bucket BIGINT, lid BIGINT, syscall VARCHAR,
                                         i SMALLINT, n BIGINT);
CREATE TABLE IF NOT EXISTS seen (agent_id VARCHAR, sequence BIGINT);
ALTER TABLE seen ADD COLUMN IF NOT EXISTS start DOUBLE;
"""
TABLES = ("frames", "stacks", "label_sets", "samples", "syscalls", "syscall_hist", "seen")


@dataclass
class KnownIds:
    """Ids known to be committed, so a flush inserts only new definitions. Only ever a subset of what is in
    the database: emptied by garbage collection and when the connection is reopened."""

    stacks: IdIndex = field(default_factory=IdIndex)  # value 0: only membership counts
    labels: set[int] = field(default_factory=set)
    frames: IdIndex = field(default_factory=IdIndex)  # value 0, as stacks


class Database:
    """The connection, shared by the writer, maintenance (both under `write_lock`) and queries (a cursor
    each)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.write_lock = threading.Lock()
        self._connect()

    def _connect(self) -> None:
        self.con = duckdb.connect(str(self.path))
        self.con.execute(SCHEMA)
        self.known = KnownIds()

    def reopen(self) -> None:
        """A new connection, after an error that may have left the old one unusable (DuckDB invalidates a
        database after some I/O errors until it is opened again). What a failed transaction left is
        unknown, so the known ids start empty."""
        with self.write_lock:
            try:
                self.con.close()
            except duckdb.Error:
                pass
            self._connect()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self.con.cursor()

    def load_seen(self) -> list[tuple[str, int, float]]:
        rows = self.cursor().execute("SELECT agent_id, sequence, coalesce(start, 0) FROM seen").fetchall()
        return [tuple(r) for r in rows]

    def table_rows(self) -> dict[str, int]:
        cur = self.cursor()
        return {t: cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}

    def size_bytes(self) -> int:
        wal = self.path.with_name(self.path.name + ".wal")
        return sum(p.stat().st_size for p in (self.path, wal) if p.exists())

    def close(self) -> None:
        with self.write_lock:
            self.con.execute("CHECKPOINT")
            self.con.close()


def rollback(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back if a transaction is still open: DuckDB ends it itself when COMMIT fails (a full disk),
    and a second error here would hide the first."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass
