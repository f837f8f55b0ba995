"""The ClickHouse schema, made idempotently at start and versioned; the content-id key it carries.

Tables (`_local` ReplicatedMergeTree tables behind Distributed ones of the plain names with `cluster=`):

- `rows`: every row of every batch, partitioned by day (`intDiv(bucket, 86400)`), ordered by
  (kind, bucket, lid, sid). One table for all of a batch, so that one INSERT block holds a batch whole:
  kind 1 CPU samples or off-CPU nanoseconds (`lid`, `sid`, `freq`, `count`), kind 2 syscall counts
  (`syscall`, `count`, `timed`, `timed_ns`), kind 3 syscall latency buckets (`syscall`, `i`, `count`),
  kind 4 the batch's marker (`batch`: its key, see store.py; `count` 1). The marker commits with the rows
  or not at all, which is what makes resends count once. `node` is the sharding key: a batch lives on one
  shard.
- `rows_1m`, `rows_10m`: the same rows summed into 1 and 10 minute buckets by materialized views as they
  are inserted (SummingMergeTree; queries still sum, merges only shrink them). The views carry each
  batch's marker too (its key in `sid`, so that no two batches' markers sum into one; `count` 1, so that
  the merge keeps it): an insert can land in `rows` and not reach a view's table (a quorum that timed out
  after the part was written, or a view's table refusing a second quorum insert), and the writer finds
  such a batch by its markers and completes the rollups alone (writer.py), on its shard (`node`).
- `frames`, `stacks`, `label_sets`: definitions by content id (ReplacingMergeTree by id), partitioned by
  the day of the rows that use them: the writer writes a definition again on each new day it is used,
  so dropping a day's partitions never leaves a retained row without its definitions.
- `gpu_usage`: per pod and GPU, one row per agent window (the /api/v1/gpus history).
- `gpu_activity`: per pod and GPU, one row per agent window with exact (CUPTI) activity: known and idle
  nanoseconds, the gaps that ended in it by length bucket (gap_0 .. gap_6: plain columns, which every
  server version and both clients insert alike), the longest, records lost.
- `fleetprof_schema`: a view that holds the schema version and the content-id key. A view, because
  CREATE VIEW is atomic: of two collectors starting at once one creates it and the other reads its key.

Retention drops whole partitions (ALTER TABLE ... DROP PARTITION); queries cut at the exact horizon.

Kept to SQL that ClickHouse 18.16 (Debian's server) and 26.x (chdb) both take: no TTL (19.6+), no column
CODECs (19.x+), no LowCardinality, no Map. What a modern server could add on top is in docs/clickhouse.md.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from fleetprof.collector.store.clickhouse.connection import (
    TABLE_ALREADY_EXISTS,
    ClickHouseError,
    Connection,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
META = "fleetprof_schema"
DAY = 86400

# Row kinds in `rows` (UInt8: numpy inserts; an Enum8 goes through Python objects).
CPU, SYSCALL, HIST, MARKER = 1, 2, 3, 4

_ROWS_COLUMNS = (
    "kind UInt8, bucket Int64, lid Int64, sid Int64, freq UInt32, syscall String, i UInt8, "
    "count Int64, timed Int64, timed_ns Int64"
)
_ROLLUP_KEY = "(kind, bucket, lid, sid, freq, syscall, i)"
# `node` in the rollups only shards them as `rows` is: a batch's rollup rows inserted alone (writer.py) go to
# the shard of its rows, where 18.16 holds them back while a part of the same table there still waits for
# its quorum (which may be that very batch's, to appear once replicated). Merges may keep any row's node
# of a key; each key's label set names one node anyway.
_ROLLUP_COLUMNS = f"{_ROWS_COLUMNS}, node String"


@dataclass(frozen=True)
class Table:
    name: str
    columns: str
    engine: str  # MergeTree family name, without "Replicated"
    partition: str
    order: str
    shard_by: str  # Distributed's sharding key (cluster mode)
    engine_args: str = ""


TABLES = (
    Table("rows", f"{_ROWS_COLUMNS}, batch Int64, node String", "MergeTree", "intDiv(bucket, 86400)",
          "(kind, bucket, lid, sid)", "sipHash64(node)"),
    Table("rows_1m", _ROLLUP_COLUMNS, "SummingMergeTree", "intDiv(bucket, 86400)", _ROLLUP_KEY,
          "sipHash64(node)", "(count, timed, timed_ns)"),
    Table("rows_10m", _ROLLUP_COLUMNS, "SummingMergeTree", "intDiv(bucket, 86400)", _ROLLUP_KEY,
          "sipHash64(node)", "(count, timed, timed_ns)"),
    Table("frames", "day UInt32, id Int64, function String, module String, kernel UInt8",
          "ReplacingMergeTree", "day", "id", "intHash64(id)"),
    Table("stacks", "day UInt32, id Int64, frames Array(Int64)", "ReplacingMergeTree", "day", "id",
          "intHash64(id)"),
    Table("label_sets", "day UInt32, id Int64, labels String", "ReplacingMergeTree", "day", "id",
          "intHash64(id)"),
    Table("gpu_usage", "start Float64, end Float64, node String, namespace String, pod String, "
          "container String, gpu String, utilization Nullable(Float64), memory_bytes Nullable(Int64), "
          "idle_ratio Nullable(Float64)", "MergeTree", "intDiv(toInt64(end), 86400)", "(namespace, pod, end)",
          "sipHash64(node)"),
    Table("gpu_activity", "start Float64, end Float64, node String, namespace String, pod String, "
          "container String, gpu String, known_ns Int64, idle_ns Int64, gaps Int64, "
          + ", ".join(f"gap_{i} Int64" for i in range(7)) + ", longest_gap_ns Int64, records_lost Int64",
          "MergeTree", "intDiv(toInt64(end), 86400)", "(namespace, pod, end)", "sipHash64(node)"),
)  # fmt: skip
# Tables added to schema version 1 after it shipped: made where missing whenever a collector opens a
# database (CREATE ... IF NOT EXISTS, as every statement here), so an older database gains them.
ADDED_TABLES = ("gpu_activity",)
ROLLUPS = (("rows_1m", 60), ("rows_10m", 600))
# The views' names: `_mv` (the first, which left the markers out) is dropped where found (upgrade_ddl).
VIEW_SUFFIX, OLD_VIEW_SUFFIX = "_rollup", "_mv"


class SchemaError(Exception):
    """The database's schema cannot be used by this collector (newer version, missing key)."""


@dataclass(frozen=True)
class Layout:
    """Where each table lives: `local(name)` is written to by materialized views and dropped from by
    retention; `name` itself is read and inserted into (the Distributed table with a cluster)."""

    database: str
    cluster: str | None

    def local(self, name: str) -> str:
        return f"{self.database}.{name}_local" if self.cluster else f"{self.database}.{name}"

    def table(self, name: str) -> str:
        return f"{self.database}.{name}"

    @property
    def on_cluster(self) -> str:
        return f" ON CLUSTER {self.cluster}" if self.cluster else ""


def _table_ddl(layout: Layout, t: Table) -> str:
    db, on = layout.database, layout.on_cluster
    if layout.cluster:
        path = f"'/clickhouse/tables/{{shard}}/{db}/{t.name}', '{{replica}}'"
        engine = f"Replicated{t.engine}({path}{', ' + t.engine_args if t.engine_args else ''})"
    else:
        engine = f"{t.engine}({t.engine_args})"
    return (
        f"CREATE TABLE IF NOT EXISTS {layout.local(t.name)}{on} ({t.columns}) ENGINE = {engine} "
        f"PARTITION BY {t.partition} ORDER BY {t.order}"
    )


def _distributed_ddl(layout: Layout, t: Table) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {layout.table(t.name)}{layout.on_cluster} AS {layout.local(t.name)} "
        f"ENGINE = Distributed({layout.cluster}, {layout.database}, {t.name}_local, {t.shard_by})"
    )


def _added_ddl(layout: Layout) -> list[str]:
    """The statements that make ADDED_TABLES where they are missing."""
    added = [t for t in TABLES if t.name in ADDED_TABLES]
    return [_table_ddl(layout, t) for t in added] + (
        [_distributed_ddl(layout, t) for t in added] if layout.cluster else []
    )


def _view_ddl(layout: Layout, name: str, width: int) -> str:
    """The view that sums `rows` into the rollup `name`, markers included (the module docstring)."""
    return (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {layout.database}.{name}{VIEW_SUFFIX}{layout.on_cluster} "
        f"TO {layout.local(name)} AS SELECT kind, intDiv(bucket, {width}) * {width} AS bucket, lid, "
        f"if(kind = {MARKER}, batch, sid) AS sid, freq, syscall, i, count, timed, timed_ns, node "
        f"FROM {layout.local('rows')}"
    )


def _ddl(layout: Layout) -> list[str]:
    """Every statement that makes the schema, each idempotent (IF NOT EXISTS)."""
    out = [_table_ddl(layout, t) for t in TABLES]
    out += [_view_ddl(layout, name, width) for name, width in ROLLUPS]
    if layout.cluster:
        out += [_distributed_ddl(layout, t) for t in TABLES]
    return out


def upgrade_ddl(conn: Connection, layout: Layout) -> list[str]:
    """What brings a database of schema version 1 made before the rollups carried markers up to date: the
    views that left the markers out replaced (dropped first: a batch inserted in between misses its
    rollups, where both at once would count it twice), the rollups given `node`, and their Distributed
    tables made again sharded by it. Idempotent; empty for a database that is up to date. A batch stored
    before keeps a marker with `count` 0 in `rows`, which the writer takes as whole (writer.py)."""
    db, on = layout.database, layout.on_cluster
    tables = {name for (name,) in conn.query(f"SELECT name FROM system.tables WHERE database = '{db}'")}
    with_node = {
        name
        for (name,) in conn.query(
            f"SELECT table FROM system.columns WHERE database = '{db}' AND name = 'node'"
        )
    }
    out = []
    for name, width in ROLLUPS:
        local = layout.local(name).split(".", 1)[1]
        if f"{name}{OLD_VIEW_SUFFIX}" in tables:
            out.append(f"DROP TABLE IF EXISTS {db}.{name}{OLD_VIEW_SUFFIX}{on}")
        if local not in with_node:
            out.append(f"ALTER TABLE {layout.local(name)}{on} ADD COLUMN node String")
        if f"{name}{VIEW_SUFFIX}" not in tables:
            out.append(_view_ddl(layout, name, width))
        if layout.cluster and name in tables and name not in with_node:
            table = next(t for t in TABLES if t.name == name)
            out += [f"DROP TABLE IF EXISTS {layout.table(name)}{on}", _distributed_ddl(layout, table)]
    return out


@dataclass(frozen=True)
class Schema:
    version: int
    content_key: bytes


def _read_meta(conn: Connection, layout: Layout) -> Schema | None:
    exists = conn.query(
        f"SELECT count() FROM system.tables WHERE database = '{layout.database}' AND name = '{META}'"
    )
    if not exists[0][0]:
        return None
    version, key = conn.query(f"SELECT version, content_key FROM {layout.database}.{META}")[0]
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raise SchemaError(f"{layout.database}.{META} holds no content-id key (hex): {key!r}") from None
    return Schema(int(version), raw)


def ensure_schema(conn: Connection, layout: Layout) -> Schema:
    """The database's schema, made first where it is missing. Raises SchemaError for a schema this
    collector cannot use, ClickHouseError for what the server refused (rights, cluster)."""
    conn.query(f"CREATE DATABASE IF NOT EXISTS {layout.database}{layout.on_cluster}")
    found = _read_meta(conn, layout)
    if found is not None:
        if found.version > SCHEMA_VERSION:
            raise SchemaError(
                f"the database {layout.database} holds fleetprof schema version {found.version}, newer than "
                f"this collector's {SCHEMA_VERSION}: run a collector of the version that made it (or newer)"
            )
        # Older versions would be migrated here, each step idempotent; version 1 is the first. Tables
        # added to it since are made where missing, and what changed in it since is brought up to date.
        for statement in _added_ddl(layout) + upgrade_ddl(conn, layout):
            conn.query(statement)
        return found
    for statement in _ddl(layout):
        conn.query(statement)
    key = secrets.token_bytes(32)
    try:
        # Last: its presence says the schema is whole. Of collectors racing here, one view wins and
        # the others read its key below.
        conn.query(
            f"CREATE VIEW {layout.database}.{META}{layout.on_cluster} AS SELECT "
            f"toUInt32({SCHEMA_VERSION}) AS version, '{key.hex()}' AS content_key"
        )
        log.info("made the fleetprof schema (version %d) in %s", SCHEMA_VERSION, layout.database)
    except ClickHouseError as err:
        if err.code != TABLE_ALREADY_EXISTS and "already exists" not in str(err):
            raise
    found = _read_meta(conn, layout)
    if found is None:
        raise SchemaError(f"{layout.database}.{META} was made but cannot be read")
    return found
