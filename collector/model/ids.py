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

The key is the process's, set by `use_key`: the durable store sets its data directory's key when it opens
(collector/store/durable.py), and without one a random key per process serves the in-memory store. Ids
made under another key stay valid where they were stored; the same content under two keys only gets two
ids (rows that queries merge by content), never another content's id.
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


# The key in use (random per process until a data directory's replaces it) and the keyed hash's state
# after the key block, copied per id: keying each call anew would cost a second compression per id.
_key_in_use = secrets.token_bytes(KEY_BYTES)
_keyed = hashlib.blake2b(digest_size=8, key=_key_in_use)
_generation = 0  # how many times the key changed: caches of ids (ingest's) start over when it moves


def use_key(key: bytes) -> None:
    """Compute every id from now on under `key` (16 to 64 bytes). The frame ids computed under another key
    are forgotten here, and ingest's caches start over at their next batch (`key_generation`). Meant for
    a process's start, before ingest: a batch decoded while the key changes may hold ids of both keys
    (which only ever duplicates content under two ids, see above)."""
    global _keyed, _key_in_use, _generation, _frames_chars
    if not 16 <= len(key) <= 64:
        raise ContentKeyError(f"a content-id key has 16 to 64 bytes, not {len(key)}")
    if key != _key_in_use:
        _keyed, _key_in_use = hashlib.blake2b(digest_size=8, key=key), bytes(key)
        _generation += 1
        _FRAMES.clear()
        _frames_chars = 0


def key_generation() -> int:
    """Changes whenever the key does: a cache of ids made under the key compares it to know they hold."""
    return _generation


def _h64(data: bytes) -> int:
    """A signed 64-bit id (DuckDB BIGINT): blake2b-64 of `data` under the process's key."""
    h = _keyed.copy()
    h.update(data)
    return int.from_bytes(h.digest(), "little", signed=True)


# Every frame once for the whole process: its shared FrameKey and its id under the key in use. Ingest
# interns the frames of new stacks here and the DuckDB flusher asks for the same frames' ids moments later.
# Keyed by FrameKeys, so plain (function, module, kernel) tuples find them too (equal, and of equal hash).
_FRAMES: dict[tuple[str, str, bool], tuple[FrameKey, int]] = {}
_FRAMES_MAX = 1_000_000
_FRAMES_MAX_CHARS = 256 << 20  # of their names: a cache, so starting over costs only hashing again
_frames_chars = 0
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _intern(function: str, module: str, kernel: bool) -> tuple[FrameKey, int]:
    global _frames_chars
    hit = _FRAMES.get((function, module, kernel))
    if hit is None:
        size = len(function) + len(module)
        if len(_FRAMES) >= _FRAMES_MAX or _frames_chars + size > _FRAMES_MAX_CHARS:
            _FRAMES.clear()
            _frames_chars = 0
        _frames_chars += size
        key = FrameKey(function, module, kernel)
        hit = _FRAMES[key] = (
            key,
            _h64(
                b"F"
                + function.encode("utf-8", "surrogatepass")
                + b"\0"
                + module.encode("utf-8", "surrogatepass")
                + (b"\1" if kernel else b"\0")
            ),
        )
    return hit


def interned_frame_count() -> int:
    """How many frames are interned (ingest's refused-batch test reads it before and after)."""
    return len(_FRAMES)


def interned_frames(frames: Iterable[tuple[str, str, bool]]) -> list[tuple[FrameKey, int]]:
    """(shared FrameKey, id) of each (function, module, kernel); in C when every frame is known."""
    frames = list(frames)
    hits = list(map(_FRAMES.get, frames))
    if None in hits:
        for i, hit in enumerate(hits):
            if hit is None:
                hits[i] = _intern(*frames[i])
    return hits  # type: ignore[return-value]


def interned_frame_columns(
    functions: Iterable[str], modules: Iterable[str], kernel: Iterable[bool]
) -> tuple[list[FrameKey], np.ndarray]:
    """The shared FrameKeys and the ids (int64 column) of frames given as three columns."""
    hits = interned_frames(zip(functions, modules, kernel, strict=True))
    return list(map(_FIRST, hits)), np.fromiter(map(_SECOND, hits), dtype=np.int64, count=len(hits))


def frame_ids(stack: Stack) -> list[int]:
    """The ids of a stack's frames, in order."""
    return list(map(_SECOND, interned_frames(stack)))


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


def stack_id(stack: Stack) -> int:
    return stack_id_of_frames(frame_ids(stack))


def other_stack_id(content_id: int, attempt: int) -> int:
    """The `attempt`-th stand-in id for a stack whose content id some other stack already holds (ingest
    gives it a slot of its own under this id rather than merging it, see StackCache): keyed, so
    unpredictable too, and the same for the same (id, attempt)."""
    return _h64(b"S" + content_id.to_bytes(8, "little", signed=True) + attempt.to_bytes(4, "little"))


def labels_json(labels: Labels) -> str:
    return json.dumps(labels, separators=(",", ":"), ensure_ascii=False)


def labels_id(labels: Labels) -> int:
    return _h64(b"L" + labels_json(labels).encode("utf-8", "surrogatepass"))
