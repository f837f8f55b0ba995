"""What the store tests share: a settable clock, a selector of everything, a crash, injectable disk faults."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.clickhouse import ClickHouseStore, open_clickhouse, parse_url
from fleetprof.collector.store.clickhouse.connection import NativeConnection
from fleetprof.collector.store.clickhouse.schema import Layout
from fleetprof.collector.store.durable import DurableStore, content_key
from tests.support.chdb_connection import ChdbConnection

EVERYTHING = parse_selector("{}")


def open_durable(path: Path, **kw) -> DurableStore:
    """A durable store over `path` as collector/main.py opens one: under the directory's content-id key,
    its write-ahead log replayed by a decoder under the same key."""
    ids = ContentIds(content_key(path))
    return DurableStore(path, decode=Decoder(ids).decode_payload, ids=ids, **kw)


def rows_of(store: DurableStore, payload: bytes) -> ProfileRows:
    """A batch's rows as ingest decodes them for `store` (under its content ids)."""
    return Decoder(store.ids).decode_payload(payload)


def stored_samples(store) -> int:  # any ProfileStore
    """Every sample the store holds, over all time."""
    return sum(store.select(EVERYTHING, 0, 4e9).stacks.values())


class Clock:
    """A store's clock that stands still until a test sets `t`."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def crash(store: DurableStore) -> None:
    """What kill -9 leaves: no flush, no checkpoint; the files as they are."""
    store._wal.close()
    store._db.con.close()


class Faults:
    """Switchable faults for the durable store's two seams (DurableStore's wal_write and db_fault): `wal`
    makes os.write fail (after writing `wal_partial` bytes of the record), `db_step` names the flush step
    that raises."""

    def __init__(self) -> None:
        self.wal: int | None = None  # errno to raise
        self.wal_partial = 0
        self.db_step: str | None = None
        self.db_calls: list[str] = []

    def write(self, fd: int, data: memoryview) -> int:
        if self.wal is None:
            return os.write(fd, data)
        if self.wal_partial:
            os.write(fd, data[: self.wal_partial])  # a short write lands, then the error
        raise OSError(self.wal, os.strerror(self.wal))

    def db(self, step: str) -> None:
        self.db_calls.append(step)
        if step == self.db_step:
            raise OSError(errno.EIO, f"injected I/O error at {step}")


def backend_store(backend: str, request, database: str) -> ClickHouseStore:
    """A ClickHouse store in a new `database`, without background work: on the module's server ("server",
    through open_clickhouse, as the collector opens one) or its chdb engine ("chdb") -- the fixtures of
    tests/collector/conftest.py, asked of `request` (a pytest.FixtureRequest)."""
    if backend == "server":
        url = parse_url(f"{request.getfixturevalue('server').url}/{database}")
        return open_clickhouse(url, 7 * 86400.0, connection=NativeConnection(url), background=False)
    return ClickHouseStore(
        ChdbConnection(request.getfixturevalue("chdb")), Layout(database, None), background=False
    )
