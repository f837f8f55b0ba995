"""The frames ingest has decoded, found a column at a time: a batch's new stacks cost numpy passes, not a
string read, a hash and a dict lookup per frame."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fleetprof.collector.ingest.stacks import WireFrames
from fleetprof.collector.model.id_index import IdIndex, PerSource, with_room
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey

# As Pyroscope's max_profile_symbol_value_length: a longer function or module name is cut (ending in "…")
# before it is kept, so what one frame can pin in memory is bounded whatever an agent sends. The longest
# demangled C++ names met in practice are a few KB.
MAX_SYMBOL_CHARS = 65_535
# A kernel frame's key in a source's table: its wire id with these bits flipped, so one (function, module)
# as a user and as a kernel frame holds two slots (a lying agent can make them meet only in its own table).
_KERNEL_TWEAK = np.int64(0x5BD1E9955BD1E995)


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
    MAX_WIRE_IDS = 2_000_000  # (source, frame id) entries, all sources together

    def __init__(self, ids: ContentIds) -> None:
        self._content_ids = ids
        self._start_over()

    def _start_over(self) -> None:
        self._strings: dict[str, int] = {}
        self._texts: list[str] = []  # string slot -> text
        self._chars = 0  # of the strings in _strings
        self._index = IdIndex()  # frame code -> slot
        self.keys: list[FrameKey] = []  # slot -> FrameKey
        self._ids = np.zeros(1024, dtype=np.int64)  # slot -> content id
        # Per source, the agent's frame ids (kernel frames' tweaked) -> slots
        self._by_wire_id = PerSource(IdIndex, self.MAX_WIRE_IDS)
        self._generation = getattr(self, "_generation", 0) + 1  # counts start-overs

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
                    text = texts[i]
                    slot = known.get(text)
                    if slot is None:
                        slot = known[text] = len(self._texts)
                        self._texts.append(text)
                        self._chars += len(text)
                    slots[i] = slot
        return np.array(slots, dtype=np.int64)

    def _texts_of(self, strings: Sequence[str], string_ids: np.ndarray) -> list[str]:
        texts = list(map(strings.__getitem__, string_ids.tolist()))
        if texts and max(map(len, texts)) > MAX_SYMBOL_CHARS:
            texts = list(map(_cut, texts))
        return texts

    def wire_slots(
        self, source: str, wire: WireFrames, strings: Sequence[str], kernel: np.ndarray, again: bool = True
    ) -> np.ndarray:
        """The slot of each frame of `wire` (frame table entries, in range, with the agent's frame ids),
        user or kernel by `kernel`: the frames the source sent before are found by their ids, one columnar
        lookup; only the others have their names read (the source's table learns them)."""
        generation = self._generation
        table = self._by_wire_id.table(source)
        # One key a frame as user or kernel code: the agent's id, its kernel variant tweaked.
        keys, first, which = np.unique(
            wire.ids[wire.entries] ^ np.where(kernel, _KERNEL_TWEAK, 0),
            return_index=True,
            return_inverse=True,
        )
        slots = table.get(keys)
        miss = np.flatnonzero(slots < 0)
        if len(miss):
            at = first[miss]  # each new key's first frame
            entries = wire.entries[at]
            slots[miss] = self.slots(strings, wire.functions[entries], wire.modules[entries], kernel[at])
            if self._generation != generation:  # started over: the slots the table gave are gone with it
                if again:
                    return self.wire_slots(source, wire, strings, kernel, again=False)
                table = self._by_wire_id.table(source)
            table.add(keys[miss], slots[miss])
            self._by_wire_id.learned(source, len(miss))
        return slots[which.reshape(-1)]

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
        by_index = np.zeros(len(strings), dtype=np.int64)  # string id -> string slot, where used
        by_index[used] = self._string_slots(self._texts_of(strings, used))
        return self._code_slots(
            (by_index[functions] << 32) | (by_index[modules] << 1) | kernel.astype(np.int64)
        )

    def _code_slots(self, codes: np.ndarray) -> np.ndarray:
        """The slot of each frame code (its string slots and kernel bit), interning the codes met for the
        first time."""
        slots = self._index.get(codes)
        missing = slots < 0
        if missing.any():
            new_codes = np.unique(codes[missing])
            texts = self._texts
            keys, ids = self._content_ids.interned_frame_columns(
                map(texts.__getitem__, (new_codes >> 32).tolist()),
                map(texts.__getitem__, ((new_codes >> 1) & 0x7FFFFFFF).tolist()),
                map(bool, (new_codes & 1).tolist()),
            )
            base = len(self.keys)
            self.keys.extend(keys)
            self._ids = with_room(self._ids, base + len(keys))
            self._ids[base : base + len(keys)] = ids
            self._index.add(new_codes, np.arange(base, base + len(keys), dtype=np.int64))
            slots[missing] = self._index.get(codes[missing])
        return slots
