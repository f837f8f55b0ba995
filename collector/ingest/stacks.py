"""A batch's stacks as the agent sent them, read one way whichever form they came in: packed columns
(Batch.frame_columns and Batch.stack_columns, what agents send) or one Stack message a stack (what they sent
before, still accepted). Ingest asks how many stacks there are and, for the few new to the agent's cache,
their checked frames as columns of string ids; packed columns are read in place (np.frombuffer), so the
stacks it already knows cost neither parsing nor reading."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, repeat
from typing import NamedTuple

import numpy as np

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest import validate
from fleetprof.collector.ingest.validate import MAX_STACK_DEPTH, fail

_WIDTHS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SHAPE = np.dtype("<u2")  # the wire's StackColumns.lengths and kernel_starts


class WireFrames(NamedTuple):
    """Where the agent sent frame ids: each frame of the picked stacks as an index into the batch's frame
    table (`entries`), and the table's columns (`ids`: the agent's content ids; string ids)."""

    entries: np.ndarray
    ids: np.ndarray
    functions: np.ndarray
    modules: np.ndarray


class NewStacks(NamedTuple):
    """Stacks' frames as int64 columns of string ids (checked in range), and their shapes; `wire`: the same
    frames by the agent's frame ids, where it sent them."""

    functions: np.ndarray
    modules: np.ndarray
    lengths: np.ndarray
    kernel_starts: np.ndarray
    wire: WireFrames | None = None


class PackedStacks(NamedTuple):
    """Batch.frame_columns and Batch.stack_columns as numpy views of their bytes."""

    functions: np.ndarray
    modules: np.ndarray
    frames: np.ndarray
    lengths: np.ndarray
    kernel_starts: np.ndarray
    ids: np.ndarray | None  # the frames' content ids, where the agent sent them


def packed(batch: pb.Batch) -> bool:
    return batch.HasField("stack_columns") or batch.HasField("frame_columns")


def stack_count(batch: pb.Batch) -> int:
    """How many stacks the batch holds, in either form (check_form first)."""
    return len(batch.stack_columns.lengths) // _SHAPE.itemsize if packed(batch) else len(batch.stacks)


def _column(seq: int, data: bytes, width: int, what: str) -> np.ndarray:
    dtype = _WIDTHS.get(width)
    if dtype is None:
        fail(seq, "bad_stack", f"{what}: index_bytes is {width}, not 2 or 4")
    if len(data) % dtype.itemsize:
        fail(seq, "bad_stack", f"{what}: {len(data)} bytes is no whole number of {width}-byte entries")
    return np.frombuffer(data, dtype=dtype)


def _read(batch: pb.Batch) -> PackedStacks:
    """The packed columns, their shapes checked: whole entries, a module for each function, a kernel_start
    for each length, and the lengths adding up to the frames (what every stack's place in `frames` rests on).
    What the frames say is checked only for stacks that are decoded (new_stack_columns)."""
    seq, fc, sc = batch.sequence, batch.frame_columns, batch.stack_columns
    functions = _column(seq, fc.functions, fc.index_bytes, "frame_columns.functions")
    modules = _column(seq, fc.modules, fc.index_bytes, "frame_columns.modules")
    frames = _column(seq, sc.frames, sc.index_bytes, "stack_columns.frames")
    lengths = _column(seq, sc.lengths, 2, "stack_columns.lengths")
    kernel_starts = _column(seq, sc.kernel_starts, 2, "stack_columns.kernel_starts")
    if len(functions) != len(modules):
        fail(seq, "bad_stack", f"frame_columns have {len(functions)} functions but {len(modules)} modules")
    if len(kernel_starts) != len(lengths):
        fail(
            seq,
            "bad_stack",
            f"stack_columns have {len(lengths)} lengths but {len(kernel_starts)} kernel_starts",
        )
    total = int(lengths.sum(dtype=np.int64))
    if total != len(frames):
        fail(seq, "bad_stack", f"stack_columns' lengths add up to {total} frames, but it has {len(frames)}")
    ids = None
    if fc.ids:
        if len(fc.ids) != 8 * len(functions):
            fail(
                seq, "bad_stack", f"frame_columns have {len(fc.ids)} bytes of ids for {len(functions)} frames"
            )
        ids = np.frombuffer(fc.ids, dtype="<i8")
    return PackedStacks(functions, modules, frames, lengths, kernel_starts, ids)


def check_form(batch: pb.Batch) -> PackedStacks | None:
    """One form of stacks, and packed columns of a consistent shape; the packed columns, where they are."""
    if not packed(batch):
        return None
    if batch.stacks:
        fail(
            batch.sequence, "bad_stack", "the batch has both stacks and stack_columns: one form or the other"
        )
    return _read(batch)


def check_kernel_leaves(
    batch: pb.Batch, columns: PackedStacks | None, stack_col: np.ndarray, kind: tuple[str, str, str, int]
) -> None:
    """The stacks CUDA rows refer to (checked in range) end in their kernel: none is empty. Read from the
    batch's stacks as sent (`columns`: its packed columns as check_form read them, or None for Stack
    messages), so a known stack sent again empty is refused too."""
    row, reason, _, _ = kind
    which = np.unique(stack_col)
    if columns is not None:
        lengths = columns.lengths[which]
    else:
        lengths = np.fromiter((len(batch.stacks[k].functions) for k in which.tolist()), np.int64, len(which))
    if not lengths.all():
        k = int(which[np.flatnonzero(lengths == 0)[0]])
        i = int(np.flatnonzero(stack_col == k)[0])
        fail(
            batch.sequence,
            reason,
            f"{row} {i} refers to stack {k}, which is empty: its leaf frame must be the kernel",
        )


def new_stack_columns(
    batch: pb.Batch, nstr: int, which: list[int], columns: PackedStacks | None = None
) -> NewStacks:
    """The frames of the stacks at `which` (sorted, in range) as columns of string ids, after checking them:
    their depth, kernel_start, and every frame and string they refer to in range (BatchError otherwise)."""
    if not packed(batch):
        return _message_columns(batch.sequence, batch.stacks, nstr, which)
    seq = batch.sequence
    p = _read(batch) if columns is None else columns
    at = np.asarray(which, dtype=np.int64)
    lens = p.lengths[at].astype(np.int64)
    kernel_starts = p.kernel_starts[at].astype(np.int64)
    bad = (lens > MAX_STACK_DEPTH) | (kernel_starts > lens)
    if bad.any():
        k = which[int(np.flatnonzero(bad)[0])]
        validate.check_stack_size(seq, k, int(p.lengths[k]), int(p.kernel_starts[k]))
    ends = np.cumsum(p.lengths, dtype=np.int64)
    total = int(lens.sum())
    # Each picked stack's run of `frames`: its start, then one step a frame.
    firsts = ends[at] - lens
    refs = np.repeat(firsts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
    frame = p.frames[refs].astype(np.int64)
    over = np.flatnonzero(frame >= len(p.functions))
    if len(over):
        k = which[_stack_of(lens, int(over[0]))]
        fail(
            seq,
            "bad_stack",
            f"stack {k} refers to frame {frame[over[0]]}, but frame_columns has {len(p.functions)} frames",
        )
    fcol = p.functions[frame].astype(np.int64)
    mcol = p.modules[frame].astype(np.int64)
    over = np.flatnonzero((fcol >= nstr) | (mcol >= nstr))
    if len(over):
        first = int(over[0])
        validate.check_string(
            seq, max(fcol[first], mcol[first]), nstr, f"stack {which[_stack_of(lens, first)]}"
        )
    wire = None if p.ids is None else WireFrames(frame, p.ids, p.functions, p.modules)
    return NewStacks(fcol, mcol, lens, kernel_starts, wire)


def _stack_of(lengths: np.ndarray, frame: int) -> int:
    """Which of stacks of `lengths`, laid end to end, holds the frame at `frame`."""
    return int(np.searchsorted(np.cumsum(lengths), frame, side="right"))


def _message_columns(seq: int, stacks: Sequence[pb.Stack], nstr: int, which: list[int]) -> NewStacks:
    """new_stack_columns for Stack messages."""
    picked = list(map(stacks.__getitem__, which))
    fs = [st.functions for st in picked]
    ms = [st.modules for st in picked]
    lens = np.fromiter(map(len, fs), dtype=np.int64, count=len(fs))
    mlens = np.fromiter(map(len, ms), dtype=np.int64, count=len(ms))
    kernel_starts = np.fromiter((st.kernel_start for st in picked), dtype=np.int64, count=len(picked))
    bad = ((mlens != 0) & (mlens != lens)) | (lens > MAX_STACK_DEPTH) | (kernel_starts > lens)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        validate.check_stack_shape(seq, which[k], picked[k])
    total = int(lens.sum())
    fcol = np.fromiter(chain.from_iterable(fs), dtype=np.int64, count=total)
    if mlens.all():
        mcol = np.fromiter(chain.from_iterable(ms), dtype=np.int64, count=total)
    else:  # no modules: every frame's module is "" (string 0)
        padded = (m if len(m) else repeat(0, n) for m, n in zip(ms, lens.tolist(), strict=True))
        mcol = np.fromiter(chain.from_iterable(padded), dtype=np.int64, count=total)
    if len(fcol) and max(int(fcol.max()), int(mcol.max())) >= nstr:
        first = int(np.flatnonzero((fcol >= nstr) | (mcol >= nstr))[0])
        k = _stack_of(lens, first)
        validate.check_stack_strings(seq, which[k], stacks[which[k]], nstr)
    return NewStacks(fcol, mcol, lens, kernel_starts)


def to_messages(batch: pb.Batch) -> None:
    """Rewrite packed stacks as Stack messages, in place (the write-ahead log's rare stand-in path works on
    those). The columns' shapes were checked when the batch was accepted; a frame out of the frame table
    becomes string id len(strings), out of range, so the stand-in's checks catch it."""
    if not packed(batch):
        return
    p = _read(batch)
    nstr = len(batch.strings)
    functions = np.append(p.functions.astype(np.int64), nstr)
    modules = np.append(p.modules.astype(np.int64), nstr)
    frame = np.minimum(p.frames.astype(np.int64), len(p.functions))
    ends = np.cumsum(p.lengths, dtype=np.int64).tolist()
    fcol, mcol = functions[frame].tolist(), modules[frame].tolist()
    batch.ClearField("frame_columns")
    batch.ClearField("stack_columns")
    start = 0
    for end, ks in zip(ends, p.kernel_starts.tolist(), strict=True):
        batch.stacks.add(functions=fcol[start:end], modules=mcol[start:end], kernel_start=ks)
        start = end
