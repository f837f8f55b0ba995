"""The cold tier: profiles in an embedded DuckDB file, columnar, rolled up 10 s → 1 min → 10 min.

Tables (ids are the stable content ids of collector/store/ids.py, so nothing needs an id allocator):

- `frames(id, function, module, kernel)`, `stacks(id, frames BIGINT[])`, `label_sets(id, labels JSON)`:
  every distinct frame, stack and label set once.
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

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import duckdb
import numpy as np

from collector.model.id_index import IdIndex
from collector.model.ids import frame_ids, labels_id, labels_json
from collector.model.profile import FrameKey, Labels, Stack, SyscallAgg
from collector.model.rows import ProfileRows
from collector.model.selector import Selector

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
_CACHE_LIMIT = 1_000_000


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back if a transaction is still open: DuckDB ends it itself when COMMIT fails (a full disk),
    and a second error here would hide the first."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


def _known(ids: Iterable[int], cache: dict, pending: Sequence[dict]) -> tuple[dict, list[int]]:
    """What the cache or a pending (not yet flushed) chunk already holds for `ids`, and the ids to query."""
    out, missing = {}, []
    for i in ids:
        value = cache.get(i)
        if value is None:
            value = next((v for v in (p.get(i) for p in pending) if v is not None), None)
        if value is None:
            missing.append(i)
        else:
            out[i] = value
    return out, missing


@dataclass(frozen=True)
class RollupPolicy:
    """How long each resolution is kept before it is rolled into the next (the last one until retention)."""

    raw_s: float = 6 * 3600.0  # 10 s buckets
    minute_s: float = 3 * 86400.0  # 1 min buckets; 10 min buckets after that


@dataclass
class Chunk:
    """Rows not yet in the database, in numpy column parts ready for one bulk insert (the flusher's unit
    of work), with the definitions they use."""

    bucket_s: int = 10
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
                lid = ids.get(lset)
                if lid is None:
                    lid = ids[lset] = labels_id(lset)
                    self.labels[lid] = lset
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
        return np.unique(np.concatenate([np.zeros(0, np.int64)] + [ids for ids, _ in self.stack_tables]))

    def stacks_for(self, ids: Iterable[int]) -> dict[int, Stack]:
        """The frames of those of `ids` that this chunk's windows define (each read from one window)."""
        wanted = np.unique(np.fromiter(ids, dtype=np.int64))
        found = np.zeros(len(wanted), dtype=bool)
        out: dict[int, Stack] = {}
        for table_ids, table in self.stack_tables:
            if found.all():
                break
            pos = np.minimum(np.searchsorted(wanted, table_ids), max(len(wanted) - 1, 0))
            hit = np.flatnonzero((wanted[pos] == table_ids) & ~found[pos]) if len(wanted) else pos[:0]
            for i in hit.tolist():
                cid, stack = table[i]
                out[cid] = stack
            found[pos[hit]] = True
        return out

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


def _merge_columns(chunks: Sequence[Chunk]) -> dict[str, np.ndarray]:
    cols = [c.sample_columns() for c in chunks if c.rows]
    if not cols:
        return _empty_columns()
    return {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}


class DuckStore:
    """The database half of the durable store: bulk inserts of chunks, queries, rollup and retention."""

    def __init__(self, path: Path, fault: Callable[[str], None] | None = None):
        self.path = Path(path)
        # The fault seam: called at each step of a flush ("definitions", "rows", "commit", "committed");
        # tests raise from it to fail a flush there, as a full disk or an I/O error would.
        self._fault = fault or (lambda step: None)
        self._write_lock = threading.Lock()
        self._connect()

    def _connect(self) -> None:
        self._con = duckdb.connect(str(self.path))
        self._con.execute(SCHEMA)
        # Ids known to be in the database, so a flush sends only new definitions. Cleared by gc().
        self._known_stacks = IdIndex()  # value 0: only membership counts
        self._known_labels: set[int] = set()
        self._known_frames: set[int] = set()
        self._stack_cache: dict[int, Stack] = {}
        self._label_cache: dict[int, Labels] = {}

    def reopen(self) -> None:
        """A new connection, after an error that may have left the old one unusable (DuckDB invalidates a
        database after some I/O errors until it is opened again). Caches start empty: what a failed
        transaction left is unknown."""
        with self._write_lock:
            try:
                self._con.close()
            except duckdb.Error:
                pass
            self._connect()

    # -- writing (the flusher thread only) --------------------------------------------------------------
    def insert(self, chunk: Chunk) -> None:
        """All of a chunk in one transaction: its rows, the definitions they need, its dedupe entries.
        On any error the transaction is rolled back and nothing is remembered as written."""
        with self._write_lock:
            con = self._con
            con.execute("BEGIN")
            try:
                self._fault("definitions")
                new_stacks, new_frames = self._insert_definitions(con, chunk)
                self._fault("rows")
                if chunk.rows:
                    con.register("chunk_samples", chunk.sample_columns())
                    con.execute(
                        "INSERT INTO samples SELECT 10, bucket, lid, sid, freq, sum(count) "
                        "FROM chunk_samples GROUP BY bucket, lid, sid, freq"
                    )
                    con.unregister("chunk_samples")
                if chunk.sys_rows:
                    con.executemany("INSERT INTO syscalls VALUES (10, ?, ?, ?, ?, ?, ?)", chunk.sys_rows)
                if chunk.hist_rows:
                    con.executemany("INSERT INTO syscall_hist VALUES (10, ?, ?, ?, ?, ?)", chunk.hist_rows)
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
                _rollback(con)
                raise
            self._known_stacks.add(new_stacks, np.zeros(len(new_stacks), dtype=np.int64))
            self._known_frames.update(new_frames)
            self._known_labels.update(chunk.labels)
        self._fault("committed")

    def committed(self, chunk: Chunk) -> bool:
        """Whether a chunk whose commit reported an error is in the database all the same (its dedupe
        entries are, then: they commit with its rows). A chunk without entries is never found."""
        if not chunk.seen:
            return False
        (n,) = (
            self._cursor()
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
    ) -> tuple[np.ndarray, list[int]]:
        """Insert the stack, frame and label definitions the database lacks; returns the new stack and
        frame ids (remembered as known only once the transaction commits)."""
        ids = chunk.stack_ids()
        new_ids = ids[self._known_stacks.get(ids) < 0]
        new_frames: list[int] = []
        if len(new_ids):
            new_frames = self._insert_stacks(con, chunk.stacks_for(new_ids.tolist()))
        new_labels = {lid: lb for lid, lb in chunk.labels.items() if lid not in self._known_labels}
        if new_labels:
            con.execute(
                "INSERT INTO label_sets SELECT * FROM (SELECT unnest($1::BIGINT[]) AS id, "
                "unnest($2::VARCHAR[])) n WHERE n.id NOT IN (SELECT id FROM label_sets)",
                [list(new_labels), [labels_json(lb) for lb in new_labels.values()]],
            )
        return new_ids, new_frames

    def _insert_stacks(self, con: duckdb.DuckDBPyConnection, stacks: dict[int, Stack]) -> list[int]:
        """Stacks (and frames) as columns: every frame of every stack in one flat column, each distinct
        frame's id looked up once, and the frame lists built by DuckDB. Frames are told apart by object
        identity first (ingest shares one FrameKey per frame), a numpy pass instead of a hash per frame."""
        lengths = np.fromiter(map(len, stacks.values()), dtype=np.int64, count=len(stacks))
        flat = list(chain.from_iterable(stacks.values()))
        addresses = np.fromiter(map(id, flat), dtype=np.int64, count=len(flat))
        _, first, which = np.unique(addresses, return_index=True, return_inverse=True)
        frames = [flat[i] for i in first.tolist()]
        fids = np.array(frame_ids(frames), dtype=np.int64)
        known = self._known_frames
        new = [i for i, fid in enumerate(fids.tolist()) if fid not in known]
        new_fids = np.zeros(0, np.int64)
        if new:
            new_fids, at = np.unique(fids[new], return_index=True)  # equal frames in distinct objects
            new_frames = [frames[new[i]] for i in at.tolist()]
            con.execute(
                "INSERT INTO frames SELECT * FROM (SELECT unnest($1::BIGINT[]) AS id, "
                "unnest($2::VARCHAR[]), unnest($3::VARCHAR[]), unnest($4::BOOLEAN[])) n "
                "WHERE n.id NOT IN (SELECT id FROM frames)",
                [
                    new_fids.tolist(),
                    [f.function for f in new_frames],
                    [f.module for f in new_frames],
                    [bool(f.kernel) for f in new_frames],
                ],
            )
        sids = np.fromiter(stacks.keys(), dtype=np.int64, count=len(stacks))
        ends = np.cumsum(lengths)
        con.register(
            "new_stack_frames",
            {
                "sid": np.repeat(sids, lengths),
                "pos": np.arange(len(flat), dtype=np.int64) - np.repeat(ends - lengths, lengths),
                "fid": fids[which.reshape(-1)],
            },
        )
        con.execute(
            "INSERT INTO stacks SELECT sid, list(fid ORDER BY pos) FROM new_stack_frames "
            "WHERE sid NOT IN (SELECT id FROM stacks) GROUP BY sid"
        )
        con.unregister("new_stack_frames")
        if (lengths == 0).any():  # a stack of no frames has no rows above
            con.execute(
                "INSERT INTO stacks SELECT * FROM (SELECT unnest($1::BIGINT[]) AS id, []::BIGINT[]) n "
                "WHERE n.id NOT IN (SELECT id FROM stacks)",
                [sids[lengths == 0].tolist()],
            )
        return new_fids.tolist()

    def rollup(self, now: float, policy: RollupPolicy) -> None:
        """10 s rows older than policy.raw_s become 1 min rows; 1 min rows older than minute_s, 10 min."""
        for src, dst, age in ((10, 60, policy.raw_s), (60, 600, policy.minute_s)):
            cut = int((now - age) // dst * dst)  # whole destination buckets only
            with self._write_lock:
                con = self._con
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
                    _rollback(con)
                    raise

    def expire(self, horizon: float) -> None:
        """Delete every bucket that ended before `horizon`."""
        with self._write_lock:
            for table in ("samples", "syscalls", "syscall_hist"):
                self._con.execute(f"DELETE FROM {table} WHERE bucket + res <= $1", [horizon])

    def prune_seen(self, horizon: float, keep_per_agent: int) -> None:
        """Drop dedupe entries of batches whose window started before `horizon` (a resend that old is
        rejected as stale) and, per agent, all but the newest `keep_per_agent` sequences."""
        with self._write_lock:
            self._con.execute("DELETE FROM seen WHERE coalesce(start, 0) < $1", [horizon])
            self._con.execute(
                "DELETE FROM seen USING (SELECT agent_id, max(sequence) AS top FROM seen "
                "GROUP BY agent_id) m "
                "WHERE seen.agent_id = m.agent_id AND seen.sequence < m.top - $1",
                [keep_per_agent],
            )

    def gc(self) -> None:
        """Forget stacks, frames and label sets that no retained row refers to (pids and stacks churn)."""
        with self._write_lock:
            con = self._con
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
                _rollback(con)
                raise
            self._known_stacks = IdIndex()
            self._known_labels.clear()
            self._known_frames.clear()

    def load_seen(self) -> list[tuple[str, int, float]]:
        return [
            tuple(r)
            for r in self._cursor()
            .execute("SELECT agent_id, sequence, coalesce(start, 0) FROM seen")
            .fetchall()
        ]

    # -- reading (any thread) ---------------------------------------------------------------------------
    def _cursor(self) -> duckdb.DuckDBPyConnection:
        return self._con.cursor()

    def _with_pending(self, cur: duckdb.DuckDBPyConnection, pending: Sequence[Chunk]) -> None:
        cur.register("pending_samples", _merge_columns(pending))

    _RANGE = "bucket + res > $start AND bucket <= $end"
    _ALL_SAMPLES = (
        "(SELECT res, bucket, lid, sid, freq, count FROM samples UNION ALL "
        "SELECT 10 AS res, bucket, lid, sid, freq, count FROM pending_samples)"
    )

    def labels_of(self, lids: Iterable[int], pending: Sequence[Chunk] = ()) -> dict[int, Labels]:
        out, missing = _known(lids, self._label_cache, [c.labels for c in pending])
        if missing:
            rows = (
                self._cursor()
                .execute(
                    "SELECT id, any_value(labels) FROM label_sets WHERE id IN (SELECT unnest($1::BIGINT[])) "
                    "GROUP BY id",
                    [missing],
                )
                .fetchall()
            )
            if len(self._label_cache) > _CACHE_LIMIT:
                self._label_cache.clear()
            for lid, text in rows:
                lb = tuple(tuple(p) for p in json.loads(text))
                self._label_cache[lid] = out[lid] = lb
        return out

    def stacks_of(self, sids: Iterable[int], pending: Sequence[Chunk] = ()) -> dict[int, Stack]:
        out, missing = _known(sids, self._stack_cache, ())
        if missing and pending:
            for c in pending:
                out.update(c.stacks_for(missing))
            missing = [sid for sid in missing if sid not in out]
        if missing:
            rows = (
                self._cursor()
                .execute(
                    "SELECT u.id, list(f.function ORDER BY u.pos), list(f.module ORDER BY u.pos), "
                    "list(f.kernel ORDER BY u.pos) FROM (SELECT id, unnest(frames) AS fid, "
                    "generate_subscripts(frames, 1) AS pos FROM stacks WHERE id IN "
                    "(SELECT unnest($1::BIGINT[]))) u JOIN frames f ON f.id = u.fid GROUP BY u.id",
                    [missing],
                )
                .fetchall()
            )
            if len(self._stack_cache) > _CACHE_LIMIT:
                self._stack_cache.clear()
            for sid, fns, mods, kern in rows:
                st = tuple(FrameKey(f, m, k) for f, m, k in zip(fns, mods, kern, strict=True))
                self._stack_cache[sid] = out[sid] = st
            for sid in missing:
                out.setdefault(sid, ())  # a stack of no frames has no rows to join
        return out

    def _matching_lids(
        self, cur: duckdb.DuckDBPyConnection, selector: Selector, params: dict, pending: Sequence[Chunk]
    ) -> tuple[list[int], bool]:
        """Label ids with samples in range that match; and whether that is all of them."""
        lids = [
            r[0]
            for r in cur.execute(
                f"SELECT DISTINCT lid FROM {self._ALL_SAMPLES} WHERE {self._RANGE}", params
            ).fetchall()
        ]
        if not selector.matchers:
            return lids, True
        labels = self.labels_of(lids, pending)
        matched = [lid for lid in lids if lid in labels and selector.matches(dict(labels[lid]))]
        return matched, len(matched) == len(lids)

    def per_key(
        self, selector: Selector, start: float, end: float, key: str, pending: Sequence[Chunk] = ()
    ) -> tuple[dict[int, int], int | None]:
        """Samples per stack id (key="sid") or label id (key="lid") of matching series, and the sampling
        frequency that most of them came at."""
        cur = self._cursor()
        self._with_pending(cur, pending)
        params = {"start": start, "end": end}
        lids, everything = self._matching_lids(cur, selector, params, pending)
        if not lids:
            return {}, None
        where = self._RANGE
        if not everything:
            cur.register("wanted", {"lid": np.array(lids, dtype=np.int64)})
            where += " AND lid IN (SELECT lid FROM wanted)"
        rows = cur.execute(
            f"SELECT {key}, freq, sum(count)::BIGINT FROM {self._ALL_SAMPLES} WHERE {where} "
            f"GROUP BY {key}, freq",
            params,
        ).fetchall()
        merged: dict[int, int] = defaultdict(int)
        freqs: dict[int, int] = defaultdict(int)
        for k, freq, n in rows:
            merged[k] += n
            freqs[freq] += n
        freq = max(freqs, key=freqs.get) if freqs else None
        return dict(merged), freq or None

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str], pending: Sequence[Chunk] = ()
    ) -> dict[tuple[str, ...], SyscallAgg]:
        cur = self._cursor()
        params = {"start": start, "end": end}
        pend_sys = [r for c in pending for r in c.sys_rows]
        pend_hist = [r for c in pending for r in c.hist_rows]
        sums = cur.execute(
            f"SELECT lid, syscall, sum(count)::BIGINT, sum(timed)::BIGINT, sum(timed_ns)::BIGINT "
            f"FROM syscalls "
            f"WHERE {self._RANGE} GROUP BY lid, syscall",
            params,
        ).fetchall()
        hist = cur.execute(
            f"SELECT lid, syscall, i, sum(n)::BIGINT FROM syscall_hist WHERE {self._RANGE} "
            "GROUP BY lid, syscall, i",
            params,
        ).fetchall()
        lo = start - 10
        sums += [(lid, name, c, t, ns) for b, lid, name, c, t, ns in pend_sys if lo < b <= end]
        hist += [(lid, name, i, n) for b, lid, name, i, n in pend_hist if lo < b <= end]
        per: dict[tuple[int, str], SyscallAgg] = {}
        for lid, name, c, t, ns in sums:
            per.setdefault((lid, name), SyscallAgg()).add(SyscallAgg(c, t, ns))
        for lid, name, i, n in hist:
            agg = per.setdefault((lid, name), SyscallAgg())
            if len(agg.hist) <= i:
                agg.hist.extend([0] * (i + 1 - len(agg.hist)))
            agg.hist[i] += n
        labels = self.labels_of({lid for lid, _ in per}, pending)
        out: dict[tuple[str, ...], SyscallAgg] = {}
        for (lid, name), agg in per.items():
            lb = dict(labels.get(lid, ()))
            if not selector.matches(lb):
                continue
            group = tuple(name if b == "syscall" else lb.get(b, "") for b in by)
            out.setdefault(group, SyscallAgg()).add(agg)
        return out

    def label_sets(
        self, start: float | None, end: float | None, pending: Sequence[Chunk] = ()
    ) -> list[Labels]:
        cur = self._cursor()
        if start is None and end is None:
            rows = cur.execute("SELECT labels FROM label_sets").fetchall()
            seen = {lb for c in pending for lb in c.labels.values()}
            seen.update(tuple(tuple(p) for p in json.loads(r[0])) for r in rows)
            return list(seen)
        self._with_pending(cur, pending)
        params = {"start": start if start is not None else -1e18, "end": end if end is not None else 1e18}
        lids = [
            r[0]
            for r in cur.execute(
                f"SELECT DISTINCT lid FROM {self._ALL_SAMPLES} WHERE {self._RANGE}", params
            ).fetchall()
        ]
        return list(self.labels_of(lids, pending).values())

    def table_rows(self) -> dict[str, int]:
        cur = self._cursor()
        return {t: cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}

    def size_bytes(self) -> int:
        wal = self.path.with_name(self.path.name + ".wal")
        return sum(p.stat().st_size for p in (self.path, wal) if p.exists())

    def close(self) -> None:
        with self._write_lock:
            self._con.execute("CHECKPOINT")
            self._con.close()
