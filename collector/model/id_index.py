"""A map from 64-bit ids to small ints that answers a whole column of ids with numpy, not a dict per id."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

_NONE = np.zeros(0, dtype=np.int64)


def with_room(column: np.ndarray, size: int) -> np.ndarray:
    """`column` if it holds `size` entries, else a copy twice that long with its values (zeros after)."""
    if size <= len(column):
        return column
    grown = np.zeros(2 * size, dtype=column.dtype)
    grown[: len(column)] = column
    return grown


def distinct(column: np.ndarray) -> np.ndarray:
    """The distinct values of an int64 column, sorted. np.unique's hash table (numpy 2) is slower than a
    sort on the columns of a flush (a million ids, most repeated: 83 vs 56 ms on 900,000 frame ids)."""
    ordered = np.sort(column)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class IdIndex:
    """64-bit id -> non-negative int64 value (a dense index, a slot); -1 for ids it does not hold.

    A batch asks about thousands of ids at once and almost all are known, so lookups go to a sorted array
    (one np.searchsorted for the column) and only the ids it misses go to a dict of recent additions. The
    dict is merged into the array once it outgrows an eighth of it, so adding costs amortised O(log n)
    per id and lookups stay columnar however the index grew. Not thread-safe: its owner locks.
    """

    MERGE_AT = 4096  # the dict is merged only beyond this many ids (or an eighth of the array)
    SORT_QUERIES_ABOVE = 65_536  # keys; below, the array stays in cache and sorting the ids costs more

    __slots__ = ("_keys", "_values", "_recent")

    def __init__(self, keys: np.ndarray = _NONE, values: np.ndarray = _NONE) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self._keys, self._values = keys[order], values[order]
        self._recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._keys) + len(self._recent)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id (int64 column), -1 where the index does not hold it."""
        ids = np.asarray(ids, dtype=np.int64)
        keys = self._keys
        if len(keys):
            if len(keys) >= self.SORT_QUERIES_ABOVE and len(ids) >= 256:
                # Random probes into a large array miss the cache at every step; in order, each search
                # starts where the last ended (3,000 ids into 500,000 keys: 757 -> 367 us with the sort).
                order = np.argsort(ids)
                pos = np.empty(len(ids), dtype=np.int64)
                pos[order] = np.searchsorted(keys, ids[order])
            else:
                pos = np.searchsorted(keys, ids)
            pos[pos == len(keys)] = 0
            hit = keys[pos] == ids
            out = np.where(hit, self._values[pos], -1)
        else:
            out = np.full(len(ids), -1, dtype=np.int64)
        if self._recent:
            miss = np.flatnonzero(out < 0)
            if len(miss):
                found = [-1 if v is None else v for v in map(self._recent.get, ids[miss].tolist())]
                out[miss] = found
        return out

    def add(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Hold `ids` (ones it does not hold yet; a repeated id keeps its last value) with `values` (>= 0)."""
        self._recent.update(zip(np.asarray(ids).tolist(), np.asarray(values).tolist(), strict=True))
        if len(self._recent) > max(self.MERGE_AT, len(self._keys) // 8):
            self._merge()

    def _merge(self) -> None:
        n = len(self._recent)
        keys = np.concatenate([self._keys, np.fromiter(self._recent.keys(), dtype=np.int64, count=n)])
        values = np.concatenate([self._values, np.fromiter(self._recent.values(), dtype=np.int64, count=n)])
        # np.unique keeps an id's first occurrence: an id the array held already keeps its value
        self._keys, first = np.unique(keys, return_index=True)
        self._values = values[first]
        self._recent = {}

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values), sorted by id."""
        if self._recent:
            self._merge()
        return self._keys, self._values

    def remap(self, new_value: np.ndarray) -> None:
        """Replace each value v by new_value[v]; ids whose new value is negative are dropped."""
        keys, values = self.items()
        values = new_value[values]
        keep = values >= 0
        self._keys, self._values = keys[keep], values[keep]


class PerSource(OrderedDict):
    """Source (an agent id) -> that source's table of wire ids (an IdIndex or a dict), least recently used
    first, bounded in entries over all sources: the least recent sources' tables go first, and one source
    past a quarter of the bound starts over alone (an agent churning ids must not evict everyone else)."""

    def __init__(self, new: Callable[[], IdIndex | dict], max_entries: int) -> None:
        super().__init__()
        self._new = new
        self._max = max_entries
        self._entries = 0

    def table(self, agent_id: Hashable) -> IdIndex | dict:
        table = self.get(agent_id)
        if table is None:
            table = self[agent_id] = self._new()
        else:
            self.move_to_end(agent_id)
        return table

    def learned(self, agent_id: Hashable, added: int) -> None:
        self._entries += added
        if len(self[agent_id]) > self._max // 4:
            self._entries -= len(self.pop(agent_id))
        while self._entries > self._max and self:
            _, old = self.popitem(last=False)
            self._entries -= len(old)

    def drop_oldest(self) -> None:
        _, old = self.popitem(last=False)
        self._entries -= len(old)
