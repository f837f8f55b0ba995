"""The recent-window store: time buckets of (label set id, stack id) → samples, in memory."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from operator import itemgetter

from collector.query.selector import Selector
from collector.store.base import Grouped, Labels, ProfileRows, Selection, Stack, SyscallAgg
from collector.store.ids import labels_id, stack_id

_FIRST, _SECOND, _COUNT = itemgetter(0), itemgetter(1), itemgetter(2)


class MemoryStore:
    """Keeps `retention_s` of data in `bucket_s` buckets. A window goes to the bucket of its midpoint.

    Buckets map (label set id, stack id) → samples, by the stable content ids ingest already computed, so a
    write is one dict update per row and each distinct stack and label set is stored once. Stacks and label
    sets outlive the buckets that used them; buckets older than the retention are dropped on write and the
    definitions they alone used are forgotten every COMPACT_EVERY expired buckets. Thread-safe: one lock,
    held briefly by writes and by the scan of a query.
    """

    COMPACT_EVERY = 30  # expired buckets between compactions (5 minutes of 10 s buckets)

    def __init__(self, retention_s: float = 3600.0, bucket_s: float = 10.0, clock=time.time):  # noqa: ANN001
        if retention_s < 15 * 60:
            raise ValueError("the recent window must keep at least 15 minutes")
        self.retention_s = retention_s
        self.bucket_s = bucket_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stacks: dict[int, Stack] = {}  # stack id (collector/store/ids.py) -> frames
        self._labels: dict[int, Labels] = {}  # label set id -> label set
        # bucket start -> {(label id, stack id): samples}
        self._buckets: dict[int, dict[tuple[int, int], int]] = {}
        # bucket start -> {(label id, syscall name): calls}
        self._sys_buckets: dict[int, dict[tuple[int, str], SyscallAgg]] = {}
        self._label_freq: dict[int, int] = {}  # label id -> frequency of its latest window
        self._label_last_seen: dict[int, float] = {}
        self._expired_since_compaction = 0

    def _bucket_of(self, t: float) -> int:
        return int(t // self.bucket_s * self.bucket_s)

    def write(self, profile: ProfileRows) -> None:
        bucket_key = self._bucket_of((profile.start + profile.end) / 2)
        rows = profile.rows
        keys = profile.keys
        if keys is None:
            keys = [(labels_id(labels), stack_id(stack)) for labels, stack, _ in rows]
        # Definitions of this window, built at C speed (maps and zips, no per-row Python).
        label_sets = dict(zip(map(_FIRST, keys), map(_FIRST, rows), strict=True))
        with self._lock:
            bucket = self._buckets.get(bucket_key)
            if bucket is None:
                bucket = self._buckets[bucket_key] = {}
            get = bucket.get
            for key, count in zip(keys, map(_COUNT, rows), strict=True):
                bucket[key] = get(key, 0) + count
            self._stacks.update(zip(map(_SECOND, keys), map(_SECOND, rows), strict=True))
            self._labels.update(label_sets)
            self._label_freq.update(dict.fromkeys(label_sets, profile.frequency_hz))
            self._label_last_seen.update(dict.fromkeys(label_sets, profile.end))
            if profile.syscalls:
                ids = {lset: lid for lid, lset in label_sets.items()}
                sys_bucket = self._sys_buckets.setdefault(bucket_key, {})
                for labels, name, agg in profile.syscalls:
                    lid = ids.get(labels)
                    if lid is None:
                        lid = ids[labels] = labels_id(labels)
                        self._labels[lid] = labels
                    key = (lid, name)
                    cur = sys_bucket.get(key)
                    if cur is None:
                        sys_bucket[key] = SyscallAgg(agg.count, agg.timed, agg.timed_ns, list(agg.hist))
                    else:
                        cur.add(agg)
            self._expire()

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
        sids: set[int] = set()
        lids: set[int] = set()
        for bucket in self._buckets.values():
            sids.update(map(_SECOND, bucket))
            lids.update(map(_FIRST, bucket))
        for sys_bucket in self._sys_buckets.values():
            lids.update(map(_FIRST, sys_bucket))
        self._stacks = {sid: self._stacks[sid] for sid in sids}
        self._labels = {lid: self._labels[lid] for lid in lids}
        self._label_freq = {lid: f for lid, f in self._label_freq.items() if lid in lids}
        self._label_last_seen = {lid: t for lid, t in self._label_last_seen.items() if lid in lids}

    def _bucket_range(self, start: float, end: float) -> list[dict[tuple[int, int], int]]:
        lo, hi = self._bucket_of(start), end
        return [b for k, b in self._buckets.items() if lo <= k <= hi]

    def _scan(self, selector: Selector, start: float, end: float, key_of_label: bool):  # noqa: ANN202
        """Samples per stack id (or per label id) of matching series, and per sampling frequency.
        Call with the lock held."""
        merged: dict[int, int] = defaultdict(int)
        freqs: dict[int, int] = defaultdict(int)
        match_cache: dict[int, bool] = {}
        labels = self._labels
        for bucket in self._bucket_range(start, end):
            for (lid, sid), count in bucket.items():
                ok = match_cache.get(lid)
                if ok is None:
                    ok = match_cache[lid] = selector.matches(dict(labels[lid]))
                if ok:
                    merged[lid if key_of_label else sid] += count
                    freqs[self._label_freq.get(lid, 0)] += count
        freq = max(freqs, key=freqs.get) if freqs else None
        return merged, freq or None

    def select(self, selector: Selector, start: float, end: float) -> Selection:
        with self._lock:
            merged, freq = self._scan(selector, start, end, key_of_label=False)
            stacks = {self._stacks[sid]: n for sid, n in merged.items()}
        return Selection(stacks, freq)

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped:
        with self._lock:
            per_label, freq = self._scan(selector, start, end, key_of_label=True)
            label_sets = {lid: dict(self._labels[lid]) for lid in per_label}
        totals: dict[tuple[str, ...], int] = defaultdict(int)
        for lid, n in per_label.items():
            labels = label_sets[lid]
            totals[tuple(labels.get(name, "") for name in by)] += n
        return Grouped(tuple(by), dict(totals), freq)

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        out: dict[tuple[str, ...], SyscallAgg] = {}
        lo = self._bucket_of(start)
        with self._lock:
            labels = self._labels
            match_cache: dict[int, dict[str, str] | None] = {}
            for key, sys_bucket in self._sys_buckets.items():
                if not lo <= key <= end:
                    continue
                for (lid, name), agg in sys_bucket.items():
                    if lid not in match_cache:
                        lb = dict(labels[lid])
                        match_cache[lid] = lb if selector.matches(lb) else None
                    lb = match_cache[lid]
                    if lb is None:
                        continue
                    group = tuple(name if b == "syscall" else lb.get(b, "") for b in by)
                    cur = out.get(group)
                    if cur is None:
                        out[group] = SyscallAgg(agg.count, agg.timed, agg.timed_ns, list(agg.hist))
                    else:
                        cur.add(agg)
        return out

    def _label_sets(self, start: float | None, end: float | None) -> list[Labels]:
        with self._lock:
            if start is None and end is None:
                return list(self._labels.values())
            lids = set()
            for bucket in self._bucket_range(start or 0.0, end if end is not None else float("inf")):
                lids.update(lid for lid, _ in bucket)
            return [self._labels[i] for i in lids]

    def label_names(self, start: float | None = None, end: float | None = None) -> list[str]:
        return sorted({k for labels in self._label_sets(start, end) for k, _ in labels})

    def label_values(self, name: str, start: float | None = None, end: float | None = None) -> list[str]:
        return sorted({v for labels in self._label_sets(start, end) for k, v in labels if k == name})

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "buckets": len(self._buckets),
                "stacks": len(self._stacks),
                "label_sets": len(self._labels),
                "entries": sum(len(b) for b in self._buckets.values()),
            }

    def close(self) -> None:
        """Nothing to make durable: the in-memory store forgets everything when the process ends."""
