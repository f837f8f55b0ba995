"""Queries over the database plus the chunks not yet committed, as if they were one table."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence

import duckdb
import numpy as np

from fleetprof.collector.model.profile import FrameKey, Labels, Stack, SyscallAgg
from fleetprof.collector.model.rows import BUCKET_S
from fleetprof.collector.model.selector import Selector, label_value
from fleetprof.collector.store.cold.chunk import Chunk, merged_columns
from fleetprof.collector.store.cold.database import Database

_CACHE_LIMIT = 1_000_000


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


class Queries:
    """Any thread: each query takes its own cursor. Definitions read once are cached (bounded)."""

    def __init__(self, db: Database):
        self._db = db
        self._stack_cache: dict[int, Stack] = {}
        self._label_cache: dict[int, Labels] = {}

    def _with_pending(self, cur: duckdb.DuckDBPyConnection, pending: Sequence[Chunk]) -> None:
        cur.register("pending_samples", merged_columns(pending))

    _RANGE = "bucket + res > $start AND bucket < $end"
    _ALL_SAMPLES = (
        "(SELECT res, bucket, lid, sid, freq, count FROM samples UNION ALL "
        f"SELECT {BUCKET_S} AS res, bucket, lid, sid, freq, count FROM pending_samples)"
    )

    def labels_of(self, lids: Iterable[int], pending: Sequence[Chunk] = ()) -> dict[int, Labels]:
        out, missing = _known(lids, self._label_cache, [c.labels for c in pending])
        if missing:
            rows = (
                self._db.cursor()
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
                self._db.cursor()
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
        cur = self._db.cursor()
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

    def per_label_stack(
        self, selector: Selector, start: float, end: float, pending: Sequence[Chunk] = ()
    ) -> list[tuple[int, int, int, int]]:
        """Samples per (label id, stack id, frequency) of matching series: what select_groups sums."""
        cur = self._db.cursor()
        self._with_pending(cur, pending)
        params = {"start": start, "end": end}
        lids, everything = self._matching_lids(cur, selector, params, pending)
        if not lids:
            return []
        where = self._RANGE
        if not everything:
            cur.register("wanted", {"lid": np.array(lids, dtype=np.int64)})
            where += " AND lid IN (SELECT lid FROM wanted)"
        return cur.execute(
            f"SELECT lid, sid, freq, sum(count)::BIGINT FROM {self._ALL_SAMPLES} WHERE {where} "
            "GROUP BY lid, sid, freq",
            params,
        ).fetchall()

    def per_label_step(
        self, selector: Selector, start: float, end: float, step_s: float, pending: Sequence[Chunk] = ()
    ) -> tuple[dict[tuple[int, float], int], int | None]:
        """Samples per (label id, step start) of matching series, and the sampling frequency that most of
        them came at. A bucket falls in the step its start is in."""
        cur = self._db.cursor()
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
            f"SELECT lid, floor(bucket / $step) * $step AS t, freq, sum(count)::BIGINT "
            f"FROM {self._ALL_SAMPLES} WHERE {where} GROUP BY lid, t, freq",
            {**params, "step": float(step_s)},
        ).fetchall()
        merged: dict[tuple[int, float], int] = defaultdict(int)
        freqs: dict[int, int] = defaultdict(int)
        for lid, t, freq, n in rows:
            merged[(lid, float(t))] += n
            freqs[freq] += n
        freq = max(freqs, key=freqs.get) if freqs else None
        return dict(merged), freq or None

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str], pending: Sequence[Chunk] = ()
    ) -> dict[tuple[str, ...], SyscallAgg]:
        cur = self._db.cursor()
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
        lo = start - BUCKET_S
        sums += [(lid, name, c, t, ns) for b, lid, name, c, t, ns in pend_sys if lo < b < end]
        hist += [(lid, name, i, n) for b, lid, name, i, n in pend_hist if lo < b < end]
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
            group = tuple(name if b == "syscall" else label_value(lb, b) for b in by)
            out.setdefault(group, SyscallAgg()).add(agg)
        return out

    def label_sets(
        self, start: float | None, end: float | None, pending: Sequence[Chunk] = ()
    ) -> list[Labels]:
        cur = self._db.cursor()
        if start is None and end is None:
            rows = cur.execute("SELECT labels FROM label_sets").fetchall()
            seen = {lb for c in pending for lb in c.labels.values()}
            seen.update(tuple(tuple(p) for p in json.loads(r[0])) for r in rows)
            return list(seen)
        self._with_pending(cur, pending)
        params = {"start": start if start is not None else -1e18, "end": end if end is not None else 1e18}
        # Label sets of samples and of syscall rows, as the hot tier (memory.py) counts them.
        lids = {
            r[0]
            for r in cur.execute(
                f"SELECT DISTINCT lid FROM {self._ALL_SAMPLES} WHERE {self._RANGE} UNION "
                f"SELECT DISTINCT lid FROM syscalls WHERE {self._RANGE}",
                params,
            ).fetchall()
        }
        lo = params["start"] - 10
        lids.update(lid for c in pending for b, lid, *_ in c.sys_rows if lo < b < params["end"])
        return list(self.labels_of(lids, pending).values())
