"""Group commit: batches from every ingest thread wait here for one insert, and are acknowledged when it
returns.

Rules this file keeps:
- A batch is stored when its rows and its marker are, in `rows` and in both rollups (one block of `rows`,
  sharded by its node, so a batch is always on one shard whole; the materialized views put it into the
  rollups in the same insert). It is reported stored only after that insert returned, replicated to the
  configured quorum with a cluster.
- Before inserting, the group's batches are looked up by marker in the three tables: a batch some
  collector stored already (its ack was lost with that collector) is reported as a duplicate and not
  inserted again. A batch in `rows` whose rollups lack it (an insert that failed after its part was
  written: a quorum that timed out, a view's table refusing a second quorum insert) has its rollup rows
  inserted alone, never its rows again.
- After inserting, with a quorum, the markers are read again: a part that waited for its quorum can
  appear between that lookup and the insert, and a copy too many is taken back with a negated one
  (_settle). A resend finds a batch stored only once it is in every table once.
- Definitions (frames, stacks, label sets) go in before the rows that use them, so a row never refers to
  a definition ClickHouse lacks; they are idempotent (by content id), so a failed group may leave some
  behind harmlessly.
- On an error nothing of the group is reported stored: ingest does not acknowledge, the agents resend,
  and the next try skips what did go in (an insert into two shards can land on one and fail on the
  other).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from fleetprof.collector.model.id_index import IdIndex
from fleetprof.collector.model.ids import ContentIds, labels_json
from fleetprof.collector.model.profile import Labels
from fleetprof.collector.model.rows import BUCKET_S, ProfileRows
from fleetprof.collector.store.clickhouse.connection import (
    UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE,
    ClickHouseError,
    Connection,
)
from fleetprof.collector.store.clickhouse.schema import CPU, DAY, HIST, MARKER, ROLLUPS, SYSCALL, Layout
from fleetprof.collector.store.stack_definitions import joined, new_frames, stack_definitions, used_ids

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)
_WHOLE = frozenset(["rows", *(name for name, _ in ROLLUPS)])  # where a stored batch's markers are


@dataclass
class Pending:
    """One batch waiting for its group's insert."""

    key: int  # the batch's key (store.py: keyed hash of its source and sequence)
    profile: ProfileRows
    node: str
    source: str
    sequence: int
    done: threading.Event = field(default_factory=threading.Event)
    stored: bool = False  # set with done: False when it was found stored before (a duplicate)
    error: str | None = None
    queued_at: float = 0.0  # time.monotonic() when submitted

    @property
    def bucket(self) -> int:
        p = self.profile
        return int((p.start + p.end) / 2 // BUCKET_S * BUCKET_S)


def _once(per_table: dict[str, int]) -> bool:
    """A batch's marker sums (_marker_sums) say it is in every table once."""
    return all(per_table.get(t) == 1 for t in _WHOLE)


class _Known:
    """Definitions known to be in ClickHouse, per day partition (a definition is written again on each new
    day it is used, so that retention can drop a day of definitions with that day's rows). Stacks and
    frames in IdIndexes (value 0): a group asks about ~15,000 of each at once, and a day's run to millions."""

    def __init__(self) -> None:
        self._days: dict[int, tuple[IdIndex, IdIndex, set[int]]] = {}

    def day(self, day: int) -> tuple[IdIndex, IdIndex, set[int]]:
        """(stacks, frames, label sets) known for `day`."""
        sets = self._days.get(day)
        if sets is None:
            sets = self._days[day] = (IdIndex(), IdIndex(), set())
            for old in [d for d in self._days if d < day - 2]:  # batches older than 2 h are refused
                del self._days[old]
        return sets


class GroupWriter:
    """One thread that inserts what `submit` queued, `group_s` after the first batch of a group or once
    `group_rows` rows wait, whichever comes first."""

    def __init__(
        self,
        conn: Connection,
        layout: Layout,
        ids: ContentIds,
        insert_settings: dict,
        read_settings: dict,
        group_s: float = 0.2,
        group_rows: int = 500_000,
        quorum_retry_s: float = 10.0,
        on_stored: Callable[[list[Pending]], None] | None = None,
    ):
        self._conn = conn
        self._layout = layout
        self._ids = ids
        self._insert = insert_settings
        self._read = read_settings
        self._group_s = group_s
        self._group_rows = group_rows
        self._quorum_retry_s = quorum_retry_s
        self._on_stored = on_stored or (lambda done: None)
        self._known = _Known()
        self._queue: list[Pending] = []
        self._rows = 0
        self._cond = threading.Condition()
        self._stop = False
        self.counters = {
            "groups": 0,
            "group_errors": 0,
            "quorum_retries": 0,
            "resends_skipped": 0,
            "rollups_completed": 0,  # batches in `rows` whose rollup rows went in alone, per rollup
            "copies_taken_back": 0,  # a batch's copies too many in a table (_settle), per table
        }
        self._thread = threading.Thread(target=self._run, name="clickhouse-writer", daemon=True)
        self._thread.start()

    def submit(self, item: Pending) -> None:
        with self._cond:
            if self._stop:
                item.error = "the store is closing"
                item.done.set()
                return
            item.queued_at = time.monotonic()
            self._queue.append(item)
            self._rows += len(item.profile.counts) + 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=60)

    def _take(self) -> list[Pending]:
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait()
            if not self._queue:
                return []
            # group_s from the group's first batch, not from now: batches that queued up while the last
            # insert ran have waited already, and go at once when that was group_s or more. Inserts stay
            # at most one per group_s while they are quicker than that.
            deadline = self._queue[0].queued_at + self._group_s
            while not self._stop and self._rows < self._group_rows:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            group, self._queue, self._rows = self._queue, [], 0
            return group

    def _run(self) -> None:
        while True:
            group = self._take()
            if not group:
                return
            try:
                self._write(group)
            except Exception as err:  # every waiting batch learns it, and is resent by its agent
                self.counters["group_errors"] += 1
                message = str(err) if isinstance(err, ClickHouseError) else f"{type(err).__name__}: {err}"
                for p in group:
                    if not p.done.is_set():
                        p.error = message
                        p.done.set()

    # -- one group ------------------------------------------------------------------------------------
    def _write(self, group: list[Pending]) -> None:
        self.counters["groups"] += 1
        sums = self._marker_sums(group)
        held = self._held(sums)
        # Stored before: once in every table, or with no rows left to complete the rollups from (`rows`
        # is dropped by retention hours before the rollups; no agent resends a batch that old). A batch
        # in every table but twice in one (a try that failed while settling it) is settled now.
        stored = {k for k, where in held.items() if "rows" not in where or _once(sums[k])}
        unsettled = [p for p in group if held.get(p.key, set()) >= _WHOLE and p.key not in stored]
        if stored:
            self.counters["resends_skipped"] += len(stored)
            for p in group:
                if p.key in stored:
                    p.done.set()  # stored=False: a duplicate
            group = [p for p in group if p.key not in stored]
        if not group:
            return
        for table, columns, commit in self._definitions(group):
            self._insert_retrying(table, columns)  # definitions are idempotent: a second copy is harmless
            commit()
        self._insert_rows(group, held, unsettled)
        self._on_stored(group)
        for p in group:
            p.stored = True
            p.done.set()

    def _insert_rows(self, group: list[Pending], held: dict[int, set[str]], unsettled: list[Pending]) -> None:
        """The group's rows, each batch once in each table: `rows` (and through its views the rollups) for
        the batches no table holds, each rollup alone for those `rows` holds and it lacks. An insert into
        several shards can land on some and fail on another, and one into `rows` can land there and fail in
        a view's table (ClickHouse before 21.x takes one quorum insert per table and shard at a time, and
        refuses the next while the last replicates): trying it again whole would store the landed batches
        twice. So after such a refusal the group's markers are looked up again, and each table gets only
        the batches it lacks on the next try. Then the batches that went in are settled (_settle)."""
        deadline = time.monotonic() + self._quorum_retry_s
        pause = 0.02
        # Batches some insert of this group put in, and those found in a table twice: settled at the end.
        inserted: dict[int, Pending] = {p.key: p for p in unsettled}
        while True:
            try:
                fresh = [p for p in group if not held.get(p.key)]
                if fresh:
                    self._conn.insert(self._layout.table("rows"), self._rows_of(fresh), settings=self._insert)
                    for p in fresh:
                        held[p.key] = set(_WHOLE)  # the views wrote the rollups in the same insert
                    if self._insert.get("insert_quorum", 0) > 1:
                        inserted.update((p.key, p) for p in fresh)
                for name, width in ROLLUPS:
                    lacking = [p for p in group if name not in held[p.key]]
                    if lacking:
                        self._conn.insert(
                            self._layout.table(name), self._rollup_of(lacking, width), settings=self._insert
                        )
                        self.counters["rollups_completed"] += len(lacking)
                        for p in lacking:
                            held[p.key].add(name)
                        inserted.update((p.key, p) for p in lacking)
                if inserted:
                    self._settle(list(inserted.values()))
                return
            except ClickHouseError as err:
                if err.code != UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE or time.monotonic() > deadline:
                    raise
            self.counters["quorum_retries"] += 1
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            held = self._held(self._marker_sums(group))  # what landed meanwhile

    def _settle(self, group: list[Pending]) -> None:
        """Each of `group`'s batches exactly once in each table, by its markers read again after the
        writer's inserts. A part of a batch whose quorum timed out (written, held back from reads until a
        replica fetches it) can appear between the read that found the batch missing from a table and the
        insert that put it there: that table then holds it twice. Not later: 18.16 takes no quorum insert
        while one waits on the table and shard, so once this batch's insert went in, any part of it that
        waited is visible.
        - `rows` twice: a negated copy of the batch goes into `rows` (tables sum). Its views carry the
          negation into the rollups, which the part that waited never reached (a timed-out insert runs no
          view), and the next round puts the batch back into them alone.
        - A rollup twice, or not at all: a negated copy, or the batch's rollup rows, into it alone.
        Every round reads the markers first, also after a refused insert: a copy of its own that waited
        would otherwise be taken back twice. Without quorum inserts only the rollups completed alone are
        checked: nothing else can wait."""
        deadline = time.monotonic() + self._quorum_retry_s
        pause = 0.02
        rounds = 0  # a round each for `rows` and the rollups, and the read that finds them whole
        while rounds < 4:
            rounds += 1
            try:
                sums = self._marker_sums(group)
                scale = {p.key: min(0, 1 - sums.get(p.key, {}).get("rows", 1)) for p in group}
                if any(scale.values()):
                    self._insert_scaled("rows", [p for p in group if scale[p.key]], scale, self._rows_of)
                    self.counters["copies_taken_back"] -= sum(scale.values())
                    continue
                settled = True
                for name, width in ROLLUPS:
                    scale = {p.key: 1 - sums.get(p.key, {}).get(name, 0) for p in group}
                    off = [p for p in group if scale[p.key]]
                    if off:
                        settled = False
                        self._insert_scaled(name, off, scale, lambda ps, w=width: self._rollup_of(ps, w))
                        self.counters["copies_taken_back"] -= sum(v for v in scale.values() if v < 0)
                if settled:
                    return
            except ClickHouseError as err:
                if err.code != UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE or time.monotonic() > deadline:
                    raise
                rounds -= 1  # refused: nothing went in
                self.counters["quorum_retries"] += 1
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        log.warning("ClickHouse: %d batches still not once in every table after settling", len(group))

    def _insert_scaled(
        self,
        table: str,
        group: list[Pending],
        scale: dict[int, int],
        rows_of: Callable[[list[Pending]], dict[str, np.ndarray]],
    ) -> None:
        """`rows_of` each batch of `group`, its sums multiplied by scale[batch key], into `table`."""
        parts = []
        for p in group:
            rows = rows_of([p])
            for column in ("count", "timed", "timed_ns"):
                rows[column] = rows[column] * scale[p.key]
            parts.append(rows)
        columns = {c: np.concatenate([rows[c] for rows in parts]) for c in parts[0]}
        self._conn.insert(self._layout.table(table), columns, settings=self._insert)

    @staticmethod
    def _held(sums: dict[int, dict[str, int]]) -> dict[int, set[str]]:
        """For each batch some table holds (by _marker_sums): the tables that hold it."""
        return {k: {t for t, n in per_table.items() if n > 0} for k, per_table in sums.items()}

    def _marker_sums(self, group: list[Pending]) -> dict[int, dict[str, int]]:
        """For each of the group's batches some table holds: per table, the sum of its markers' counts (1
        a copy). A marker in `rows` with `count` 0 was written before the rollups carried markers
        (schema.py): its batch counts as whole, once in each table."""
        keys = np.array([p.key for p in group], dtype=np.int64)
        parts = [
            f"SELECT 'rows', batch, sum(count) FROM {self._layout.table('rows')} WHERE kind = {MARKER} "
            f"AND bucket IN ({', '.join(map(str, sorted({p.bucket for p in group})))}) AND batch IN wanted "
            "GROUP BY batch"
        ]
        for name, width in ROLLUPS:
            buckets = sorted({p.bucket // width * width for p in group})
            parts.append(
                f"SELECT '{name}', sid, sum(count) FROM {self._layout.table(name)} WHERE kind = {MARKER} "
                f"AND bucket IN ({', '.join(map(str, buckets))}) AND sid IN wanted GROUP BY sid"
            )
        found = self._conn.query(" UNION ALL ".join(parts), ids={"wanted": keys}, settings=self._read)
        sums: dict[int, dict[str, int]] = {}
        for table, key, total in found:
            sums.setdefault(int(key), {})[table] = int(total)
        for per_table in sums.values():
            if per_table.get("rows") == 0:
                per_table.update({t: 1 for t in _WHOLE})
        return sums

    def _rollup_of(self, group: list[Pending], width: int) -> dict[str, np.ndarray]:
        """The group's rows as its views write them into the rollup of `width` seconds (schema.py)."""
        rows = self._rows_of(group)
        out = {k: v for k, v in rows.items() if k != "batch"}
        out["bucket"] = rows["bucket"] // width * width
        out["sid"] = np.where(rows["kind"] == MARKER, rows["batch"], rows["sid"])
        return out

    def _insert_retrying(self, table: str, columns: dict) -> None:
        """Insert, trying again while a shard's previous quorum insert is still replicating (ClickHouse
        before 21.x takes one quorum insert per table and shard at a time)."""
        deadline = time.monotonic() + self._quorum_retry_s
        pause = 0.02
        while True:
            try:
                self._conn.insert(table, columns, settings=self._insert)
                return
            except ClickHouseError as err:
                if err.code != UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE or time.monotonic() > deadline:
                    raise
                self.counters["quorum_retries"] += 1
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    def _definitions(self, group: list[Pending]) -> list[tuple[str, dict, Callable[[], None]]]:
        """Inserts of the frames, stacks and label sets the group uses that are not known to be in
        ClickHouse for their day yet, each with what to remember once it went in."""
        days: dict[int, list[Pending]] = {}
        for p in group:
            days.setdefault(p.bucket // DAY, []).append(p)
        new_labels: dict[int, dict[int, Labels]] = {}
        for day, batches in days.items():
            known_labels = self._known.day(day)[2]
            labels = new_labels.setdefault(day, {})
            for p in batches:
                for lid, lb in p.profile.label_sets:  # the syscall rows' label sets among them
                    if lid not in known_labels:
                        labels.setdefault(lid, lb)
        out = []
        frames_cols, stack_cols, frame_ids_new, stack_ids_new = self._stack_columns(days)
        if frames_cols is not None:

            def frames_done(new: dict[int, np.ndarray] = frame_ids_new) -> None:
                for day, fids in new.items():
                    self._known.day(day)[1].add(fids, np.zeros(len(fids), np.int64))

            out.append((self._layout.table("frames"), frames_cols, frames_done))
        if stack_cols is not None:

            def stacks_done(new: dict[int, np.ndarray] = stack_ids_new) -> None:
                for day, sids in new.items():
                    self._known.day(day)[0].add(sids, np.zeros(len(sids), np.int64))

            out.append((self._layout.table("stacks"), stack_cols, stacks_done))
        label_rows = [(day, lid, lb) for day, sets in new_labels.items() for lid, lb in sets.items()]
        if label_rows:

            def labels_done(rows: list = label_rows) -> None:
                for day, lid, _ in rows:
                    self._known.day(day)[2].add(lid)

            out.append(
                (
                    self._layout.table("label_sets"),
                    {
                        "day": np.array([d for d, _, _ in label_rows], dtype=np.uint32),
                        "id": np.array([lid for _, lid, _ in label_rows], dtype=np.int64),
                        "labels": np.array([labels_json(lb) for _, _, lb in label_rows], dtype=object),
                    },
                    labels_done,
                )
            )
        return out

    def _stack_columns(self, days: dict[int, list[Pending]]) -> tuple:
        """Columns of the stacks and frames the group's batches use that are new for their day (a stack's
        frames written again with it on a new day), and the ids each insert makes known. The stacks ingest
        decoded come with their frames' ids as columns (stack_definitions.py); a frame's names are read
        only for frames new for the day."""
        f_day, f_id, f_fn, f_mod, f_kern = [], [], [], [], []
        s_day, s_id, s_frames = [], [], []
        frames_new: dict[int, np.ndarray] = {}
        stacks_new: dict[int, np.ndarray] = {}
        for day, batches in days.items():
            known_stacks, known_frames, _ = self._known.day(day)
            tables = [(p.profile.stack_table_ids, p.profile.stacks) for p in batches]
            used = used_ids(tables)
            new_ids = used[known_stacks.get(used) < 0]
            if not len(new_ids):
                continue
            parts = stack_definitions(tables, new_ids, self._ids)
            sids, lengths, fids = joined(parts)
            flat = fids.tolist()
            ends = list(accumulate(lengths.tolist()))
            s_frames.extend(map(flat.__getitem__, map(slice, [0, *ends[:-1]], ends)))
            s_day.append(np.full(len(lengths), day, np.uint32))
            s_id.append(sids)
            stacks_new[day] = sids
            fresh_ids, fresh = new_frames(parts, known_frames)
            frames_new[day] = fresh_ids
            if fresh:
                f_day.append(np.full(len(fresh), day, np.uint32))
                f_id.append(fresh_ids)
                f_fn.extend([f.function for f in fresh])
                f_mod.extend([f.module for f in fresh])
                f_kern.append(np.array([f.kernel for f in fresh], np.uint8))
        frames_cols = stack_cols = None
        if f_id:
            frames_cols = {
                "day": np.concatenate(f_day),
                "id": np.concatenate(f_id),
                "function": np.array(f_fn, dtype=object),
                "module": np.array(f_mod, dtype=object),
                "kernel": np.concatenate(f_kern),
            }
        if s_id:
            frames_obj = np.empty(len(s_frames), dtype=object)
            frames_obj[:] = s_frames
            stack_cols = {"day": np.concatenate(s_day), "id": np.concatenate(s_id), "frames": frames_obj}
        return frames_cols, stack_cols, frames_new, stacks_new

    def _rows_of(self, group: list[Pending]) -> dict[str, np.ndarray]:
        """The group's rows as columns of `rows`: per batch its samples, syscall rows, latency buckets and
        marker. The String columns (`syscall`, `node`: one value a batch or a row kind) are numpy byte
        strings: clickhouse-driver writes those as they are, where it checks an object column for nulls and
        encodes it value by value (a group's 25,000 rows: 16 -> 8 ms of CPU, bench/README.md)."""
        # The sample rows of all batches first, each per-batch value repeated in one call; then every
        # batch's syscall, latency and marker rows from one list (a group is a few batches: numpy calls per
        # batch and column were a third of this function).
        sizes = [len(p.profile.counts) for p in group]
        n = sum(sizes)
        extra: list[tuple] = []  # kind, lid, syscall, i, count, timed, ns, batch
        extra_sizes = []
        for p in group:
            prof, before = p.profile, len(extra)
            ids = {lset: i for i, lset in prof.label_sets} if prof.syscalls else {}
            for lset, name, agg in prof.syscalls:
                lid_s = ids[lset]  # a syscall row's label set is in the window's table (ProfileRows)
                call = _utf8(name)
                extra.append((SYSCALL, lid_s, call, 0, agg.count, agg.timed, agg.timed_ns, 0))
                extra.extend((HIST, lid_s, call, i, v, 0, 0, 0) for i, v in enumerate(agg.hist) if v)
            # count 1: the rollups' merges keep it (schema.py)
            extra.append((MARKER, 0, b"", 0, 1, 0, 0, p.key))
            extra_sizes.append(len(extra) - before)
        cols = list(zip(*extra, strict=True))
        buckets = np.array([p.bucket for p in group], dtype=np.int64)
        nodes = np.array([_utf8(p.node) for p in group])
        m = len(extra)

        def cat(samples: list[np.ndarray], others: np.ndarray, dtype: type | None = None) -> np.ndarray:
            return np.concatenate([*samples, others], dtype=dtype)

        return {
            "kind": cat([np.full(n, CPU, np.uint8)], np.array(cols[0], np.uint8)),
            "bucket": cat([np.repeat(buckets, sizes)], np.repeat(buckets, extra_sizes)),
            "lid": cat([p.profile.label_ids() for p in group], np.array(cols[1], np.int64)),
            "sid": cat([p.profile.stack_ids() for p in group], np.zeros(m, np.int64)),
            "freq": cat(
                [np.repeat(np.array([p.profile.frequency_hz for p in group], np.uint32), sizes)],
                np.zeros(m, np.uint32),
            ),
            "syscall": cat([np.full(n, b"", dtype="S1")], np.array(cols[2])),
            "i": cat([np.zeros(n, np.uint8)], np.array(cols[3], np.uint8)),
            "count": cat([p.profile.counts for p in group], np.array(cols[4], np.int64), np.int64),
            "timed": cat([np.zeros(n, np.int64)], np.array(cols[5], np.int64)),
            "timed_ns": cat([np.zeros(n, np.int64)], np.array(cols[6], np.int64)),
            "batch": cat([np.zeros(n, np.int64)], np.array(cols[7], np.int64)),
            "node": cat([np.repeat(nodes, sizes)], np.repeat(nodes, extra_sizes)),
        }


def _utf8(text: str) -> bytes:
    """`text` as a String column's bytes. Numpy byte strings drop trailing NUL bytes: a node name ending
    in one shards as the name without them (`node` only shards and is not read back)."""
    return text.encode("utf-8", "surrogatepass")
