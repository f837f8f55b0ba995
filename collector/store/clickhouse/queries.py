"""Queries over ClickHouse, answered as the DuckDB store answers them (collector/store/cold/queries.py).

Which resolution answers which time: as the DuckDB store's rollup leaves its rows, computed at query time
from the clock. Buckets from `cut_1m` = (now − raw_s) on the minute are read at 10 s from `rows`, those
from `cut_10m` = (now − minute_s) on the ten minutes up to `cut_1m` at 1 min from `rows_1m`, older ones at
10 min from `rows_10m`; a bucket counts for [start, end) when it overlaps it (bucket + width > start and
bucket < end), and nothing at or past the retention horizon counts. Label sets are matched in Python
against the selector (RE2, as the other stores), then the sums are taken in ClickHouse over the matching
label ids, sent as an external table.

What makes a long range cheap (bench/README.md, "ClickHouse"): sums over a range (`per_key`: profiles, top,
group) read the whole 10 minute buckets inside it from `rows_10m` whatever their age, and only the edges
at the resolution that answers their time. The sums are the same: the materialized views put every row of
`rows` into `rows_10m` in the same insert, and a whole bucket inside the range counts whole at any
resolution. A label selector is matched against the label sets defined for the range's days (the writer
defines every label set again on each day it is used), not against a scan of the rows; with no matcher
nothing is matched at all. And sums are grouped by the one key asked for (stack or label set), with the
sampling frequency's min and max beside it: grouping by (key, frequency) cost ClickHouse 18.16 twice the
time; only when a key was sampled at two frequencies are the frequencies summed by a second query.
"""

from __future__ import annotations

import json
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetprof.collector.model.profile import FrameKey, Labels, Stack, SyscallAgg
from fleetprof.collector.model.rows import BUCKET_S
from fleetprof.collector.model.selector import Selector, label_value
from fleetprof.collector.store.clickhouse.connection import Connection
from fleetprof.collector.store.clickhouse.schema import CPU, DAY, HIST, SYSCALL, Layout

_CACHE_LIMIT = 1_000_000
COARSE_S = 600  # rows_10m's bucket width


@dataclass(frozen=True)
class RollupPolicy:
    """As collector/store/cold/maintenance.py's: how long 10 s and 1 min buckets are read before the next
    resolution answers."""

    raw_s: float = 6 * 3600.0
    minute_s: float = 3 * 86400.0


@dataclass(frozen=True)
class Tier:
    table: str
    width: int
    lo: float  # buckets at or after
    hi: float  # buckets before


def tiers(now: float, policy: RollupPolicy, horizon: float) -> list[Tier]:
    cut_1m = (now - policy.raw_s) // 60 * 60
    cut_10m = min((now - policy.minute_s) // 600 * 600, cut_1m)
    return [
        Tier("rows", BUCKET_S, cut_1m, math.inf),
        Tier("rows_1m", 60, cut_10m, cut_1m),
        Tier("rows_10m", 600, -math.inf, cut_10m),
    ]


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) else str(int(x))


class Queries:
    """Any thread. Definitions read once are cached (bounded)."""

    def __init__(
        self,
        conn: Connection,
        layout: Layout,
        settings: dict,
        clock: Callable[[], float],
        retention_s: float,
        policy: RollupPolicy,
    ):
        self._conn = conn
        self._layout = layout
        self._settings = settings
        self._clock = clock
        self._retention_s = retention_s
        self._policy = policy
        self._lock = threading.Lock()
        self._stack_cache: dict[int, Stack] = {}
        self._frame_cache: dict[int, FrameKey] = {}
        self._label_cache: dict[int, Labels] = {}

    def _q(self, sql: str, ids: dict[str, np.ndarray] | None = None) -> list[tuple]:
        return self._conn.query(sql, ids=ids, settings=self._settings)

    def source(
        self,
        kinds: Sequence[int],
        columns: str,
        start: float,
        end: float,
        coarse: bool = False,
        where: str = "",
    ) -> str | None:
        """A subquery of the rows of `kinds` whose buckets overlap [start, end), each from the resolution
        that answers its time; None when no resolution holds any (the range is past retention). With
        `coarse`, the whole 10 minute buckets inside the range come from `rows_10m` (for sums over the
        range, not per time step: their rows' buckets are the 10 minute ones). `where` is a condition
        added to every part (ClickHouse 18.16 does not push one on the union down into its parts)."""
        now = self._clock()
        horizon = now - self._retention_s
        kind = f"kind = {kinds[0]}" if len(kinds) == 1 else f"kind IN ({', '.join(map(str, kinds))})"
        if where:
            kind = f"{kind} AND {where}"
        # The whole 10 minute buckets that count whole at every resolution: inside [start, end) and not
        # past retention.
        inner_lo = math.ceil(max(start, horizon) / COARSE_S) * COARSE_S if coarse else math.inf
        inner_hi = end // COARSE_S * COARSE_S if coarse else -math.inf
        inner = inner_lo < inner_hi
        parts = []
        if inner:
            parts.append(
                f"SELECT {columns} FROM {self._layout.table('rows_10m')} WHERE {kind} "
                f"AND bucket >= {_num(inner_lo)} AND bucket < {_num(inner_hi)}"
            )
        for t in tiers(now, self._policy, horizon):
            # the tier's buckets outside the inner ones: below them, and from their end on
            pieces = ((t.lo, min(t.hi, inner_lo)), (max(t.lo, inner_hi), t.hi)) if inner else ((t.lo, t.hi),)
            for lo_b, hi_b in pieces:
                if lo_b >= hi_b:
                    continue
                lo, hi = max(lo_b, start - t.width), min(hi_b, end)
                # bucket + width > start and bucket < end, within the tier, and not past retention
                if lo >= hi or hi <= horizon - t.width:
                    continue
                cond = [kind, f"bucket + {t.width} > {_num(start)}", f"bucket < {_num(end)}"]
                cond.append(f"bucket + {t.width} > {_num(horizon)}")
                if lo_b != -math.inf:
                    cond.append(f"bucket >= {_num(lo_b)}")
                if hi_b != math.inf:
                    cond.append(f"bucket < {_num(hi_b)}")
                table = self._layout.table(t.table)
                parts.append(f"SELECT {columns} FROM {table} WHERE {' AND '.join(cond)}")
        if not parts:
            return None
        return "(" + " UNION ALL ".join(parts) + ")"

    # -- definitions ----------------------------------------------------------------------------------
    def _cached(self, cache: dict, ids: Iterable[int]) -> tuple[dict, list[int]]:
        """What `cache` holds of `ids`, and the ids it lacks (to be read from ClickHouse)."""
        out, missing = {}, []
        with self._lock:
            for i in ids:
                got = cache.get(i)
                if got is None:
                    missing.append(i)
                else:
                    out[i] = got
        return out, missing

    def labels_of(self, lids: Iterable[int]) -> dict[int, Labels]:
        out, missing = self._cached(self._label_cache, lids)
        if missing:
            rows = self._q(
                f"SELECT id, any(labels) FROM {self._layout.table('label_sets')} "
                "WHERE id IN wanted GROUP BY id",
                {"wanted": np.array(missing, dtype=np.int64)},
            )
            with self._lock:
                if len(self._label_cache) > _CACHE_LIMIT:
                    self._label_cache.clear()
                for lid, text in rows:
                    lb = tuple(tuple(p) for p in json.loads(text))
                    self._label_cache[lid] = out[lid] = lb
        return out

    def stacks_of(self, sids: Iterable[int]) -> dict[int, Stack]:
        out, missing = self._cached(self._stack_cache, sids)
        if not missing:
            return out
        rows = self._q(
            f"SELECT id, any(frames) FROM {self._layout.table('stacks')} WHERE id IN wanted GROUP BY id",
            {"wanted": np.array(missing, dtype=np.int64)},
        )
        frame_lists = {sid: list(fids) for sid, fids in rows}
        wanted_frames = {f for fids in frame_lists.values() for f in fids}
        with self._lock:
            frames = {f: self._frame_cache[f] for f in wanted_frames if f in self._frame_cache}
        need = [f for f in wanted_frames if f not in frames]
        if need:
            got = self._q(
                f"SELECT id, any(function), any(module), any(kernel) FROM {self._layout.table('frames')} "
                "WHERE id IN wanted GROUP BY id",
                {"wanted": np.array(need, dtype=np.int64)},
            )
            for fid, fn, mod, kern in got:
                frames[fid] = FrameKey(fn, mod, bool(kern))
        with self._lock:
            if len(self._stack_cache) > _CACHE_LIMIT:
                self._stack_cache.clear()
            if len(self._frame_cache) > _CACHE_LIMIT:
                self._frame_cache.clear()
            for fid in need:
                if fid in frames:
                    self._frame_cache[fid] = frames[fid]
            for sid in missing:
                st = tuple(frames[f] for f in frame_lists.get(sid, ()) if f in frames)
                out[sid] = st
                if sid in frame_lists:  # a stack of no frames is () too, and cached
                    self._stack_cache[sid] = st
        return out

    # -- sums ------------------------------------------------------------------------------------------
    def _matching_lids(self, selector: Selector, src: str) -> tuple[list[int], bool]:
        lids = [r[0] for r in self._q(f"SELECT DISTINCT lid FROM {src}")]
        if not selector.matchers:
            return lids, True
        labels = self.labels_of(lids)
        matched = [lid for lid in lids if lid in labels and selector.matches(dict(labels[lid]))]
        return matched, len(matched) == len(lids)

    def _defined_lids(self, selector: Selector, start: float, end: float) -> list[int] | None:
        """The label ids defined for the days [start, end) touches that match `selector`; None when every
        row matches (no matcher, or every defined label set matches). Every row's label set is defined for
        the day of its bucket (writer.py), so these are all the matching label ids the range can hold."""
        if not selector.matchers:
            return None
        first, last = max(0, int((start - COARSE_S) // DAY)), max(0, int(min(end, 1e15) // DAY))
        lids = [
            r[0]
            for r in self._q(
                f"SELECT DISTINCT id FROM {self._layout.table('label_sets')} "
                f"WHERE day >= {first} AND day <= {last}"
            )
        ]
        labels = self.labels_of(lids)
        matched = [lid for lid in lids if lid in labels and selector.matches(dict(labels[lid]))]
        return None if len(matched) == len(lids) else matched

    def _range_rows(
        self, selector: Selector, start: float, end: float, columns: str
    ) -> tuple[str, dict | None] | None:
        """The CPU rows of matching series over [start, end), for sums over the whole range (whole 10 minute
        buckets from rows_10m, the label ids from the days' definitions): (subquery, its query ids), or
        None when nothing can match."""
        lids = self._defined_lids(selector, start, end)
        if lids is not None and not lids:
            return None
        where, ids = ("", None) if lids is None else ("lid IN wanted", {"wanted": np.array(lids)})
        src = self.source((CPU,), columns, start, end, coarse=True, where=where)
        return None if src is None else (src, ids)

    def per_key(
        self, selector: Selector, start: float, end: float, key: str
    ) -> tuple[dict[int, int], int | None]:
        """Samples per stack id (key="sid") or label id (key="lid") of matching series, and the sampling
        frequency that most of them came at."""
        found = self._range_rows(selector, start, end, f"{key}, freq, count")
        if found is None:
            return {}, None
        src, ids = found
        rows = self._q(f"SELECT {key}, sum(count), min(freq), max(freq) FROM {src} GROUP BY {key}", ids)
        merged: dict[int, int] = {}
        freqs: dict[int, int] = defaultdict(int)
        mixed = False
        for k, n, lo, hi in rows:
            merged[k] = n
            freqs[lo] += n
            mixed = mixed or lo != hi
        if mixed:  # some key came at two frequencies: sum them apart
            freqs = defaultdict(int)
            for freq, n in self._q(f"SELECT freq, sum(count) FROM {src} GROUP BY freq", ids):
                freqs[freq] += n
        freq = max(freqs, key=freqs.get) if freqs else None
        return merged, freq or None

    def per_label_stack(
        self, selector: Selector, start: float, end: float
    ) -> list[tuple[int, int, int, int]]:
        """Samples per (label id, stack id, frequency) of matching series: what select_groups sums."""
        found = self._range_rows(selector, start, end, "lid, sid, freq, count")
        if found is None:
            return []
        src, ids = found
        return self._q(f"SELECT lid, sid, freq, sum(count) FROM {src} GROUP BY lid, sid, freq", ids)

    def per_label_step(
        self, selector: Selector, start: float, end: float, step_s: float
    ) -> tuple[dict[tuple[int, float], int], int | None]:
        src = self.source((CPU,), "lid, bucket, freq, count", start, end)
        if src is None:
            return {}, None
        lids, everything = self._matching_lids(selector, src)
        if not lids:
            return {}, None
        where, ids = ("", None) if everything else (" WHERE lid IN wanted", {"wanted": np.array(lids)})
        step = _num(float(step_s))
        rows = self._q(
            f"SELECT lid, floor(bucket / {step}) * {step} AS t, freq, sum(count) FROM {src}{where} "
            "GROUP BY lid, t, freq",
            ids,
        )
        merged: dict[tuple[int, float], int] = defaultdict(int)
        freqs: dict[int, int] = defaultdict(int)
        for lid, t, freq, n in rows:
            merged[(lid, float(t))] += n
            freqs[freq] += n
        freq = max(freqs, key=freqs.get) if freqs else None
        return dict(merged), freq or None

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        per: dict[tuple[int, str], SyscallAgg] = {}
        src = self.source((SYSCALL,), "lid, syscall, count, timed, timed_ns", start, end)
        if src is None:
            return {}
        for lid, name, c, t, ns in self._q(
            f"SELECT lid, syscall, sum(count), sum(timed), sum(timed_ns) FROM {src} GROUP BY lid, syscall"
        ):
            per.setdefault((lid, name), SyscallAgg()).add(SyscallAgg(c, t, ns))
        hsrc = self.source((HIST,), "lid, syscall, i, count", start, end)
        for lid, name, i, n in self._q(
            f"SELECT lid, syscall, i, sum(count) FROM {hsrc} GROUP BY lid, syscall, i"
        ):
            agg = per.setdefault((lid, name), SyscallAgg())
            if len(agg.hist) <= i:
                agg.hist.extend([0] * (i + 1 - len(agg.hist)))
            agg.hist[i] += n
        labels = self.labels_of({lid for lid, _ in per})
        out: dict[tuple[str, ...], SyscallAgg] = {}
        for (lid, name), agg in per.items():
            lb = dict(labels.get(lid, ()))
            if not selector.matches(lb):
                continue
            group = tuple(name if b == "syscall" else label_value(lb, b) for b in by)
            out.setdefault(group, SyscallAgg()).add(agg)
        return out

    def label_sets(self, start: float | None, end: float | None) -> list[Labels]:
        if start is None and end is None:
            rows = self._q(f"SELECT DISTINCT labels FROM {self._layout.table('label_sets')}")
            return list({tuple(tuple(p) for p in json.loads(r[0])) for r in rows})
        src = self.source(
            (CPU, SYSCALL), "lid", start if start is not None else -1e18, end if end is not None else 1e18
        )
        if src is None:
            return []
        lids = [r[0] for r in self._q(f"SELECT DISTINCT lid FROM {src}")]
        return list(self.labels_of(lids).values())
