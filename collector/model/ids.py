"""Stable 64-bit content ids for frames, stacks and label sets: the same content gets the same id in every
process and after every restart, so tiers and restarts agree without a shared id allocator."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from operator import itemgetter

import numpy as np

from fleetprof.collector.model.profile import FrameKey, Labels, Stack


def _h64(data: bytes) -> int:
    """A signed 64-bit id (DuckDB BIGINT). 64 bits: ~3e-8 chance of any collision among 1M stacks."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


# Every frame once for the whole process: its shared FrameKey and its id. Ingest interns the frames of new
# stacks here and the DuckDB flusher asks for the same frames' ids moments later. Keyed by FrameKeys, so
# plain (function, module, kernel) tuples find them too (equal, and of equal hash).
_FRAMES: dict[tuple[str, str, bool], tuple[FrameKey, int]] = {}
_FRAMES_MAX = 1_000_000
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _intern(function: str, module: str, kernel: bool) -> tuple[FrameKey, int]:
    hit = _FRAMES.get((function, module, kernel))
    if hit is None:
        if len(_FRAMES) >= _FRAMES_MAX:
            _FRAMES.clear()
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
    Like any 64-bit id it is collision-resistant only for honest input (~3e-8 for any clash in 1M stacks)."""
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


def labels_json(labels: Labels) -> str:
    return json.dumps(labels, separators=(",", ":"), ensure_ascii=False)


def labels_id(labels: Labels) -> int:
    return _h64(b"L" + labels_json(labels).encode("utf-8", "surrogatepass"))
