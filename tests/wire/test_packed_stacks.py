"""Stacks in packed columns (Batch.frame_columns, Batch.stack_columns), as agents send them, decode to the
rows the same stacks as Stack messages (as agents sent them before) decode to; wide tables take 4-byte
entries; stacks the collector knows by wire id are not read again, nor the frames of new stacks that it
knows by the agent's frame ids."""

from __future__ import annotations

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.validate import BatchError, IngestLimits
from fleetprof.collector.model.ids import ContentIds
from tests.support.wire import BatchBuilder, pack, packed_ints, stacks_of

STACKS = [
    [("main", "app"), ("work", "app"), ("read", "libc.so.6"), ("ksys_read", "[kernel]")],
    [("main", "app"), ("work", "app")],
    [],
    [(f"f{i}", "libdeep.so") for i in range(300)],
    [("ünïcødé 🔥", ""), ("a;b", "m")],
]


def batch(packed: bool, agent_id: str = "a", seq: int = 1) -> pb.Batch:
    b = BatchBuilder(agent_id=agent_id, sequence=seq)
    procs = [b.process(10 + i, f"p{i}", {"pod": f"pod-{i}"}) for i in range(3)]
    for k, frames in enumerate(STACKS):
        stack = b.stack(frames, kernel_start=3 if k == 0 else None)
        for i, p in enumerate(procs):
            b.sample(p, stack, 1 + k + 7 * i)
    return b.build(packed=packed)


def rows(decoder: Decoder, b: pb.Batch) -> list:
    return sorted((labels, stack, count) for labels, stack, count in decoder.decode(b, IngestLimits()).rows)


def test_packed_and_message_stacks_decode_to_the_same_rows() -> None:
    ids = ContentIds()
    packed, messages = batch(packed=True), batch(packed=False)
    assert packed.HasField("stack_columns") and not packed.stacks and len(messages.stacks) == len(STACKS)
    assert stacks_of(packed) == stacks_of(messages)
    assert list(packed.stack_ids) == list(messages.stack_ids)
    no_ids = batch(packed=False)
    pack(no_ids, frame_ids=False)  # frame ids are optional: names are read instead
    assert packed.frame_columns.ids and not no_ids.frame_columns.ids
    got = rows(Decoder(ids), packed)
    assert got == rows(Decoder(ids), messages) == rows(Decoder(ids), no_ids)
    assert len(got) == 3 * len(STACKS) and sum(c for _, _, c in got) == sum(
        1 + k + 7 * i for k in range(len(STACKS)) for i in range(3)
    )
    kernel = [frame.kernel for _, stack, _ in got for frame in stack if frame.function == "ksys_read"]
    assert kernel == [True] * 3


def test_tables_past_65536_entries_take_four_byte_entries() -> None:
    b = BatchBuilder()
    for i in range(70_000):  # the string table past 2**16
        b.string(f"s{i}")
    p = b.process(1, "wide")
    # 20 stacks of 3,500 frames of their own: the frame table past 2**16 too
    for k in range(20):
        b.sample(p, b.stack([(f"s{k * 3500 + i}", "m") for i in range(3500)]), k + 1)
    out = b.build()
    assert (out.frame_columns.index_bytes, out.stack_columns.index_bytes) == (4, 4)
    got = rows(Decoder(ContentIds()), out)
    assert {count: stack[-1].function for _, stack, count in got} == {
        k + 1: f"s{k * 3500 + 3499}" for k in range(20)
    }


def test_stacks_known_by_wire_id_are_not_read_again() -> None:
    decoder = Decoder(ContentIds())
    first = rows(decoder, batch(packed=True))
    again = batch(packed=True, seq=2)
    again.stack_columns.frames = packed_ints([60_000] * (len(again.stack_columns.frames) // 2))
    assert rows(decoder, again) == first  # every stack known: its frames are not looked at
    other = batch(packed=True, agent_id="b")
    other.stack_columns.frames = again.stack_columns.frames
    with pytest.raises(BatchError, match="refers to frame 60000"):  # another agent's ids: new, so checked
        decoder.decode(other, IngestLimits())


def test_frames_known_by_the_agents_frame_ids_are_not_read_again() -> None:
    """A new stack whose frames the agent sent before is found by their frame ids: here the frame table
    names other strings under the same ids, and the frames the collector knows win (as with stack ids, an
    agent that lies garbles only its own data). Another agent's ids are its own."""
    decoder = Decoder(ContentIds())
    rows(decoder, batch(packed=True))
    b = BatchBuilder(agent_id="a", sequence=2)
    p = b.process(10, "p0", {"pod": "pod-0"})
    b.sample(p, b.stack([("main", "app"), ("read", "libc.so.6")]), 5)  # a new stack of known frames
    b.sample(p, b.stack([("main", "app"), ("write", "libc.so.6")]), 6)  # and one of a new frame
    honest = b.build()
    lying = pb.Batch()
    lying.CopyFrom(honest)
    strings = list(lying.strings)
    lying.strings[strings.index("read")] = "not-read"
    lying.strings[strings.index("main")] = "not-main"
    got = {count: [f.function for f in stack] for _, stack, count in rows(decoder, lying)}
    assert got == {5: ["main", "read"], 6: ["main", "write"]}
    lying.agent.agent_id = "b"
    got = {count: [f.function for f in stack] for _, stack, count in rows(Decoder(ContentIds()), lying)}
    assert got == {5: ["not-main", "not-read"], 6: ["not-main", "write"]}
    assert {count: [f.function for f in stack] for _, stack, count in rows(decoder, lying)} == got


def test_frame_ids_must_be_eight_bytes_a_frame() -> None:
    b = batch(packed=True)
    b.frame_columns.ids = b.frame_columns.ids[:-1]
    with pytest.raises(BatchError, match=r"bytes of ids for \d+ frames"):
        Decoder(ContentIds()).decode(b, IngestLimits())
