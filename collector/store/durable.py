"""The persistent store: a write-ahead log for acknowledgement, the in-memory hot tier for "now", DuckDB for
the rest, and a flusher thread that moves logged batches into the database, rolls up and expires.

Write path (`write_logged`, under one lock): dedupe by (agent id, sequence) → append the wire bytes to the
WAL → add the rows to the hot tier and to the pending chunk. The batch is then safe: acknowledged. When the
append fails (disk full, I/O error) nothing of the batch is kept and StoreUnavailable tells ingest not to
acknowledge it: the agent keeps it and resends it.

Every `flush_s` the flusher rotates the WAL, queues the pending chunk and commits the queue, oldest first
(rows, definitions and dedupe entries, one transaction per chunk). A chunk whose commit fails stays queued
and queryable and is tried again at the next flush, newer chunks behind it; a WAL segment is deleted only
once every chunk with records in it is committed. A crash between a commit and the deletion replays those
segments at start, and the committed dedupe entries skip them: nothing counts twice.

Queries go to the hot tier when their range lies inside what it holds completely (since this process
started, within its retention), else to DuckDB plus the chunks not yet committed.

The data directory keeps the key of its content ids (`content-id.key`, made at the first start, mode
0600; collector/model/ids.py says why ids are keyed). collector/main.py reads it (content_key) into the
ContentIds that ingest and this store share; the store checks, with the database open (its lock keeps a
second collector out), that they hold the directory's key, so the database's ids, the replayed batches' and
the new ones agree. A directory from before keyed ids gets a key at its next start: its old rows keep their
unkeyed ids, and the same stack or label set stored before and after has two ids, merged by content (a
stack's samples are summed per stack, labels per label value), and gone with the old rows at retention.
Losing the key file (a restore without it) does the same.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb

from fleetprof.collector.model.ids import KEY_BYTES, ContentIds, ContentKeyError
from fleetprof.collector.model.profile import MAX_BATCH_AGE_S, Labels, SyscallAgg
from fleetprof.collector.model.rows import (
    BUCKET_S,
    Grouped,
    ProfileRows,
    Selection,
    TimeSeries,
    selections_by_group,
)
from fleetprof.collector.model.selector import Selector, label_value, names_in, values_in
from fleetprof.collector.store.base import StoreUnavailable
from fleetprof.collector.store.cold.chunk import Chunk
from fleetprof.collector.store.cold.database import Database
from fleetprof.collector.store.cold.maintenance import Maintenance, RollupPolicy
from fleetprof.collector.store.cold.queries import Queries
from fleetprof.collector.store.cold.writer import ChunkWriter
from fleetprof.collector.store.memory import MemoryStore
from fleetprof.collector.store.sequences import SeenSequences
from fleetprof.collector.store.wal import WalError, WriteAheadLog, WriteFn

log = logging.getLogger(__name__)

SEEN_WINDOW = 4096  # sequences remembered per agent (the agent's resend queue holds at most 64)
MAINTAIN_EVERY_S = 600.0
KEY_FILE = "content-id.key"


def content_key(data_dir: Path) -> bytes:
    """The data directory's content-id key, made (random, mode 0600, written whole or not at all) when the
    directory has none. Read before the store opens (collector/main.py), and again by the store with the
    database open: its lock keeps a second collector out."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        tmp = path.with_name(KEY_FILE + ".new")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a leftover .new from a crash may have been made wider
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(data_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        log.info("made %s: the key of this directory's content ids", path)
        return key
    if not 16 <= len(key) <= 64:
        raise ContentKeyError(
            f"{path} holds {len(key)} bytes, not a content-id key (16 to 64 bytes): restore it from a "
            "backup, or delete it to start a new key (stored profiles stay readable; stacks and label sets "
            "stored before get a second id)"
        )
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is open to other users: with it an agent can forge stack ids; chmod 600 it", path)
    return key


class _Faults:
    """Says once in the log what is wrong (per kind: "wal", "flush", "maintenance"), and once that it
    is right again, however many times it fails in between."""

    def __init__(self) -> None:
        self._failing: dict[str, int] = {}

    def failed(self, kind: str, what: str, err: BaseException) -> None:
        n = self._failing.get(kind, 0)
        self._failing[kind] = n + 1
        if n == 0:
            log.error("%s: %s (said once; it is retried and the next success is logged)", what, err)

    def ok(self, kind: str, what: str) -> None:
        n = self._failing.pop(kind, 0)
        if n:
            log.warning("%s again, after %d failures", what, n)


class DurableStore:
    """ProfileStore + DurableBatches over a data directory. `decode` turns a WAL payload back into rows;
    `ids` hold the directory's key (ContentIds(content_key(data_dir))), as the decoder's must."""

    def __init__(
        self,
        data_dir: Path,
        decode: Callable[[bytes], ProfileRows],
        ids: ContentIds,
        retention_s: float = 7 * 86400.0,
        hot_s: float = 3600.0,
        flush_s: float = 10.0,
        flush_rows: int = 2_000_000,
        rollup: RollupPolicy | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
        background: bool = True,
        resend_horizon_s: float = MAX_BATCH_AGE_S,
        max_backlog_rows: int | None = None,
        wal_write: WriteFn = os.write,
        db_fault: Callable[[str], None] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_s
        self._clock = clock
        self._flush_s = flush_s
        self._flush_rows = flush_rows
        # Unflushed rows beyond this refuse new batches (StoreUnavailable): a database that cannot commit
        # while the WAL still can must not grow the collector's memory without bound.
        self._max_backlog_rows = max_backlog_rows or 4 * flush_rows
        self._horizon_s = resend_horizon_s
        self._policy = rollup or RollupPolicy()
        self._lock = threading.Lock()  # the write path: dedupe, WAL, hot tier, pending chunk
        self._commit_lock = threading.RLock()  # a cold query sees a commit and its chunk's removal at once
        self._flush_lock = threading.Lock()  # one flush at a time
        self._faults = _Faults()
        self.counters = {"hot_queries": 0, "cold_queries": 0, "flushes": 0, "flush_errors": 0}
        self._db = Database(self.data_dir / "profiles.duckdb")
        try:
            if content_key(self.data_dir) != ids.key:  # before any id is made: the replay's, the writer's
                raise ContentKeyError(
                    f"{self.data_dir / KEY_FILE} is not the key this store was given: another collector "
                    "made it while this one started? Start again"
                )
        except BaseException:
            self._db.close()
            raise
        self.ids = ids
        self._writer = ChunkWriter(self._db, ids, fault=db_fault)
        self._maintenance = Maintenance(self._db)
        self._queries = Queries(self._db)
        self.hot = MemoryStore(retention_s=min(hot_s, retention_s), bucket_s=BUCKET_S, clock=clock)
        self._seen = SeenSequences(window=SEEN_WINDOW, horizon_s=resend_horizon_s, clock=clock)
        for agent, seq, start in self._db.load_seen():
            self._seen.add(agent, seq, start)
        self._pending = Chunk(BUCKET_S)
        self._flushing: list[Chunk] = []  # queued for commit, oldest first; failed ones stay
        self._wal = WriteAheadLog(self.data_dir / "wal", fsync=fsync, write=wal_write)
        self.replayed = self._replay(decode)
        self._hot_since = clock()
        self._last_maintenance = 0.0
        self._flush_quietly()
        self._maintain_quietly()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-flusher", daemon=True)
        if background:
            self._thread.start()

    # -- write path ----------------------------------------------------------------------------------
    def _replay(self, decode: Callable[[bytes], ProfileRows]) -> int:
        n = 0
        self.replay_refused = 0
        for rec in self._wal.replay():
            if self._seen.seen(rec.source, rec.sequence):
                continue  # committed to the database before the crash
            try:
                rows = decode(rec.payload)
            # ingest's BatchError: left out, for a collector that cannot come up loses every batch after it
            except ValueError as err:
                log.error("a batch in the write-ahead log could not be replayed and is left out: %s", err)
                self.replay_refused += 1
                continue
            self._store(rec.source, rec.sequence, rows)
            n += 1
        if n:
            log.info("replayed %d batches from the write-ahead log", n)
        return n

    def _store(self, source: str | None, sequence: int, profile: ProfileRows) -> None:
        self.hot.write(profile)
        self._pending.add(profile)
        if source is not None:
            self._seen.add(source, sequence, profile.start)
            self._pending.seen.append((source, sequence, profile.start))

    def seen(self, source: str, sequence: int) -> bool:
        with self._lock:
            return self._seen.seen(source, sequence)

    def _backlog_rows(self) -> int:
        # Without the commit lock: a cold query holds it for its whole run, and ingest must not wait on
        # one. Copying the list is atomic, and a queued chunk's row count no longer changes.
        return sum(c.rows for c in list(self._flushing))

    def write_logged(self, source: str, sequence: int, payload: bytes, profile: ProfileRows) -> bool:
        backlog = self._backlog_rows()
        with self._lock:
            if self._seen.seen(source, sequence):
                return False
            if backlog >= self._max_backlog_rows:
                raise StoreUnavailable(
                    f"{backlog} rows wait for the database (it cannot commit, see the collector's log); "
                    "batches are refused until they are flushed"
                )
            try:
                self._wal.append(source, sequence, payload)
            except WalError as err:
                self._faults.failed("wal", "cannot append to the write-ahead log; refusing batches", err)
                raise StoreUnavailable(f"cannot log the batch: {err}") from err
            self._faults.ok("wal", "the write-ahead log takes batches")
            self._store(source, sequence, profile)
            big = self._pending.rows >= self._flush_rows
        if big:
            self._flush_quietly()
        return True

    def write(self, profile: ProfileRows) -> None:
        """Store rows without logging them (tools and benchmarks): durable from the next flush."""
        with self._lock:
            self._store(None, 0, profile)

    def flush(self) -> None:
        """Commit everything written so far, oldest chunk first, deleting the WAL segments each commit
        covers. Raises on the first chunk that fails: it and those after it stay queued and queryable."""
        # Lock order, everywhere: _flush_lock, then _commit_lock, then _lock (a cold query takes the last
        # two in that order: taking them the other way round here deadlocked a query against a flush).
        with self._flush_lock:
            with self._commit_lock, self._lock:
                chunk, self._pending = self._pending, Chunk(BUCKET_S)
                chunk.wal_segment = self._wal.rotate()
                if not chunk.empty:
                    self._flushing.append(chunk)
            for queued in list(self._flushing):
                # The commit and the chunk's removal as one step for cold queries: between the two, a query
                # read the chunk both from the database and from the queue, and counted it twice.
                with self._commit_lock:
                    self._commit(queued)
                    self._flushing.remove(queued)
                self._drop_wal(queued.wal_segment)  # each segment goes as soon as its chunks are in
            if chunk.empty:
                self._drop_wal(chunk.wal_segment)  # every chunk is committed: nothing older is needed
            self.counters["flushes"] += 1

    def _commit(self, chunk: Chunk) -> None:
        try:
            # A commit can fail after it went through (an error reported at its end): inserting the chunk
            # again would count it twice. Its dedupe entries, committed with its rows, tell.
            if not (chunk.failed and self._writer.committed(chunk)):
                self._writer.insert(chunk)
        except Exception as err:
            chunk.failed += 1
            self.counters["flush_errors"] += 1
            self._faults.failed(
                "flush", "cannot commit to the database; unflushed batches stay queryable", err
            )
            if isinstance(err, duckdb.FatalException):  # the connection is unusable until reopened
                self._db.reopen()
            raise
        self._faults.ok("flush", "commits to the database succeed")

    def _drop_wal(self, segment: int) -> None:
        with self._lock:
            self._wal.drop_through(segment)

    def _flush_quietly(self) -> bool:
        """flush(), with a failure left to the fault log (the next flush tries again)."""
        try:
            self.flush()
            return True
        except Exception:
            return False

    def maintain(self) -> None:
        """Roll up, expire, prune dedupe state and forget unreferenced stacks and labels."""
        now = self._clock()
        with self._flush_lock, self._commit_lock:
            self._maintenance.rollup(now, self._policy)
            self._maintenance.expire(now - self.retention_s)
            self._maintenance.prune_seen(now - self._horizon_s, SEEN_WINDOW)
            self._maintenance.gc()
        with self._lock:
            self._seen.sweep()
        self._last_maintenance = now

    def _maintain_quietly(self) -> None:
        try:
            self.maintain()
        except Exception as err:
            self._faults.failed("maintenance", "rollup, expiry or garbage collection failed", err)
        else:
            self._faults.ok("maintenance", "maintenance succeeds")

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            if self._flush_quietly() and self._clock() - self._last_maintenance >= MAINTAIN_EVERY_S:
                self._maintain_quietly()

    # -- queries ---------------------------------------------------------------------------------------
    def _hot_covers(self, start: float, end: float) -> bool:
        lo = start // BUCKET_S * BUCKET_S
        return lo >= self._hot_since and start >= self._clock() - self.hot.retention_s + BUCKET_S

    def _cold(self, fn: Callable[[Sequence[Chunk]], object]) -> object:
        self.counters["cold_queries"] += 1
        with self._commit_lock:
            with self._lock:
                pending = [*self._flushing, self._pending]
                # The live chunk keeps growing: query a frozen copy of it.
                pending[-1] = self._pending.frozen()
            return fn(pending)

    def select(self, selector: Selector, start: float, end: float) -> Selection:
        if self._hot_covers(start, end):
            self.counters["hot_queries"] += 1
            return self.hot.select(selector, start, end)

        def run(pending: Sequence[Chunk]) -> Selection:
            per_sid, freq = self._queries.per_key(selector, start, end, "sid", pending)
            stacks = self._queries.stacks_of(per_sid, pending)
            merged: dict = {}
            for sid, n in per_sid.items():
                st = stacks[sid]
                merged[st] = merged.get(st, 0) + n
            return Selection(merged, freq)

        return self._cold(run)  # type: ignore[return-value]

    def select_groups(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], Selection]:
        if self._hot_covers(start, end):
            self.counters["hot_queries"] += 1
            return self.hot.select_groups(selector, start, end, by)

        def run(pending: Sequence[Chunk]) -> dict[tuple[str, ...], Selection]:
            rows = self._queries.per_label_stack(selector, start, end, pending)
            labels = self._queries.labels_of({r[0] for r in rows}, pending)
            stacks = self._queries.stacks_of({r[1] for r in rows}, pending)
            return selections_by_group(rows, labels, stacks, by)

        return self._cold(run)  # type: ignore[return-value]

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        if self._hot_covers(start, end):
            self.counters["hot_queries"] += 1
            return self.hot.group(selector, start, end, by)

        def run(pending: Sequence[Chunk]) -> Grouped:
            per_lid, freq = self._queries.per_key(selector, start, end, "lid", pending)
            labels = self._queries.labels_of(per_lid, pending)
            totals: dict[tuple[str, ...], int] = {}
            for lid, n in per_lid.items():
                lb = dict(labels.get(lid, ()))
                key = tuple(label_value(lb, name) for name in by)
                totals[key] = totals.get(key, 0) + n
            return Grouped(tuple(by), totals, freq)

        return self._cold(run)  # type: ignore[return-value]

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        if self._hot_covers(start, end):
            self.counters["hot_queries"] += 1
            return self.hot.series(selector, start, end, step_s, by)

        def run(pending: Sequence[Chunk]) -> TimeSeries:
            per, freq = self._queries.per_label_step(selector, start, end, step_s, pending)
            labels = self._queries.labels_of({lid for lid, _ in per}, pending)
            points: dict[tuple[str, ...], dict[float, int]] = {}
            for (lid, t), n in per.items():
                lb = dict(labels.get(lid, ()))
                series = points.setdefault(tuple(label_value(lb, name) for name in by), {})
                series[t] = series.get(t, 0) + n
            return TimeSeries(tuple(by), step_s, points, freq)

        return self._cold(run)  # type: ignore[return-value]

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        if self._hot_covers(start, end):
            self.counters["hot_queries"] += 1
            return self.hot.syscalls(selector, start, end, by)
        return self._cold(lambda pending: self._queries.syscalls(selector, start, end, by, pending))  # type: ignore[return-value]

    def _label_sets(self, start: float | None, end: float | None) -> list[Labels]:
        return self._cold(lambda pending: self._queries.label_sets(start, end, pending))  # type: ignore[return-value]

    def label_names(
        self, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        if start is not None and end is not None and self._hot_covers(start, end):
            return self.hot.label_names(start, end, match)
        return names_in(self._label_sets(start, end), match)

    def label_values(
        self, name: str, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        if start is not None and end is not None and self._hot_covers(start, end):
            return self.hot.label_values(name, start, end, match)
        return values_in(self._label_sets(start, end), name, match)

    def stats(self) -> dict[str, int]:
        rows = self._db.table_rows()
        out = {f"hot_{k}": v for k, v in self.hot.stats().items()}
        out.update({f"rows_{t}": n for t, n in rows.items()})
        with self._lock:
            out["pending_rows"] = self._pending.rows
            wal_bytes = self._wal.size_bytes()
            out["wal_append_errors"] = self._wal.append_errors
            out["dedupe_entries"] = len(self._seen)
        out["backlog_rows"] = self._backlog_rows()
        out["disk_bytes"] = self._db.size_bytes() + wal_bytes
        out["wal_bytes"] = wal_bytes
        disk = os.statvfs(self.data_dir)
        out["data_dir_free_bytes"] = disk.f_bavail * disk.f_frsize
        out.update(self.counters)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if not self._flush_quietly():
            log.error(
                "closing with %d chunks not committed: the write-ahead log keeps them for the next start",
                len(self._flushing),
            )
        with self._lock:
            self._wal.close()
        self._db.close()
