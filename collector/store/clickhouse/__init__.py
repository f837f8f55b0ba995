"""The scale-out store: profiles in a ClickHouse database (one server, or a replicated, sharded cluster)
that many collectors share (`--clickhouse URL`). config.py reads the URL, connection.py is the one face
onto ClickHouse, schema.py makes and versions the tables, writer.py groups batches into inserts,
queries.py and gpu.py answer, retention.py drops old partitions, store.py ties them together."""

from __future__ import annotations

from fleetprof.collector.store.clickhouse.config import ClickHouseConfig, ClickHouseConfigError, parse_url
from fleetprof.collector.store.clickhouse.connection import (
    AUTHENTICATION_FAILED,
    READONLY,
    UNKNOWN_USER,
    WRONG_PASSWORD,
    ClickHouseError,
    Connection,
    NativeConnection,
)
from fleetprof.collector.store.clickhouse.schema import Layout, SchemaError
from fleetprof.collector.store.clickhouse.store import ClickHouseStore

__all__ = [
    "ClickHouseConfig",
    "ClickHouseConfigError",
    "ClickHouseStartError",
    "ClickHouseStore",
    "open_clickhouse",
    "parse_url",
]

_RIGHTS = (READONLY, 497, 291)  # readonly user, not enough privileges, database access denied
_LOGIN = (AUTHENTICATION_FAILED, UNKNOWN_USER, WRONG_PASSWORD)


class ClickHouseStartError(ValueError):
    """The collector cannot use the ClickHouse it was pointed at; the message says why and what to do."""


def _cluster_quorum(conn: Connection, config: ClickHouseConfig) -> int:
    """The insert quorum for config.cluster: as asked, else 2 (or each shard's replicas, if fewer)."""
    rows = conn.query(
        "SELECT shard_num, count() FROM system.clusters "
        f"WHERE cluster = '{config.cluster}' GROUP BY shard_num"
    )
    if not rows:
        raise ClickHouseStartError(
            f"ClickHouse at {config.describe()} has no cluster {config.cluster!r} in its remote_servers"
        )
    fewest = min(n for _, n in rows)
    if config.quorum is not None:
        if config.quorum > fewest:
            raise ClickHouseStartError(
                f"--clickhouse quorum={config.quorum}, but a shard of {config.cluster} has {fewest} replicas"
            )
        return config.quorum
    return min(2, fewest)


def open_clickhouse(
    config: ClickHouseConfig, retention_s: float, connection: Connection | None = None, **kwargs: object
) -> ClickHouseStore:
    """The store on `config`'s ClickHouse, its schema made or checked; ClickHouseStartError (one line
    naming the server and the problem) when it cannot be used."""
    conn = connection or NativeConnection(config)
    where = config.describe()
    try:
        try:
            version = conn.query("SELECT version()")[0][0]
        except ClickHouseError as err:
            if err.code in _LOGIN:
                raise ClickHouseStartError(
                    f"ClickHouse at {where} refused the login of user {config.user!r}: {err} (check the "
                    "URL's user and --clickhouse-password-file)"
                ) from None
            if err.code == 81:  # the database does not exist: make it (rights permitting) through `system`
                from dataclasses import replace

                bootstrap = NativeConnection(replace(config, database="system"), size=1)
                try:
                    bootstrap.query(
                        f"CREATE DATABASE IF NOT EXISTS {config.database}"
                        + (f" ON CLUSTER {config.cluster}" if config.cluster else "")
                    )
                finally:
                    bootstrap.close()
                version = conn.query("SELECT version()")[0][0]
            else:
                raise
        readonly = conn.query("SELECT value FROM system.settings WHERE name = 'readonly'")
        if readonly and readonly[0][0] not in ("0", 0):
            raise ClickHouseStartError(
                f"ClickHouse user {config.user!r} at {where} is read-only (readonly={readonly[0][0]}): the "
                "collector writes profiles; give it a profile with readonly=0 and rights on the database"
            )
        quorum = _cluster_quorum(conn, config) if config.cluster else 0
        store = ClickHouseStore(
            conn, Layout(config.database, config.cluster), retention_s=retention_s, quorum=quorum, **kwargs
        )
    except SchemaError as err:
        conn.close()
        raise ClickHouseStartError(f"ClickHouse at {where}: {err}") from None
    except ClickHouseError as err:
        conn.close()
        if err.code == READONLY:
            raise ClickHouseStartError(
                f"ClickHouse user {config.user!r} at {where} is read-only: the collector writes profiles; "
                f"give it a profile with readonly=0 and rights on the database ({err})"
            ) from None
        if err.code in _RIGHTS:
            raise ClickHouseStartError(
                f"ClickHouse user {config.user!r} at {where} lacks rights on database "
                f"{config.database!r}: {err}"
            ) from None
        if err.code == 0:
            raise ClickHouseStartError(f"cannot reach ClickHouse at {err} (is it running?)") from None
        raise ClickHouseStartError(f"ClickHouse at {where} refused to set up the store: {err}") from None
    store.server_version = version
    return store
