"""Ingest remembers stacks by the agent's wire id and label sets by content: known stacks are not decoded or
checked again, yet every agent's rows are exactly what it sent and bad batches are still refused by name."""

from __future__ import annotations

import time
import tracemalloc

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import stack_wire_id
from fleetprof.collector.ingest.decode import Decoder, decode_batch
from fleetprof.collector.ingest.frames import MAX_SYMBOL_CHARS
from fleetprof.collector.ingest.validate import BatchError, IngestLimits
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey
from tests.conftest import RunningCollector, http_get
from tests.support.wire import make_batch, pack, packed_ints, push, unpack

NOW = time.time_ns()
IDS = ContentIds()  # one key for the module: a decoder's ids and decode_batch's agree under it


def batch_of(
    stacks: list[tuple[list[str], int]],
    agent_id: str = "agent-a",
    node: str = "node-a",
    seq: int = 1,
    shuffle: bool = False,
    gpu: int = 0,
    process_id: int = 77,
    packed: bool = False,
) -> pb.Batch:
    """Sample i is i + 1 samples of stack i, of ([function, ...], wire id); `shuffle` reverses the string
    table's order. One process, pid 7, under the wire id `process_id`."""
    names = sorted({f for fs, _ in stacks for f in fs} | {"mod", "worker", "pod", "p-1"}, reverse=shuffle)
    strings = ["", *names]
    ix = {s: i for i, s in enumerate(strings)}
    b = pb.Batch(
        agent=pb.AgentIdentity(node=node, agent_id=agent_id),
        sequence=seq,
        start_unix_ns=NOW - 10**10,
        end_unix_ns=NOW,
        frequency_hz=19,
        strings=strings,
    )
    b.processes.append(
        pb.Process(pid=7, comm=ix["worker"], labels=[pb.Label(name=ix["pod"], value=ix["p-1"])])
    )
    b.process_ids.append(process_id)
    cols = b.sample_columns
    for i, (fs, wire_id) in enumerate(stacks):
        b.stacks.append(
            pb.Stack(functions=[ix[f] for f in fs], modules=[ix["mod"]] * len(fs), kernel_start=len(fs))
        )
        b.stack_ids.append(wire_id)
        cols.process.append(0)
        cols.stack.append(i)
        cols.count.append(i + 1)
        if gpu:
            cols.gpu.append(gpu)
    if packed:
        pack(b)
    return b


def frames(*names: str) -> tuple[FrameKey, ...]:
    return tuple(FrameKey(n, "mod") for n in names)


STACKS = [(["main", "a"], 11), (["main", "b", "c"], 12), (["main"], 13)]


def test_rows_are_the_same_for_new_and_for_known_stacks() -> None:
    plain = decode_batch(batch_of(STACKS), IDS)
    decoder = Decoder(IDS)
    first = decoder.decode(batch_of(STACKS))
    # The next window interns its strings in another order: known stacks are found by id, not index.
    again = decoder.decode(batch_of(STACKS, seq=2, shuffle=True))
    assert list(plain.rows) == list(first.rows) == list(again.rows)
    assert list(plain.label_ids()) == list(first.label_ids()) == list(again.label_ids())
    assert list(plain.stack_ids()) == list(first.stack_ids()) == list(again.stack_ids())
    assert [st for _, st, _ in again.rows] == [frames("main", "a"), frames("main", "b", "c"), frames("main")]


def test_one_agents_wire_ids_do_not_touch_another_agents_stacks() -> None:
    decoder = Decoder(IDS)
    decoder.decode(batch_of([(["x", "y"], 99)], agent_id="agent-a"))
    # The same id from another agent means another stack: it is decoded from its own strings.
    rows = decoder.decode(batch_of([(["p", "q", "r"], 99)], agent_id="agent-b", node="node-b")).rows
    assert [st for _, st, _ in rows] == [frames("p", "q", "r")]
    rows = decoder.decode(batch_of([(["x", "y"], 99)], agent_id="agent-a", seq=2)).rows
    assert [st for _, st, _ in rows] == [frames("x", "y")]


def test_a_bad_new_stack_is_refused_and_not_remembered() -> None:
    decoder = Decoder(IDS)
    bad = batch_of([(["main", "a"], 21)])
    bad.stacks[0].functions[1] = 999
    with pytest.raises(BatchError, match="stack 0 refers to string 999"):
        decoder.decode(bad, IngestLimits())
    rows = decoder.decode(batch_of([(["main", "a"], 21)], seq=2), IngestLimits()).rows
    assert [st for _, st, _ in rows] == [frames("main", "a")]


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda c: c.stack.__setitem__(2, 9), "sample 2 refers to stack 9, but there are 3"),
        (lambda c: c.process.__setitem__(1, 4), "sample 1 refers to process 4, but there are 1"),
        (lambda c: c.count.__setitem__(1, 0), "sample 1 has count 0"),
        (lambda c: c.gpu.__setitem__(0, 7), "sample 0 has an unknown GPU state 7"),
    ],
)
def test_sample_checks_name_the_first_bad_sample(mutate, problem: str) -> None:
    decoder = Decoder(IDS)
    decoder.decode(batch_of(STACKS))  # the stacks are known: only the samples can be wrong
    b = batch_of(STACKS, seq=2, gpu=pb.GPU_STATE_BUSY)
    b.sample_columns.count[2] = 0  # a later problem, or one after the first in the same sample
    mutate(b.sample_columns)
    with pytest.raises(BatchError, match=problem):
        decoder.decode(b, IngestLimits())


def test_gpu_states_tag_the_label_set() -> None:
    rows = Decoder(IDS).decode(batch_of(STACKS, gpu=pb.GPU_STATE_BUSY)).rows
    assert {dict(lb).get("gpu_state") for lb, _, _ in rows} == {"busy"}
    assert [c for _, _, c in rows] == [1, 2, 3]


def test_a_window_without_gpu_processes_may_leave_the_gpu_column_out() -> None:
    b = batch_of(STACKS)
    assert not b.sample_columns.gpu
    assert [c for _, _, c in decode_batch(b, IDS).rows] == [1, 2, 3]


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda c: c.stack.pop(), "sample_columns have 3 processes, 2 stacks"),
        (lambda c: c.gpu.pop(), "and 2 GPU states"),
        (lambda c: c.stack.__setitem__(1, 5), "sample 1 refers to stack 5"),
        (lambda c: c.count.__setitem__(2, 0), "sample 2 has count 0"),
        (lambda c: c.count.__setitem__(0, 2**64 - 1), f"sample 0 has count {2**64 - 1}"),
        (lambda c: c.gpu.__setitem__(2, -3), "sample 2 has an unknown GPU state -3"),
    ],
)
def test_bad_sample_columns_are_refused_by_name(mutate, problem: str) -> None:
    b = batch_of(STACKS, gpu=pb.GPU_STATE_IDLE)
    mutate(b.sample_columns)
    with pytest.raises(BatchError, match=problem):
        Decoder(IDS).decode(b, IngestLimits())


def test_known_processes_are_found_by_wire_id_per_agent() -> None:
    decoder = Decoder(IDS)
    first = decoder.decode(batch_of(STACKS)).rows
    again = batch_of(STACKS, seq=2, shuffle=True)  # other string order: found by id, not by index
    assert decoder.decode(again).rows == first
    other = batch_of(STACKS, agent_id="agent-b", node="node-b")  # the same id elsewhere: its own content
    assert {dict(lb)["node"] for lb, _, _ in decoder.decode(other).rows} == {"node-b"}


def test_packed_process_ids_find_known_processes_and_must_match_the_processes() -> None:
    decoder = Decoder(IDS)
    first = decoder.decode(batch_of(STACKS, process_id=78)).rows
    # Known by its packed id: the Process message is not read again (here it names another pod).
    again = batch_of(STACKS, seq=2, process_id=78)
    again.processes[0].labels[0].value = list(again.strings).index("worker")
    assert decoder.decode(again).rows == first
    wrong = batch_of(STACKS, seq=3)
    wrong.process_ids.append(79)
    with pytest.raises(BatchError, match="2 process_ids for 1 processes"):
        decoder.decode(wrong)


def test_wire_id_names_the_content() -> None:
    base = stack_wire_id(["main", "a"], ["m", "m"], 2)
    assert base == stack_wire_id(["main", "a"], ["m", "m"], 2) != 0
    assert base != stack_wire_id(["main", "a"], ["m", "m"], 1)
    assert base != stack_wire_id(["main", "b"], ["m", "m"], 2)
    assert base != stack_wire_id(["main", "a"], ["m", "n"], 2)
    assert stack_wire_id(["a"], ["b", "c"], 0) != stack_wire_id(["a", "b"], ["c"], 0)


def test_known_stacks_from_two_agents_land_under_their_own_nodes(collector: RunningCollector) -> None:
    one = batch_of([(["main", "left"], 5)], agent_id="agent-1", node="node-1")
    two = batch_of([(["main", "right", "deep"], 5)], agent_id="agent-2", node="node-2")
    assert push(collector.grpc_target, [one, two]) == [1, 1]
    again = [batch_of([(["main", "left"], 5)], agent_id="agent-1", node="node-1", seq=2, shuffle=True)]
    assert push(collector.grpc_target, again) == [2]
    left = collector.folded('{node="node-1"}', since="1h")
    right = collector.folded('{node="node-2"}', since="1h")
    assert [[f.function for f in st] for st in left] == [["main", "left"]] and sum(left.values()) == 2
    assert [[f.function for f in st] for st in right] == [["main", "right", "deep"]]
    metrics = http_get(f"{collector.url}/metrics").decode()
    assert 'fleetprof_ingest_stacks_total{how="known"} 1.0' in metrics
    assert 'fleetprof_ingest_stacks_total{how="decoded"} 2.0' in metrics
    assert "fleetprof_ingest_stack_id_collisions_total 0.0" in metrics


@pytest.mark.parametrize("form", ["packed", "messages"])
def test_a_bad_stack_with_a_wire_id_is_refused_over_grpc(form: str, collector: RunningCollector) -> None:
    b = make_batch()
    if form == "packed":
        b.frame_columns.functions = packed_ints([500, 1])
    else:
        unpack(b).stacks[0].functions[0] = 500
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [b])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refers to string 500" in info.value.details()


def test_compaction_keeps_the_stacks_agents_point_to_and_earlier_rows_readable() -> None:
    decoder = Decoder(IDS)
    decoder.stacks.MAX_STACKS = 10
    first = decoder.decode(batch_of(STACKS, agent_id="agent-a"))
    old = decoder.decode(
        batch_of([([f"u{i}", "main"], 100 + i) for i in range(6)], agent_id="agent-b", node="node-b")
    )
    decoder.decode(batch_of(STACKS, agent_id="agent-a", seq=2))  # agent-b is now the least recently used
    decoder.decode(batch_of([(["c"], 7)], agent_id="agent-c", node="node-c"))  # 10 slots: the cache is full
    # The next batch starts with a compaction, dropping agent-b's table: agent-a's and agent-c's 4 stacks
    # remain. Its Stack messages name other strings under the same wire ids: the remembered stacks win
    # (they are not decoded again).
    lying = batch_of(STACKS, agent_id="agent-a", seq=3)
    for st in lying.stacks:
        st.functions[0] = list(lying.strings).index("worker")
    again = decoder.decode(lying)
    assert len(decoder.stacks._frames) == 4
    assert [st for _, st, _ in again.rows] == [st for _, st, _ in first.rows]
    assert [st for _, st, _ in again.rows][0] == frames("main", "a")
    # Rows handed out before the compaction still read their own stacks.
    assert [st for _, st, _ in old.rows] == [frames(f"u{i}", "main") for i in range(6)]
    assert [st for _, st, _ in first.rows] == [frames("main", "a"), frames("main", "b", "c"), frames("main")]


@pytest.mark.parametrize("packed", [False, True])
def test_a_full_frame_table_starts_over_without_changing_rows(packed: bool) -> None:
    """Packed, "main" is found by its frame id in the batches after the first, until a start-over."""
    decoder = Decoder(IDS)
    decoder.stacks._frame_table.MAX_STRINGS = 12
    for seq in range(1, 6):
        stacks = [([f"f{seq}-{i}", "main"], seq * 100 + i) for i in range(3)]
        rows = decoder.decode(batch_of(stacks, seq=seq, packed=packed)).rows
        assert [st for _, st, _ in rows] == [frames(f"f{seq}-{i}", "main") for i in range(3)]
    # Content ids do not depend on which frame-table generation decoded a stack.
    plain = decode_batch(batch_of(stacks, seq=9), IDS)
    assert list(plain.stack_ids()) == list(decoder.decode(batch_of(stacks, seq=6)).stack_ids())


def test_a_decoder_makes_every_id_under_its_key_found_by_wire_id_or_not() -> None:
    """Ids come from the decoder's ContentIds, for stacks and processes it knows by wire id as for new
    ones: the same key gives the same ids in any decoder, another key other ids for the same rows."""
    decoder = Decoder(ContentIds(b"k" * 32))
    first = decoder.decode(batch_of(STACKS))
    known = decoder.decode(batch_of(STACKS, seq=2))  # every stack and process known by wire id now
    fresh = decode_batch(batch_of(STACKS, seq=3), ContentIds(b"k" * 32))
    other = decode_batch(batch_of(STACKS, seq=4), ContentIds(b"q" * 32))
    assert list(known.stack_ids()) == list(fresh.stack_ids()) == list(first.stack_ids())
    assert list(known.label_ids()) == list(fresh.label_ids()) == list(first.label_ids())
    assert list(other.stack_ids()) != list(first.stack_ids())
    assert list(other.label_ids()) != list(first.label_ids())
    assert other.rows == known.rows == first.rows


def test_an_agent_under_a_new_node_name_files_its_known_processes_under_it() -> None:
    """A host renamed (or re-imaged keeping the agent's state) sends the same agent id and process wire
    ids under another node: its samples carry the new node, not the one its processes were first seen on."""
    decoder = Decoder(IDS)
    assert {dict(lb)["node"] for lb, _, _ in decoder.decode(batch_of(STACKS)).rows} == {"node-a"}
    renamed = decoder.decode(batch_of(STACKS, seq=2, node="node-b")).rows
    assert {dict(lb)["node"] for lb, _, _ in renamed} == {"node-b"}


def test_a_function_name_past_the_symbol_limit_is_cut_and_marked() -> None:
    long_name = "ns::" + "x" * (MAX_SYMBOL_CHARS + 5_000)
    rows = Decoder(IDS).decode(batch_of([(["main", long_name], 31)])).rows
    ((_, (main, leaf), _),) = rows
    assert main.function == "main"
    assert len(leaf.function) == MAX_SYMBOL_CHARS and leaf.function.endswith("…")
    assert leaf.function[:-1] == long_name[: MAX_SYMBOL_CHARS - 1]
    # The same cut in a one-off decode: ids do not depend on which path decoded the stack.
    assert list(decode_batch(batch_of([(["main", long_name], 31)]), IDS).stack_ids()) == list(
        Decoder(IDS).decode(batch_of([(["main", long_name], 31)])).stack_ids()
    )


def test_strings_no_new_frame_uses_are_not_kept() -> None:
    """A token holder once grew the collector by every string of every batch, refused batches included
    (300 batches with a unique 1 MiB string each: 49 -> 351 MiB for good). Only the strings of frames
    decoded are kept now: 40 batches with 1 MiB of strings no stack uses leave under 1 MiB behind."""
    decoder = Decoder(IDS)
    decoder.decode(batch_of(STACKS))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(2, 42):
            batch = batch_of([*STACKS, ([f"new-{seq}"], 1000 + seq)], seq=seq)  # a new stack each time
            batch.strings.append(f"{seq:08d}" + "u" * (1 << 20))  # in the table, in no stack
            if seq % 2:
                batch.sample_columns.count[0] = 0  # and half of them refused
                with pytest.raises(BatchError):
                    decoder.decode(batch, IngestLimits())
            else:
                decoder.decode(batch, IngestLimits())
            del batch
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1 << 20, f"{kept} bytes kept"
