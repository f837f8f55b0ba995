"""The frames ingest has decoded, found a column at a time: a batch's new stacks cost numpy passes, not a
string read, a hash and a dict lookup per frame."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fleetprof.collector.model.id_index import IdIndex, with_room
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey

# As Pyroscope's max_profile_symbol_value_length: a longer function or module name is cut (ending in "…")
# before it is kept, so what one frame can pin in memory is bounded whatever an agent sends. The longest
# demangled C++ names met in practice are a few KB.
MAX_SYMBOL_CHARS = 65_535


def _cut(text: str) -> str:
    return text if len(text) <= MAX_SYMBOL_CHARS else text[: MAX_SYMBOL_CHARS - 1] + "…"


class FrameTable:
    """Every distinct (function, module, kernel) met so far, by slot: its shared FrameKey and content id.

    Strings get slots by content (one dict lookup per string the batch's new frames use; the rest of its
    string table is never kept, so a batch full of strings no frame uses, or one refused later, pins
    nothing), and a frame is found by the code (function's string slot, module's string slot, kernel) in
    an IdIndex, so looking up every frame of a batch's new stacks is a few numpy passes. Only frames never
    met before are interned one by one (in the ContentIds, collector/model/ids.py). When the string slots
    reach MAX_STRINGS, or their text MAX_STRING_CHARS, everything starts over (stacks decoded earlier keep
    their FrameKeys). Not thread-safe: its owner locks.
    """

    MAX_STRINGS = 1 << 20  # string slots stay below 2**31, so a frame code fits in an int64
    MAX_STRING_CHARS = 256 << 20

    def __init__(self, ids: ContentIds) -> None:
        self._content_ids = ids
        self._start_over()

    def _start_over(self) -> None:
        self._strings: dict[str, int] = {}
        self._chars = 0  # of the strings in _strings
        self._index = IdIndex()  # frame code -> slot
        self.keys: list[FrameKey] = []  # slot -> FrameKey
        self._ids = np.zeros(1024, dtype=np.int64)  # slot -> content id

    def ids(self, slots: np.ndarray) -> np.ndarray:
        """The content ids of the frames in `slots`."""
        return self._ids[slots]

    def _string_slots(self, texts: list[str]) -> np.ndarray:
        if (
            len(self._strings) + len(texts) > self.MAX_STRINGS
            or self._chars + sum(map(len, texts)) > self.MAX_STRING_CHARS
        ):
            self._start_over()
        known = self._strings
        slots = list(map(known.get, texts))
        if None in slots:
            for i, slot in enumerate(slots):
                if slot is None:
                    if texts[i] not in known:
                        self._chars += len(texts[i])
                    slots[i] = known.setdefault(texts[i], len(known))
        return np.array(slots, dtype=np.int64)

    def slots(
        self, strings: Sequence[str], functions: np.ndarray, modules: np.ndarray, kernel: np.ndarray
    ) -> np.ndarray:
        """The slot of each frame given as columns of string-table indexes (every index < len(strings))
        and kernel flags, interning the frames met for the first time."""
        # The string ids used, marked in a table-sized column: a linear pass where np.unique sorted every
        # frame's two ids (a third of what a batch's new stacks cost).
        used_mask = np.zeros(len(strings), dtype=bool)
        used_mask[functions] = True
        used_mask[modules] = True
        used = np.flatnonzero(used_mask)
        texts = list(map(strings.__getitem__, used.tolist()))
        if max(map(len, texts)) > MAX_SYMBOL_CHARS:
            texts = list(map(_cut, texts))
        by_index = np.zeros(len(strings), dtype=np.int64)  # string id -> string slot, where used
        by_index[used] = self._string_slots(texts)
        codes = (by_index[functions] << 32) | (by_index[modules] << 1) | kernel.astype(np.int64)
        slots = self._index.get(codes)
        missing = slots < 0
        if missing.any():
            new_codes, first = np.unique(codes[missing], return_index=True)
            at = np.flatnonzero(missing)[first]
            keys, ids = self._content_ids.interned_frame_columns(
                map(texts.__getitem__, np.searchsorted(used, functions[at]).tolist()),
                map(texts.__getitem__, np.searchsorted(used, modules[at]).tolist()),
                map(bool, kernel[at].tolist()),
            )
            base = len(self.keys)
            self.keys.extend(keys)
            self._ids = with_room(self._ids, base + len(keys))
            self._ids[base : base + len(keys)] = ids
            self._index.add(new_codes, np.arange(base, base + len(keys), dtype=np.int64))
            slots[missing] = self._index.get(codes[missing])
        return slots
