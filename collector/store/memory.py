"""The recent-window store: time buckets of (label set, stack, samples) columns in memory, for "now"."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fleetprof.collector.model.id_index import IdIndex
from fleetprof.collector.model.profile import Labels, Stack, SyscallAgg
from fleetprof.collector.model.rows import BUCKET_S, Grouped, ProfileRows, Selection, TimeSeries, contents_at
from fleetprof.collector.model.selector import Selector, label_value, names_in, values_in


class _Bucket:
    """One time bucket's rows as numpy columns of dense label and stack indexes and counts. Writes append
    a part; readers get one concatenation, made when first asked and kept until the next write."""

    MAX_PARTS = 64  # parts folded into one array beyond this, so a busy bucket stays a few arrays

    __slots__ = ("parts", "_joined")

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._joined: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, lidx: np.ndarray, sidx: np.ndarray, counts: np.ndarray) -> None:
        self.parts.append((lidx, sidx, counts))
        self._joined = None
        if len(self.parts) > self.MAX_PARTS:
            self.parts = [self.columns()]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._joined is None:
            if len(self.parts) == 1:
                self._joined = self.parts[0]
            else:
                self._joined = tuple(np.concatenate(c) for c in zip(*self.parts, strict=True))  # type: ignore[assignment]
        return self._joined  # type: ignore[return-value]

    def remap(self, label_map: np.ndarray, stack_map: np.ndarray) -> None:
        lidx, sidx, counts = self.columns()
        self.parts = [(label_map[lidx], stack_map[sidx], counts)]
        self._joined = None

    def __len__(self) -> int:
        return sum(len(p[2]) for p in self.parts)


class _Table:
    """Distinct contents (stacks or label sets) under dense indexes, looked up by stable content id."""

    __slots__ = ("index", "items")

    def __init__(self) -> None:
        self.index = IdIndex()  # content id -> dense index
        self.items: list = []  # dense index -> content

    def map(self, ids: np.ndarray, table: Sequence[tuple[int, object]]) -> np.ndarray:
        """Dense indexes for a window's (content id, content) table (`ids`: its content ids), adding what
        is new: a columnar lookup, and Python work only for the contents new to the store."""
        dense = self.index.get(ids)
        missing = np.flatnonzero(dense < 0)
        if len(missing):
            # New contents get indexes in the order the table first names them (the same content twice in
            # one table gets one index), as columns: one read of the table for all of them.
            new_ids, first, which = np.unique(ids[missing], return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            base = len(self.items)
            self.items.extend(contents_at(table, missing[first[order]]))
            dense[missing] = base + rank[which.reshape(-1)]
            self.index.add(new_ids[order], np.arange(base, base + len(order), dtype=np.int64))
        return dense

    def keep(self, used: np.ndarray) -> np.ndarray:
        """Keep only the dense indexes in `used` (sorted, unique); returns old index -> new index."""
        remap = np.full(len(self.items), -1, dtype=np.int64)
        remap[used] = np.arange(len(used), dtype=np.int64)
        self.items = [self.items[d] for d in used.tolist()]
        self.index.remap(remap)
        return remap


class _View(NamedTuple):
    lidx: np.ndarray
    sidx: np.ndarray
    counts: np.ndarray
    label_dicts: list[dict[str, str]]  # dense label index -> the set as a dict
    label_freq: list[int]  # dense label index -> frequency of its latest window
    stacks: list[Stack]  # dense stack index -> stack


class MemoryStore:
    """Keeps `retention_s` of data in `bucket_s` buckets. A window goes to the bucket of its midpoint.

    Stacks and label sets are stored once each, under dense indexes; a bucket holds numpy columns of
    (label index, stack index, samples), so a write appends three arrays and a query is a few numpy
    passes (mask the matching label sets, bincount by stack) whatever the number of rows. Buckets older
    than the retention are dropped on write, and the stacks and label sets they alone used are forgotten
    every COMPACT_EVERY expired buckets. Thread-safe: one lock, held by writes and while a query takes
    its view (the matching and the sums run without it).
    """

    COMPACT_EVERY = 30  # expired buckets between compactions (5 minutes of 10 s buckets)

    def __init__(self, retention_s: float = 3600.0, bucket_s: float = BUCKET_S, clock=time.time):
        if retention_s < 15 * 60:
            raise ValueError("the recent window must keep at least 15 minutes")
        self.retention_s = retention_s
        self.bucket_s = bucket_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stacks = _Table()
        self._labels = _Table()
        self._label_dicts: list[dict[str, str]] = []  # dense label index -> the set as a dict (matching)
        self._label_freq: list[int] = []  # dense label index -> frequency of its latest window
        self._buckets: dict[int, _Bucket] = {}
        # bucket start -> {(dense label index, syscall name): calls}
        self._sys_buckets: dict[int, dict[tuple[int, str], SyscallAgg]] = {}
        self._expired_since_compaction = 0

    def _bucket_of(self, t: float) -> int:
        return int(t // self.bucket_s * self.bucket_s)

    def _label_map(self, ids: np.ndarray, table: Sequence[tuple[int, Labels]], freq: int) -> np.ndarray:
        dense = self._labels.map(ids, table)
        dicts, freqs = self._label_dicts, self._label_freq
        for d, (_, labels) in zip(dense.tolist(), table, strict=True):
            if d == len(dicts):
                dicts.append(dict(labels))
                freqs.append(freq)
            else:
                freqs[d] = freq
        return dense

    def write(self, profile: ProfileRows) -> None:
        bucket_key = self._bucket_of((profile.start + profile.end) / 2)
        with self._lock:
            label_map = self._label_map(profile.label_table_ids, profile.label_sets, profile.frequency_hz)
            if len(profile.counts):
                stack_map = self._stacks.map(profile.stack_table_ids, profile.stacks)
                bucket = self._buckets.get(bucket_key)
                if bucket is None:
                    bucket = self._buckets[bucket_key] = _Bucket()
                bucket.add(label_map[profile.label_index], stack_map[profile.stack_index], profile.counts)
            if profile.syscalls:
                self._write_syscalls(bucket_key, profile, label_map)
            self._expire()

    def _write_syscalls(self, bucket_key: int, profile: ProfileRows, label_map: np.ndarray) -> None:
        dense = {lset: int(d) for (_, lset), d in zip(profile.label_sets, label_map, strict=True)}
        sys_bucket = self._sys_buckets.setdefault(bucket_key, {})
        for labels, name, agg in profile.syscalls:
            key = (dense[labels], name)  # a syscall row's label set is in the window's table
            cur = sys_bucket.get(key)
            if cur is None:
                sys_bucket[key] = SyscallAgg(agg.count, agg.timed, agg.timed_ns, list(agg.hist))
            else:
                cur.add(agg)

    def _expire(self) -> None:
        horizon = self._bucket_of(self._clock() - self.retention_s)
        expired = [k for k in self._buckets if k < horizon]
        for key in expired:
            del self._buckets[key]
        for key in [k for k in self._sys_buckets if k < horizon]:
            del self._sys_buckets[key]
        if expired:
            self._expired_since_compaction += len(expired)
            # Stacks and label sets outlive the buckets that used them (pids churn): keep only what is
            # still referenced, at most once per COMPACT_EVERY expired buckets.
            if self._expired_since_compaction >= self.COMPACT_EVERY:
                self._compact()

    def _compact(self) -> None:
        self._expired_since_compaction = 0
        cols = [b.columns() for b in self._buckets.values()]
        sys_lids = [d for sb in self._sys_buckets.values() for d, _ in sb]
        used_labels = np.unique(np.concatenate([c[0] for c in cols] + [np.array(sys_lids, dtype=np.int64)]))
        used_stacks = np.unique(np.concatenate([c[1] for c in cols] + [np.zeros(0, dtype=np.int64)]))
        kept = used_labels.tolist()
        self._label_dicts = [self._label_dicts[d] for d in kept]
        self._label_freq = [self._label_freq[d] for d in kept]
        label_map, stack_map = self._labels.keep(used_labels), self._stacks.keep(used_stacks)
        for b in self._buckets.values():
            b.remap(label_map, stack_map)
        for key, sb in self._sys_buckets.items():
            self._sys_buckets[key] = {(int(label_map[d]), name): agg for (d, name), agg in sb.items()}

    def _columns(self, start: float, end: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo = self._bucket_of(start)
        cols = [b.columns() for k, b in self._buckets.items() if lo <= k < end]
        if not cols:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        if len(cols) == 1:
            return cols[0]
        return tuple(np.concatenate(c) for c in zip(*cols, strict=True))  # type: ignore[return-value]

    def _view(self, start: float, end: float) -> _View:
        """The rows in range and the tables they index, taken under the lock; read without it. Columns are
        never changed in place and compaction makes new tables, so the view stays whole while writes go
        on: a query's matching (a regex can take a while) and sums never hold up ingest."""
        with self._lock:
            lidx, sidx, counts = self._columns(start, end)
            return _View(lidx, sidx, counts, self._label_dicts, self._label_freq, self._stacks.items)

    @staticmethod
    def _keep(selector: Selector, v: _View) -> np.ndarray | None:
        """Per row of the view, whether its label set matches (None: the selector matches everything)."""
        if not selector.matchers:
            return None
        ok = np.zeros(len(v.label_dicts), dtype=bool)
        dicts, matches = v.label_dicts, selector.matches
        for d in np.unique(v.lidx).tolist():
            ok[d] = matches(dicts[d])
        return ok[v.lidx]

    @classmethod
    def _matching_rows(cls, selector: Selector, v: _View) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(label index, stack index, count) columns of the view's rows whose label set matches."""
        keep = cls._keep(selector, v)
        if keep is None:
            return v.lidx, v.sidx, v.counts
        return v.lidx[keep], v.sidx[keep], v.counts[keep]

    @staticmethod
    def _frequency(label_freq: Sequence[int], lidx: np.ndarray, counts: np.ndarray) -> int | None:
        """The sampling frequency most of these samples came at."""
        if not len(counts):
            return None
        per_label = np.bincount(lidx, weights=counts)
        freqs: dict[int, float] = {}
        for d in np.flatnonzero(per_label).tolist():
            f = label_freq[d]
            freqs[f] = freqs.get(f, 0.0) + per_label[d]
        return max(freqs, key=freqs.__getitem__) or None

    def select(self, selector: Selector, start: float, end: float) -> Selection:
        v = self._view(start, end)
        lidx, sidx, counts = self._matching_rows(selector, v)
        # float64 sums are exact below 2**53 samples per stack
        per_stack = np.bincount(sidx, weights=counts)
        nz = np.flatnonzero(per_stack)
        items = v.stacks
        stacks: dict[Stack, int] = {}
        for d, n in zip(nz.tolist(), per_stack[nz].astype(np.int64).tolist(), strict=True):
            st = items[d]
            stacks[st] = stacks.get(st, 0) + n
        return Selection(stacks, self._frequency(v.label_freq, lidx, counts))

    def select_groups(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], Selection]:
        v = self._view(start, end)
        lidx, sidx, counts = self._matching_rows(selector, v)
        if not len(counts):
            return {}
        # Each label set in view to its group (numbered in order of first label index, as select's
        # frequency counts them), then one bincount over (group, stack) pairs.
        sets, set_of = np.unique(lidx, return_inverse=True)
        numbers: dict[tuple[str, ...], int] = {}
        dicts = v.label_dicts
        group_of_set = np.fromiter(
            (
                numbers.setdefault(tuple(label_value(dicts[d], name) for name in by), len(numbers))
                for d in sets.tolist()
            ),
            dtype=np.int64,
            count=len(sets),
        )
        width = len(v.stacks)
        pairs, pair_of = np.unique(group_of_set[set_of] * width + sidx, return_inverse=True)
        per_pair = np.bincount(pair_of, weights=counts).astype(np.int64)  # exact below 2**53
        per_set = np.bincount(set_of, weights=counts)
        keys = list(numbers)
        merged: list[dict[Stack, int]] = [{} for _ in keys]
        items = v.stacks
        for pair, n in zip(pairs.tolist(), per_pair.tolist(), strict=True):
            g, d = divmod(pair, width)
            st = items[d]
            merged[g][st] = merged[g].get(st, 0) + n
        freqs: list[dict[int, float]] = [{} for _ in keys]
        for d, g, n in zip(sets.tolist(), group_of_set.tolist(), per_set.tolist(), strict=True):
            f = v.label_freq[d]
            freqs[g][f] = freqs[g].get(f, 0.0) + n
        return {
            key: Selection(merged[g], max(freqs[g], key=freqs[g].__getitem__) or None)
            for g, key in enumerate(keys)
        }

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        totals: dict[tuple[str, ...], int] = {}
        v = self._view(start, end)
        lidx, _, counts = self._matching_rows(selector, v)
        per_label = np.bincount(lidx, weights=counts)
        nz = np.flatnonzero(per_label)
        for d, n in zip(nz.tolist(), per_label[nz].astype(np.int64).tolist(), strict=True):
            lb = v.label_dicts[d]
            key = tuple(label_value(lb, name) for name in by)
            totals[key] = totals.get(key, 0) + n
        return Grouped(tuple(by), totals, self._frequency(v.label_freq, lidx, counts))

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        lo = self._bucket_of(start)
        with self._lock:
            parts = [(k, b.columns()) for k, b in self._buckets.items() if lo <= k < end]
            tables = (self._label_dicts, self._label_freq, self._stacks.items)
        if not parts:
            return TimeSeries(tuple(by), step_s, {}, None)
        lidx, sidx, counts = (np.concatenate(c) for c in zip(*(c for _, c in parts), strict=True))
        bucket = np.concatenate([np.full(len(c[2]), k, dtype=np.int64) for k, c in parts])
        v = _View(lidx, sidx, counts, *tables)
        keep = self._keep(selector, v)
        if keep is not None:
            lidx, counts, bucket = lidx[keep], counts[keep], bucket[keep]
        points: dict[tuple[str, ...], dict[float, int]] = {}
        steps = bucket // step_s * step_s
        at, step_of = np.unique(steps, return_inverse=True)
        ls, label_of = np.unique(lidx, return_inverse=True)
        sums = np.bincount(label_of * len(at) + step_of, weights=counts, minlength=len(ls) * len(at))
        dicts = v.label_dicts
        times = at.tolist()
        for i, d in enumerate(ls.tolist()):
            row = sums[i * len(at) : (i + 1) * len(at)]
            nz = np.flatnonzero(row)
            if not len(nz):
                continue
            lb = dicts[d]
            series = points.setdefault(tuple(label_value(lb, name) for name in by), {})
            for j, n in zip(nz.tolist(), row[nz].astype(np.int64).tolist(), strict=True):
                t = float(times[j])
                series[t] = series.get(t, 0) + n
        return TimeSeries(tuple(by), step_s, points, self._frequency(v.label_freq, lidx, counts))

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        lo = self._bucket_of(start)
        # Rows are summed into copies under the lock (SyscallAgg rows grow in place); the label sets are
        # matched without it, then the groups that matched are kept.
        per_set: dict[tuple[int, str], SyscallAgg] = {}
        with self._lock:
            dicts = self._label_dicts
            for key, sys_bucket in self._sys_buckets.items():
                if not lo <= key < end:
                    continue
                for row, agg in sys_bucket.items():
                    cur = per_set.get(row)
                    if cur is None:
                        per_set[row] = SyscallAgg(agg.count, agg.timed, agg.timed_ns, list(agg.hist))
                    else:
                        cur.add(agg)
        matching = {d: selector.matches(dicts[d]) for d in {d for d, _ in per_set}}
        out: dict[tuple[str, ...], SyscallAgg] = {}
        for (d, name), agg in per_set.items():
            if not matching[d]:
                continue
            lb = dicts[d]
            group = tuple(name if b == "syscall" else label_value(lb, b) for b in by)
            cur = out.get(group)
            if cur is None:
                out[group] = agg
            else:
                cur.add(agg)
        return out

    def _label_sets(self, start: float | None, end: float | None) -> list[Labels]:
        with self._lock:
            items = self._labels.items
            if start is None and end is None:
                return list(items)
            lo, hi = start or 0.0, end if end is not None else float("inf")
            used = set(np.unique(self._columns(lo, hi)[0]).tolist())
            lo_key = self._bucket_of(lo)
            for key, sb in self._sys_buckets.items():
                if lo_key <= key < hi:
                    used.update(d for d, _ in sb)
            return [items[d] for d in used]

    def label_names(
        self, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return names_in(self._label_sets(start, end), match)

    def label_values(
        self, name: str, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        return values_in(self._label_sets(start, end), name, match)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "buckets": len(self._buckets),
                "stacks": len(self._stacks.items),
                "label_sets": len(self._labels.items),
                "entries": sum(len(b) for b in self._buckets.values()),
            }

    def close(self) -> None:
        """Nothing to make durable: the in-memory store forgets everything when the process ends."""
