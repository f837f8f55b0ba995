"""The ClickHouse store: ProfileStore + DurableBatches over a ClickHouse database that many collectors
share. A collector keeps no state of its own worth keeping: ClickHouse holds every row, the dedupe
markers, the schema version and the content-id key, so any collector answers for the whole fleet and an
agent may stream to any of them.

Write path (`write_logged`): the batch joins the writer's next group (writer.py) and the call returns once
the group's insert did (replicated to the quorum with a cluster): only then is the batch acknowledged.
Dedupe: a batch's key is a keyed hash of (source, sequence) under the deployment's content-id key, so an
agent can aim at no other agent's key. It is checked first in this collector's memory (its own recent
batches, and one still being inserted), then in ClickHouse (markers, see schema.py) for batches another
collector stored. Why our own key rather than replicated block deduplication: block deduplication needs
every batch inserted as a block of its own (one part per batch and table: 500 agents make 50 parts a
second, far more than ClickHouse merges well) and exists only on replicated tables; the marker works the
same on one server and a cluster, and lets inserts be grouped.

What is not covered: a batch resent to a second collector while the first collector's insert of it is
still in flight (the agent's stream to a live collector broke mid-insert), and a shard's replica lost
before it replicated a part that no quorum confirmed. Either can count that batch twice; both need a
failure inside the insert's own milliseconds. A collector killed outright is covered: the server commits
a block it received whole, or nothing of it, before the agent can reconnect elsewhere.

Queries have no hot tier in memory: "now" is read from ClickHouse, which holds every batch any collector
has acknowledged (bench/README.md has what that costs).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import MAX_BATCH_AGE_S, Labels, SyscallAgg
from fleetprof.collector.model.rows import Grouped, ProfileRows, Selection, TimeSeries, selections_by_group
from fleetprof.collector.model.selector import Selector, label_value, names_in, values_in
from fleetprof.collector.store.base import StoreUnavailable
from fleetprof.collector.store.clickhouse.connection import ClickHouseError, Connection
from fleetprof.collector.store.clickhouse.gpu import ClickHouseGpuUsage
from fleetprof.collector.store.clickhouse.queries import Queries, RollupPolicy
from fleetprof.collector.store.clickhouse.retention import Retention
from fleetprof.collector.store.clickhouse.schema import Layout, Schema, ensure_schema
from fleetprof.collector.store.clickhouse.writer import GroupWriter, Pending
from fleetprof.collector.store.sequences import SeenSequences

log = logging.getLogger(__name__)

SEEN_WINDOW = 4096
MAINTAIN_EVERY_S = 600.0
WRITE_TIMEOUT_S = 60.0  # a group not written by then is reported unavailable (the agent resends it)


class ClickHouseStore:
    def __init__(
        self,
        conn: Connection,
        layout: Layout,
        retention_s: float = 7 * 86400.0,
        quorum: int = 0,
        clock: Callable[[], float] = time.time,
        rollup: RollupPolicy | None = None,
        group_s: float = 0.2,
        background: bool = True,
    ):
        self._conn = conn
        self.layout = layout
        self.retention_s = retention_s
        self._clock = clock
        self.schema: Schema = ensure_schema(conn, layout)
        # Every collector of the deployment computes the same ids: the key is the schema's, shared.
        self.ids = ContentIds(self.schema.content_key)
        self._batch_key = hashlib.blake2b(
            digest_size=8, key=self.schema.content_key, person=b"fleetprof-batch"
        )
        read: dict = {}
        insert = {"insert_deduplicate": 0}  # our markers dedupe; block dedupe could drop equal rollup blocks
        markers: dict = {}
        if layout.cluster:
            # Inserts and marker reads pick the same replica of a shard while it is up (in config order),
            # so a marker just written is where the next check looks.
            read = {"load_balancing": "in_order", "prefer_localhost_replica": 0}
            insert.update(read, insert_distributed_sync=1)
            # A replica back from a crash is first in that order again while it still fetches the parts
            # written without it: reads skip a replica more than a second behind while another is not
            # (a query right after the acks read 225 of 232 samples of a node, under load).
            read["max_replica_delay_for_distributed_queries"] = 1
            markers = dict(read)
            if quorum > 1:
                insert.update(insert_quorum=quorum, insert_quorum_timeout=10_000)
                # Whether a batch is stored must never be answered "no" by a replica that lacks a part a
                # quorum took: such a replica refuses the read instead, the batch is refused and resent.
                markers["select_sequential_consistency"] = 1
        self._read = read
        self._queries = Queries(conn, layout, read, clock, retention_s, rollup or RollupPolicy())
        self.gpu_usage = ClickHouseGpuUsage(conn, layout, insert, read, clock, min(retention_s, 86400.0))
        self._retention = Retention(conn, layout, rollup or RollupPolicy())
        self._lock = threading.Lock()
        self._seen = SeenSequences(window=SEEN_WINDOW, horizon_s=MAX_BATCH_AGE_S, clock=clock)
        self._inflight: dict[int, Pending] = {}
        self._failing = 0  # batches refused since ClickHouse last took one
        self.counters = {"duplicates_found_in_clickhouse": 0, "write_errors": 0, "maintenance_errors": 0}
        self._writer = GroupWriter(
            conn, layout, self.ids, insert, markers, group_s=group_s, on_stored=self._stored
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._maintain_loop, name="clickhouse-retention", daemon=True)
        if background:
            self._thread.start()

    def key_of(self, source: str, sequence: int) -> int:
        h = self._batch_key.copy()
        h.update(source.encode("utf-8", "surrogatepass") + b"\0" + sequence.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little", signed=True)

    # -- write path ----------------------------------------------------------------------------------
    def _stored(self, group: list[Pending]) -> None:
        with self._lock:
            for p in group:
                self._seen.add(p.source, p.sequence, p.profile.start)

    def seen(self, source: str, sequence: int) -> bool:
        with self._lock:
            return self._seen.seen(source, sequence)

    def write_logged(self, source: str, sequence: int, payload: bytes, profile: ProfileRows) -> bool:
        """Store one batch in ClickHouse; False if it was stored before (by this or another collector)."""
        key = self.key_of(source, sequence)
        with self._lock:
            if self._seen.seen(source, sequence):
                return False
            mine = self._inflight.get(key)
            if mine is None:
                mine = self._inflight[key] = Pending(key, profile, _node_of(profile), source, sequence)
                first = True
            else:
                first = False  # a resend racing the original on another stream: wait for the original
        if first:
            self._writer.submit(mine)
        try:
            if not mine.done.wait(WRITE_TIMEOUT_S):
                raise StoreUnavailable(f"ClickHouse did not take the batch within {WRITE_TIMEOUT_S:.0f} s")
        finally:
            if first:
                with self._lock:
                    self._inflight.pop(key, None)
        if mine.error is not None:
            self._failed(mine.error)
            raise StoreUnavailable(f"ClickHouse: {mine.error}")
        self._ok()
        if not first:
            return False
        if not mine.stored:
            self.counters["duplicates_found_in_clickhouse"] += 1
            with self._lock:
                self._seen.add(source, sequence, profile.start)
        return mine.stored

    def _failed(self, error: str) -> None:
        """Says once in the log that ClickHouse refuses batches (and, in _ok, that it takes them again)."""
        with self._lock:
            self.counters["write_errors"] += 1
            self._failing += 1
            first = self._failing == 1
        if first:
            log.error("ClickHouse does not take batches; agents keep and resend them (said once): %s", error)

    def _ok(self) -> None:
        if self._failing:
            with self._lock:
                n, self._failing = self._failing, 0
            if n:
                log.warning("ClickHouse takes batches again, after %d refused", n)

    def write(self, profile: ProfileRows) -> None:
        """Store rows without a batch identity (tools and benchmarks)."""
        p = Pending(self.key_of("", time.monotonic_ns()), profile, _node_of(profile), "", 0)
        self._writer.submit(p)
        p.done.wait(WRITE_TIMEOUT_S)
        if p.error is not None:
            raise StoreUnavailable(f"ClickHouse: {p.error}")

    # -- queries ---------------------------------------------------------------------------------------
    def select(self, selector: Selector, start: float, end: float) -> Selection:
        per_sid, freq = self._queries.per_key(selector, start, end, "sid")
        stacks = self._queries.stacks_of(per_sid)
        merged: dict = {}
        for sid, n in per_sid.items():
            st = stacks[sid]
            merged[st] = merged.get(st, 0) + n
        return Selection(merged, freq)

    def select_groups(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], Selection]:
        rows = self._queries.per_label_stack(selector, start, end)
        labels = self._queries.labels_of({r[0] for r in rows})
        stacks = self._queries.stacks_of({r[1] for r in rows})
        return selections_by_group(rows, labels, stacks, by)

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        per_lid, freq = self._queries.per_key(selector, start, end, "lid")
        labels = self._queries.labels_of(per_lid)
        totals: dict[tuple[str, ...], int] = {}
        for lid, n in per_lid.items():
            lb = dict(labels.get(lid, ()))
            key = tuple(label_value(lb, name) for name in by)
            totals[key] = totals.get(key, 0) + n
        return Grouped(tuple(by), totals, freq)

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        per, freq = self._queries.per_label_step(selector, start, end, step_s)
        labels = self._queries.labels_of({lid for lid, _ in per})
        points: dict[tuple[str, ...], dict[float, int]] = {}
        for (lid, t), n in per.items():
            lb = dict(labels.get(lid, ()))
            series = points.setdefault(tuple(label_value(lb, name) for name in by), {})
            series[t] = series.get(t, 0) + n
        return TimeSeries(tuple(by), step_s, points, freq)

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        return self._queries.syscalls(selector, start, end, by)

    def _label_sets(self, start: float | None, end: float | None) -> list[Labels]:
        return self._queries.label_sets(start, end)

    def label_names(
        self, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return names_in(self._label_sets(start, end), match)

    def label_values(
        self, name: str, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return values_in(self._label_sets(start, end), name, match)

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(self._writer.counters)
        with self._lock:
            out["dedupe_entries"] = len(self._seen)
            out["inflight_batches"] = len(self._inflight)
        return out

    # -- retention -------------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Drop the partitions past what queries read (every collector may: drops are idempotent)."""
        self._retention.drop(self._clock(), self.retention_s)

    def _maintain_loop(self) -> None:
        while not self._stop.wait(MAINTAIN_EVERY_S):
            try:
                self.maintain()
            except ClickHouseError as err:
                self.counters["maintenance_errors"] += 1
                log.warning("ClickHouse retention: %s (tried again in %.0f s)", err, MAINTAIN_EVERY_S)

    def close(self) -> None:
        """Every acknowledged batch is in ClickHouse already: stop the threads, close the connections."""
        self._stop.set()
        self._writer.close()
        self._conn.close()


def _node_of(profile: ProfileRows) -> str:
    """The node a batch came from (ingest sets the `node` label of every label set from the batch's
    identity): the shard key of its rows."""
    for _, labels in profile.label_sets:
        return label_value(dict(labels), "node")
    for labels, _, _ in profile.syscalls:
        return label_value(dict(labels), "node")
    return ""
