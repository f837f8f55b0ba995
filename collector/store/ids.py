"""Stable 64-bit content ids for frames, stacks and label sets: the same content gets the same id in every
process and after every restart, so tiers and restarts agree without a shared id allocator."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from operator import itemgetter

from collector.render.tree import FrameKey
from collector.store.base import Labels, Stack


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
    return [_intern(*f) for f in frames] if None in hits else hits  # type: ignore[return-value]


def frame_id(function: str, module: str, kernel: bool) -> int:
    return _intern(function, module, kernel)[1]


def frame_ids(stack: Stack) -> list[int]:
    """The ids of a stack's frames, in order."""
    return list(map(_SECOND, interned_frames(stack)))


def stack_id_of_frames(frame_ids: list[int]) -> int:
    return _h64(b"S" + struct.pack(f"<{len(frame_ids)}q", *frame_ids))


def stack_id(stack: Stack) -> int:
    return stack_id_of_frames(frame_ids(stack))


def labels_json(labels: Labels) -> str:
    return json.dumps(labels, separators=(",", ":"), ensure_ascii=False)


def labels_id(labels: Labels) -> int:
    return _h64(b"L" + labels_json(labels).encode("utf-8", "surrogatepass"))
