"""The store's one face onto ClickHouse: run a query, insert columns. `NativeConnection` speaks ClickHouse's
native protocol through clickhouse-driver; tests put an in-process engine (chdb) behind the same face.

Why clickhouse-driver (native TCP) over clickhouse-connect (HTTP): it takes numpy columns for inserts
(`use_numpy`, no Python object per value), compresses blocks (LZ4), speaks TLS, fails over between hosts
(`alt_hosts`), sends id lists as external tables (no 256 KiB query-size limit), and works with every server
from 18.16 on; clickhouse-connect's handshake fails on servers before ~20.x (it reads
`system.settings.readonly`, a column they lack).

Every call takes a client from a small pool (a clickhouse-driver Client is one connection, one thread at a
time), so the writer thread and concurrent queries never wait on each other's sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fleetprof.collector.store.clickhouse.config import ClickHouseConfig

log = logging.getLogger(__name__)
# clickhouse-driver warns at every insert of an Array column (stacks' frames) that numpy does not cover it
# and that it takes the generic path; that path is the one meant.
logging.getLogger("clickhouse_driver.columns.service").setLevel(logging.ERROR)
# It also logs every failed connection attempt with a traceback; the store's own error says it once.
logging.getLogger("clickhouse_driver.connection").setLevel(logging.ERROR)

Columns = Mapping[str, "np.ndarray | Sequence[Any]"]


class ClickHouseError(Exception):
    """A call that failed; `code` is ClickHouse's error code (0 when the server was not reached)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


# ClickHouse's error codes the store acts on.
TABLE_ALREADY_EXISTS = 57
UNKNOWN_TABLE = 60
UNKNOWN_DATABASE = 81
READONLY = 164
ACCESS_DENIED = 497
NOT_ENOUGH_PRIVILEGES = 497
AUTHENTICATION_FAILED = 516
UNKNOWN_USER = 192
WRONG_PASSWORD = 193
UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE = 286
UNKNOWN_QUORUM_TIMEOUT = 319


class Connection(Protocol):
    def query(
        self, sql: str, ids: Mapping[str, np.ndarray] | None = None, settings: Mapping[str, Any] | None = None
    ) -> list[tuple]:
        """Rows of `sql`. Each entry of `ids` is a one-column table of Int64 (column `id`) the query can
        name (`x IN wanted`)."""
        ...

    def insert(self, table: str, columns: Columns, settings: Mapping[str, Any] | None = None) -> None:
        """Insert the columns (equal lengths) as one block: all of it, or (on error) none of it."""
        ...

    def close(self) -> None: ...


class NativeConnection:
    """clickhouse-driver clients (at most `size`), created when first needed."""

    def __init__(self, config: ClickHouseConfig, size: int = 8, timeout_s: float = 30.0):
        self._config = config
        self._timeout_s = timeout_s
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)

    def _client(self):  # clickhouse_driver.Client, imported late
        from clickhouse_driver import Client

        cfg = self._config
        (host, port), others = cfg.hosts[0], cfg.hosts[1:]
        kwargs: dict[str, Any] = {}
        if cfg.secure:
            kwargs.update(secure=True, verify=True)
            if cfg.ca:
                kwargs["ca_certs"] = cfg.ca
        try:
            import clickhouse_cityhash  # noqa: F401 - compression needs both
            import lz4  # noqa: F401

            kwargs["compression"] = "lz4"
        except ImportError:
            pass
        return Client(
            host,
            port=port,
            database=cfg.database,
            user=cfg.user,
            password=cfg.password,
            alt_hosts=",".join(f"{h}:{p}" for h, p in others) or None,
            connect_timeout=5,
            send_receive_timeout=self._timeout_s,
            sync_request_timeout=5,
            client_name="fleetprof-collector",
            settings={"use_numpy": True},
            **kwargs,
        )

    def _run(self, fn):
        from clickhouse_driver import errors

        self._slots.acquire()
        try:
            try:
                client = self._idle.get_nowait()
            except queue.Empty:
                client = self._client()
            try:
                result = fn(client)
            except errors.ServerException as err:
                self._idle.put(client)
                raise ClickHouseError(_first_line(err.message), err.code) from None
            except (errors.Error, OSError, EOFError) as err:
                client.disconnect()  # the connection may be half-way through a reply: start afresh
                raise ClickHouseError(f"{self._where()}: {_first_line(str(err))}") from None
            self._idle.put(client)
            return result
        finally:
            self._slots.release()

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self._config.hosts)

    def query(
        self, sql: str, ids: Mapping[str, np.ndarray] | None = None, settings: Mapping[str, Any] | None = None
    ) -> list[tuple]:
        external = [
            {
                "name": name,
                "structure": [("id", "Int64")],
                "data": [{"id": v} for v in np.asarray(a).tolist()],
            }
            for name, a in (ids or {}).items()
        ]

        def run(client) -> list[tuple]:
            # numpy results only for inserts: rows come back as Python values either way here
            rows = client.execute(
                sql, external_tables=external or None, settings={**(settings or {}), "use_numpy": False}
            )
            return [tuple(r) for r in rows]

        return self._run(run)

    def insert(self, table: str, columns: Columns, settings: Mapping[str, Any] | None = None) -> None:
        names = list(columns)
        data = [_column(columns[n]) for n in names]
        if not len(data[0]):
            return
        sql = f"INSERT INTO {table} ({', '.join(names)}) VALUES"
        # One block for the whole insert (clickhouse-driver splits at insert_block_size otherwise): a block
        # is what the server writes as a whole.
        opts = {**(settings or {}), "insert_block_size": max(len(data[0]), 1)}
        self._run(lambda client: client.execute(sql, data, columnar=True, settings=opts))

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().disconnect()
            except queue.Empty:
                return


def _column(values: np.ndarray | Sequence[Any]) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    return np.array(values, dtype=object)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line.split(", Stack trace")[0][:500]
