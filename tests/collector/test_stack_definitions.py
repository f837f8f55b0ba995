"""The definitions of the stacks a store lacks, read from ingested windows (stack_definitions.py: what the
durable store's flush and the ClickHouse writer insert): every stack's frame ids in order and each new
frame's names once, whether ingest decoded the stack in that window or knew it from before."""

from __future__ import annotations

import numpy as np
import pytest

from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.model.id_index import IdIndex, distinct
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.store.stack_definitions import new_frames, stack_definitions
from tests.support.wire import BatchBuilder

IDS = ContentIds(b"s" * 32)


def window(decoder: Decoder, agent: str, seq: int, stacks: list[list[tuple[str, str]]], kernel: int = 0):
    """A batch of `stacks` (the last `kernel` frames of each in the kernel) from `agent`, decoded."""
    b = BatchBuilder("node-a", agent, seq)
    p = b.process(7, "worker", {"pod": "p-1"})
    for i, frames in enumerate(stacks):
        b.sample(p, b.stack(frames, kernel_start=len(frames) - kernel), i + 1)
    return decoder.decode(b.build())


def tables(windows: list[ProfileRows]) -> list:
    return [(w.stack_table_ids, w.stacks) for w in windows]


STACK_A = [("main", "app"), ("load", "app"), ("read", "libc.so.6")]
STACK_B = [("main", "app"), ("train", "app")]
STACK_C = [("main", "app"), ("train", "app"), ("matmul", "libtorch.so")]
STACK_D = [("main", "app"), ("idle", "app"), ("read", "libc.so.6")]
STACK_E = [("start_thread", "libc.so.6"), ("worker", "app")]  # new frames first in their stack too


@pytest.mark.parametrize("kernel", [0, 1])
def test_every_stack_is_defined_once_whether_decoded_in_its_window_or_known_before(kernel: int) -> None:
    decoder = Decoder(IDS)
    first = window(decoder, "agent-a", 1, [STACK_A, STACK_B], kernel)  # both decoded here
    # the same agent again: A and B known by wire id (not decoded), C new; another agent: all decoded
    second = window(decoder, "agent-a", 2, [STACK_A, STACK_B, STACK_C], kernel)
    third = window(decoder, "agent-b", 1, [STACK_D, STACK_B], kernel)
    assert first.stacks.decoded is not None and len(second.stacks.decoded.ids) == 1
    windows = [second, third] if kernel else [second, first, third]
    ids = distinct(np.concatenate([w.stack_table_ids for w in windows]))
    parts = stack_definitions(tables(windows), ids, IDS)
    defined = np.concatenate([p.ids for p in parts])
    assert sorted(defined.tolist()) == ids.tolist()  # each once
    content = {sid: stack for w in windows for sid, stack in w.stacks}
    for part in parts:
        ends = np.cumsum(part.lengths)
        for sid, end, n in zip(part.ids.tolist(), ends.tolist(), part.lengths.tolist(), strict=True):
            assert part.frame_ids[end - n : end].tolist() == IDS.frame_ids(content[sid])
    # with [second, third] A's definition comes from no window that decoded it: the flattened part
    assert len(parts) == (2 if kernel else 1)


def test_new_frames_are_the_ones_not_known_each_once_with_their_names() -> None:
    decoder = Decoder(IDS)
    windows = [
        window(decoder, "agent-a", 1, [STACK_A, STACK_B]),
        window(decoder, "agent-b", 1, [STACK_C, STACK_D, STACK_E]),
    ]
    windows.append(window(decoder, "agent-a", 2, [STACK_A, STACK_C]))  # A known, C decoded again
    ids = distinct(np.concatenate([w.stack_table_ids for w in windows]))
    parts = stack_definitions(tables(windows), ids, IDS)
    every = {f for w in windows for _, stack in w.stacks for f in stack}
    known_frames = [f for f in every if f.function in ("main", "read")]
    known = IdIndex()
    known.add(np.array(IDS.frame_ids(known_frames)), np.zeros(len(known_frames), np.int64))
    fids, frames = new_frames(parts, known)
    assert len(set(fids.tolist())) == len(fids) == len(frames)
    assert sorted(f.function for f in frames) == ["idle", "load", "matmul", "start_thread", "train", "worker"]
    assert fids.tolist() == IDS.frame_ids(frames)
    known.add(fids, np.zeros(len(fids), np.int64))
    none_fids, none = new_frames(parts, known)
    assert len(none_fids) == 0 and none == []
