"""The ClickHouse store's Connection face over chdb (PyPI: ClickHouse 26.x inside this process), so the
store's SQL runs on today's engine as well as on Debian's 18.16 server. Results and inserts go through
JSON formats (tests, not speed); id lists become a temporary table of the name the query uses."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fleetprof.collector.store.clickhouse.connection import ClickHouseError, Columns

_CODE = __import__("re").compile(r"Code: (\d+)\.")


def chdb_session(path: Path):  # chdb.session.Session
    """chdb's engine is one per process: open one session and share it (databases keep stores apart)."""
    from chdb import session

    return session.Session(str(path))


class ChdbConnection:
    """Over a shared session (see chdb_session), which its owner closes."""

    _lock = threading.Lock()  # one engine in the process: one query at a time

    def __init__(self, shared) -> None:
        self._session = shared

    def _run(self, sql: str, fmt: str = "CSV") -> Any:
        try:
            return self._session.query(sql, fmt)
        except Exception as err:  # chdb raises its own error type with ClickHouse's text
            m = _CODE.search(str(err))
            raise ClickHouseError(str(err).splitlines()[0][:500], int(m.group(1)) if m else 0) from None

    def query(
        self, sql: str, ids: Mapping[str, np.ndarray] | None = None, settings: Mapping[str, Any] | None = None
    ) -> list[tuple]:
        # Settings of distributed reads mean nothing to a single engine; the query's own SQL is the point.
        with self._lock:
            for name, values in (ids or {}).items():
                self._run(f"CREATE TEMPORARY TABLE {name} (id Int64)")
                rows = "".join(f"[{int(v)}]\n" for v in np.asarray(values).tolist())
                if rows:
                    self._run(f"INSERT INTO {name} FORMAT JSONCompactEachRow\n{rows}")
            try:
                head = sql.lstrip().split(None, 1)[0].upper()
                if head not in ("SELECT", "WITH"):
                    self._run(sql)
                    return []
                out = self._run(f"{sql} SETTINGS output_format_json_quote_64bit_integers=0", "JSONCompact")
                return [tuple(r) for r in json.loads(out.bytes())["data"]]
            finally:
                for name in ids or {}:
                    self._run(f"DROP TEMPORARY TABLE IF EXISTS {name}")

    def insert(self, table: str, columns: Columns, settings: Mapping[str, Any] | None = None) -> None:
        names = list(columns)
        cols = [np.asarray(columns[n]).tolist() if isinstance(columns[n], np.ndarray) else list(columns[n])
                for n in names]  # fmt: skip
        if not cols[0]:
            return
        lines = "".join(json.dumps([_plain(v) for v in row]) + "\n" for row in zip(*cols, strict=True))
        with self._lock:
            self._run(f"INSERT INTO {table} ({', '.join(names)}) FORMAT JSONCompactEachRow\n{lines}")

    def close(self) -> None:
        """The session is its owner's to close."""


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):  # a String column given as numpy byte strings (the writer's `rows`)
        return v.decode("utf-8", "surrogatepass")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v
