"""64-bit content ids for frames, stacks and label sets, keyed: the same content gets the same id wherever
the same key is in use (a data directory keeps its key, so restarts, write-ahead log replay and the
database agree without a shared id allocator), and without the key nobody can compute an id.

Why keyed: a stack's id sums per-(frame, position) terms, which keeps new stacks cheap (numpy passes over
frame-id columns) but is the structure Wagner's generalised birthday attack needs. With public frame ids an
agent could find, in well under a second, a stack of its own with the id of another agent's stack; sent
first, it would take that id's place in every table, and the other agent's samples would read its frames.
With frame ids a keyed hash (blake2b's MAC mode) the terms are unknown pseudorandom values: an agent can
aim at no id, and an accidental clash stays the ~3e-8 per million stacks of any 64-bit id. Content ids
never leave the collector (the API and renderers speak frames and labels), so the key cannot be learnt
from them.

A ContentIds holds one key and the frames interned under it; collector/main.py makes one per process
(the data directory's key for the durable store, a random one in memory) and hands it to ingest and the
store. Ids made under another key stay valid where they were stored; the same content under two keys only
gets two ids (rows that queries merge by content), never another content's id.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable
from operator import itemgetter

import numpy as np

from fleetprof.collector.model.profile import FrameKey, Labels, Stack

KEY_BYTES = 32  # blake2b takes keys of 1..64 bytes; 16 is the least we accept


class ContentKeyError(ValueError):
    """A content-id key that cannot be used (its message names what is wrong)."""


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class ContentIds:
    """Content ids under one key (random unless given: 16 to 64 bytes), with every frame once: its shared
    FrameKey and its id. Ingest interns the frames of new stacks here and the DuckDB flusher asks for the
    same frames' ids moments later, so both get the same object. Thread-safe as far as callers need: the
    frame cache is a dict that starts over when full (a cache: starting over costs only hashing again)."""

    MAX_FRAMES = 1_000_000
    MAX_FRAME_CHARS = 256 << 20  # of their names

    def __init__(self, key: bytes | None = None) -> None:
        key = secrets.token_bytes(KEY_BYTES) if key is None else bytes(key)
        if not 16 <= len(key) <= 64:
            raise ContentKeyError(f"a content-id key has 16 to 64 bytes, not {len(key)}")
        self.key = key
        # The keyed hash's state after the key block, copied per id: keying each call anew would cost a
        # second compression per id.
        self._keyed = hashlib.blake2b(digest_size=8, key=key)
        # Keyed by FrameKeys, so plain (function, module, kernel) tuples find them too (equal, and of equal
        # hash).
        self._frames: dict[tuple[str, str, bool], tuple[FrameKey, int]] = {}
        self._frame_chars = 0

    def _h64(self, data: bytes) -> int:
        """A signed 64-bit id (DuckDB BIGINT): blake2b-64 of `data` under the key."""
        h = self._keyed.copy()
        h.update(data)
        return int.from_bytes(h.digest(), "little", signed=True)

    def _intern(self, function: str, module: str, kernel: bool) -> tuple[FrameKey, int]:
        hit = self._frames.get((function, module, kernel))
        if hit is None:
            size = len(function) + len(module)
            if len(self._frames) >= self.MAX_FRAMES or self._frame_chars + size > self.MAX_FRAME_CHARS:
                self._frames.clear()
                self._frame_chars = 0
            self._frame_chars += size
            key = FrameKey(function, module, kernel)
            hit = self._frames[key] = (
                key,
                self._h64(
                    b"F"
                    + function.encode("utf-8", "surrogatepass")
                    + b"\0"
                    + module.encode("utf-8", "surrogatepass")
                    + (b"\1" if kernel else b"\0")
                ),
            )
        return hit

    def interned_frame_count(self) -> int:
        """How many frames are interned (ingest's refused-batch test reads it before and after)."""
        return len(self._frames)

    def interned_frames(self, frames: Iterable[tuple[str, str, bool]]) -> list[tuple[FrameKey, int]]:
        """(shared FrameKey, id) of each (function, module, kernel); in C when every frame is known."""
        frames = list(frames)
        hits = list(map(self._frames.get, frames))
        if None in hits:
            for i, hit in enumerate(hits):
                if hit is None:
                    hits[i] = self._intern(*frames[i])
        return hits  # type: ignore[return-value]

    def interned_frame_columns(
        self, functions: Iterable[str], modules: Iterable[str], kernel: Iterable[bool]
    ) -> tuple[list[FrameKey], np.ndarray]:
        """The shared FrameKeys and the ids (int64 column) of frames given as three columns."""
        hits = self.interned_frames(zip(functions, modules, kernel, strict=True))
        return list(map(_FIRST, hits)), np.fromiter(map(_SECOND, hits), dtype=np.int64, count=len(hits))

    def frame_ids(self, stack: Stack) -> list[int]:
        """The ids of a stack's frames, in order."""
        return list(map(_SECOND, self.interned_frames(stack)))

    def stack_id(self, stack: Stack) -> int:
        return stack_id_of_frames(self.frame_ids(stack))

    def other_stack_id(self, content_id: int, attempt: int) -> int:
        """The `attempt`-th stand-in id for a stack whose content id some other stack already holds (ingest
        gives it a slot of its own under this id rather than merging it, see StackCache): keyed, so
        unpredictable too, and the same for the same (id, attempt)."""
        return self._h64(b"S" + content_id.to_bytes(8, "little", signed=True) + attempt.to_bytes(4, "little"))

    def labels_id(self, labels: Labels) -> int:
        return self._h64(b"L" + labels_json(labels).encode("utf-8", "surrogatepass"))


_U64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 column: every input bit flips about half the output bits."""
    x = x ^ (x >> _U64(30))
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


_POSITION_SEED, _LENGTH_SEED = _U64(0x9E3779B97F4A7C15), _U64(0xD1B54A32D192ED03)


def stack_ids_of(frame_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The content ids (int64 column) of stacks whose frames' ids are `frame_ids`, one stack after another,
    `lengths[i]` frames for stack i. Columnar, so a batch's new stacks cost numpy passes, not a hash call
    each: frame ids mixed with their position are summed per stack, and the sum is mixed with the length.
    The mixing is public and the sum gives an attacker a generalised birthday problem: it resists forgery
    only because frame ids are keyed (see the module's docstring); ~3e-8 for any clash in 1M stacks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fids = np.asarray(frame_ids, dtype=np.int64).view(_U64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    position = np.arange(len(fids), dtype=np.int64) - np.repeat(starts, lengths)
    mixed = _mix(fids ^ _mix((position.view(_U64) + _U64(1)) * _POSITION_SEED))
    sums = np.zeros(len(lengths), dtype=_U64)
    nonempty = lengths > 0
    if nonempty.any():
        sums[nonempty] = np.add.reduceat(mixed, starts[nonempty])
    return _mix(sums ^ ((lengths.view(_U64) + _U64(1)) * _LENGTH_SEED)).view(np.int64)


def stack_id_of_frames(frame_ids: list[int]) -> int:
    return int(stack_ids_of(np.array(frame_ids, dtype=np.int64), np.array([len(frame_ids)]))[0])


def labels_json(labels: Labels) -> str:
    return json.dumps(labels, separators=(",", ":"), ensure_ascii=False)
