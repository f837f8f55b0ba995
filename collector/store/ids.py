"""Stable 64-bit content ids for frames, stacks and label sets: the same content gets the same id in every
process and after every restart, so tiers and restarts agree without a shared id allocator."""

from __future__ import annotations

import hashlib
import json
import struct

from collector.store.base import Labels, Stack


def _h64(data: bytes) -> int:
    """A signed 64-bit id (DuckDB BIGINT). 64 bits: ~3e-8 chance of any collision among 1M stacks."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


# Frame ids, memoized for the whole process: ingest computes them for new stacks and the DuckDB flusher asks
# for the same frames moments later. Keyed by (function, module, kernel) tuples, which FrameKeys are.
_FRAME_IDS: dict[tuple[str, str, bool], int] = {}
_FRAME_IDS_MAX = 1_000_000


def frame_id(function: str, module: str, kernel: bool) -> int:
    key = (function, module, kernel)
    fid = _FRAME_IDS.get(key)
    if fid is None:
        if len(_FRAME_IDS) >= _FRAME_IDS_MAX:
            _FRAME_IDS.clear()
        fid = _FRAME_IDS[key] = _h64(
            b"F"
            + function.encode("utf-8", "surrogatepass")
            + b"\0"
            + module.encode("utf-8", "surrogatepass")
            + (b"\1" if kernel else b"\0")
        )
    return fid


def frame_ids(stack: Stack) -> list[int]:
    """The ids of a stack's frames, in order."""
    ids = list(map(_FRAME_IDS.get, stack))
    return [frame_id(*f) for f in stack] if None in ids else ids  # type: ignore[return-value]


def stack_id_of_frames(frame_ids: list[int]) -> int:
    return _h64(b"S" + struct.pack(f"<{len(frame_ids)}q", *frame_ids))


def stack_id(stack: Stack) -> int:
    return stack_id_of_frames(frame_ids(stack))


def labels_json(labels: Labels) -> str:
    return json.dumps(labels, separators=(",", ":"), ensure_ascii=False)


def labels_id(labels: Labels) -> int:
    return _h64(b"L" + labels_json(labels).encode("utf-8", "surrogatepass"))
