"""Retention by dropping whole day partitions, each table past the time its rows are read for: `rows` (10 s)
once the day ends before the 1 min cut, `rows_1m` before the 10 min cut, the rest before the retention
horizon. Queries cut at the exact horizon themselves, so a partly expired day still on disk never counts."""

from __future__ import annotations

import logging

from fleetprof.collector.store.clickhouse.connection import Connection
from fleetprof.collector.store.clickhouse.queries import RollupPolicy, tiers
from fleetprof.collector.store.clickhouse.schema import DAY, TABLES, Layout

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, conn: Connection, layout: Layout, policy: RollupPolicy):
        self._conn = conn
        self._layout = layout
        self._policy = policy

    def drop(self, now: float, retention_s: float) -> list[tuple[str, str]]:
        """Drop what is past; returns the (table, partition) pairs dropped."""
        horizon = now - retention_s
        raw, minute, _ = tiers(now, self._policy, horizon)
        # the first bucket each table must keep; a day partition goes once it ends at or before it
        keep_from = {"rows": raw.lo, "rows_1m": minute.lo}
        dropped = []
        parts = self._conn.query(
            "SELECT table, partition FROM system.parts WHERE active AND database = "
            f"'{self._layout.database}' GROUP BY table, partition"
        )
        for t in TABLES:
            local = self._layout.local(t.name).split(".", 1)[1]
            first = max(keep_from.get(t.name, horizon), horizon)
            for table, partition in parts:
                if table != local:
                    continue
                day = int(partition.strip("'"))
                if (day + 1) * DAY <= first:
                    self._conn.query(
                        f"ALTER TABLE {self._layout.local(t.name)}{self._layout.on_cluster} "
                        f"DROP PARTITION {day}"
                    )
                    dropped.append((t.name, partition))
        if dropped:
            log.info("retention: dropped %d day partitions", len(dropped))
        return dropped
