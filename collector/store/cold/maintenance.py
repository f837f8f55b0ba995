"""Keeps the database in shape: rollup to coarser buckets, retention, dedupe state past its horizon, and
definitions no row refers to any more."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof.collector.model.rows import BUCKET_S
from fleetprof.collector.store.cold.database import Database, KnownIds, rollback


@dataclass(frozen=True)
class RollupPolicy:
    """How long each resolution is kept before it is rolled into the next (the last one until retention)."""

    raw_s: float = 6 * 3600.0  # 10 s buckets
    minute_s: float = 3 * 86400.0  # 1 min buckets; 10 min buckets after that


class Maintenance:
    """Run from the flusher thread, between flushes."""

    def __init__(self, db: Database):
        self._db = db

    def rollup(self, now: float, policy: RollupPolicy) -> None:
        """10 s rows older than policy.raw_s become 1 min rows; 1 min rows older than minute_s, 10 min."""
        for src, dst, age in ((BUCKET_S, 60, policy.raw_s), (60, 600, policy.minute_s)):
            cut = int((now - age) // dst * dst)  # whole destination buckets only
            with self._db.write_lock:
                con = self._db.con
                con.execute("BEGIN")
                try:
                    for table, keys, sums in (
                        ("samples", "lid, sid, freq", "sum(count)"),
                        ("syscalls", "lid, syscall", "sum(count), sum(timed), sum(timed_ns)"),
                        ("syscall_hist", "lid, syscall, i", "sum(n)"),
                    ):
                        con.execute(
                            f"INSERT INTO {table} SELECT {dst}, bucket - bucket % {dst} AS b, {keys}, {sums} "
                            f"FROM {table} WHERE res = {src} AND bucket < $1 GROUP BY b, {keys}",
                            [cut],
                        )
                        con.execute(f"DELETE FROM {table} WHERE res = {src} AND bucket < $1", [cut])
                    con.execute("COMMIT")
                except BaseException:
                    rollback(con)
                    raise

    def expire(self, horizon: float) -> None:
        """Delete every bucket that ended before `horizon`."""
        with self._db.write_lock:
            for table in ("samples", "syscalls", "syscall_hist"):
                self._db.con.execute(f"DELETE FROM {table} WHERE bucket + res <= $1", [horizon])

    def prune_seen(self, horizon: float, keep_per_agent: int) -> None:
        """Drop dedupe entries of batches whose window started before `horizon` (a resend that old is
        rejected as stale) and, per agent, all but the newest `keep_per_agent` sequences."""
        with self._db.write_lock:
            self._db.con.execute("DELETE FROM seen WHERE coalesce(start, 0) < $1", [horizon])
            self._db.con.execute(
                "DELETE FROM seen USING (SELECT agent_id, max(sequence) AS top FROM seen "
                "GROUP BY agent_id) m "
                "WHERE seen.agent_id = m.agent_id AND seen.sequence < m.top - $1",
                [keep_per_agent],
            )

    def gc(self) -> None:
        """Forget stacks, frames and label sets that no retained row refers to (pids and stacks churn)."""
        with self._db.write_lock:
            con = self._db.con
            con.execute("BEGIN")
            try:
                con.execute("DELETE FROM stacks WHERE id NOT IN (SELECT DISTINCT sid FROM samples)")
                con.execute(
                    "DELETE FROM label_sets WHERE id NOT IN (SELECT DISTINCT lid FROM samples UNION "
                    "SELECT DISTINCT lid FROM syscalls)"
                )
                con.execute("DELETE FROM frames WHERE id NOT IN (SELECT DISTINCT unnest(frames) FROM stacks)")
                con.execute("COMMIT")
            except BaseException:
                rollback(con)
                raise
            self._db.known = KnownIds()
