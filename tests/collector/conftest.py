"""Fixtures the collector's ClickHouse tests share: one server and one chdb engine per module, each use
in a database of its own."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.support.chdb_connection import chdb_session
from tests.support.clickhouse_servers import ClickHouse, scratch


@pytest.fixture(scope="module")
def server() -> Iterator[ClickHouse]:
    """One clickhouse-server 18.16 for the module; each use gets a database of its own."""
    s = ClickHouse(scratch("clickhouse")).start()
    yield s
    s.remove()


@pytest.fixture(scope="module")
def chdb() -> Iterator[object]:
    """The process's one chdb engine, for the module; each use gets a database of its own."""
    path = scratch("chdb")
    session = chdb_session(path)
    yield session
    session.close()
    shutil.rmtree(path, ignore_errors=True)
