"""The collector's gRPC ingest over a real channel: bad batches are refused by name, the rest lands once."""

from __future__ import annotations

import uuid

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, samples_of
from tests.support.gpu_batches import gpu_batch
from tests.support.wire import hist, make_batch, packed_ints, push, unpack, with_syscalls


def corrupt(mutate) -> pb.Batch:
    b = make_batch()
    mutate(b)
    return b


def relabel(b: pb.Batch, name: str, value: str = "v") -> None:
    """Give the batch's process one label (name, value), as a hostile or broken agent might."""
    b.strings.extend([name, value])
    b.processes[0].labels[0].name, b.processes[0].labels[0].value = len(b.strings) - 2, len(b.strings) - 1


BAD_BATCHES = {
    "empty node": (lambda b: setattr(b.agent, "node", ""), "agent.node is empty"),
    # make_batch has one stack, main;work: frames 0 and 1 of its frame table.
    "bad string id in stack": (
        lambda b: unpack(b).stacks[0].functions.__setitem__(1, 99),
        "refers to string 99",
    ),
    "bad string id in a packed frame": (
        lambda b: setattr(b.frame_columns, "functions", packed_ints([1, 99])),
        "stack 0 refers to string 99",
    ),
    "packed modules out of step": (
        lambda b: setattr(b.frame_columns, "modules", packed_ints([2, 2, 2])),
        "frame_columns have 2 functions but 3 modules",
    ),
    "a frame past the frame table": (
        lambda b: setattr(b.stack_columns, "frames", packed_ints([0, 2])),
        "stack 0 refers to frame 2, but frame_columns has 2 frames",
    ),
    "packed lengths not adding up": (
        lambda b: setattr(b.stack_columns, "lengths", packed_ints([3])),
        "lengths add up to 3 frames, but it has 2",
    ),
    "a packed kernel_start past the frames": (
        lambda b: setattr(b.stack_columns, "kernel_starts", packed_ints([3])),
        "stack 0 kernel_start 3 is past its 2 frames",
    ),
    "a packed column 3 bytes wide": (lambda b: setattr(b.stack_columns, "index_bytes", 3), "not 2 or 4"),
    "a packed column cut mid-entry": (
        lambda b: setattr(b.stack_columns, "frames", b"\x00\x00\x01"),
        "3 bytes is no whole number of 2-byte entries",
    ),
    "stacks in both forms": (lambda b: b.stacks.add(functions=[1]), "both stacks and stack_columns"),
    "bad string id in label": (
        lambda b: setattr(b.processes[0].labels[0], "value", 50),
        "refers to string 50",
    ),
    "sample -> missing stack": (lambda b: b.sample_columns.stack.__setitem__(0, 3), "refers to stack 3"),
    "sample -> missing process": (
        lambda b: b.sample_columns.process.__setitem__(0, 7),
        "refers to process 7",
    ),
    "zero count": (lambda b: b.sample_columns.count.__setitem__(0, 0), "count 0"),
    "negative count (two's complement)": (
        lambda b: b.sample_columns.count.__setitem__(0, 2**64 - 1),
        "counts must be",
    ),
    "sample columns out of step": (lambda b: b.sample_columns.count.append(1), "need one per row"),
    "a stack without its id": (lambda b: b.stack_ids.pop(), "0 stack_ids for 1 stacks"),
    "a process without its id": (lambda b: b.process_ids.pop(), "0 process_ids for 1 processes"),
    "modules out of step": (lambda b: unpack(b).stacks[0].modules.append(3), "2 functions but 3 modules"),
    "a process label posing as the node": (lambda b: relabel(b, "node", "other-node"), "'node' is one"),
    "a process label posing as the GPU state": (
        lambda b: relabel(b, "gpu_state", "idle"),
        "'gpu_state' is one",
    ),
    "an internal label name": (lambda b: relabel(b, "__name__"), "'__name__' is one the collector"),
    "a label name Prometheus refuses": (lambda b: relabel(b, "app-name"), "is not a label name"),
    "a label name too long": (lambda b: relabel(b, "n" * 129), "at most 128 bytes"),
    "a label value too long": (lambda b: relabel(b, "team", "v" * 1025), "value is over 1024 bytes"),
    "first string not empty": (
        lambda b: b.strings.__setitem__(0, "x"),
        "strings[0] must be the empty string",
    ),
    "window backwards": (lambda b: setattr(b, "end_unix_ns", b.start_unix_ns - 1), "is before start_unix_ns"),
    "no frequency": (lambda b: setattr(b, "frequency_hz", 0), "frequency_hz 0"),
    "no sequence": (lambda b: setattr(b, "sequence", 0), "sequence must start at 1"),
    # Found by tests/wire/test_fuzz_ingest.py: each was acknowledged, and then broke something downstream.
    "a node name longer than a label value may be": (
        lambda b: setattr(b.agent, "node", "n" * 1025),
        "is not a node name",  # node names are DNS names: at most 253 bytes
    ),
    "an agent id longer than the dedupe state keeps": (
        lambda b: setattr(b.agent, "agent_id", "a" * 257),
        "agent.agent_id is 257 bytes",
    ),
    "a sequence past the database's BIGINT": (lambda b: setattr(b, "sequence", 2**63), "sequence is over"),
    "syscall latency past the database's BIGINT": (
        lambda b: with_syscalls(b, [("read", 1, 1, 2**63, hist(b10=1))]),
        "timed_ns 9223372036854775808 is over the limit",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_malformed_batch_is_refused_with_invalid_argument_naming_the_problem(
    case: str, collector: RunningCollector
) -> None:
    mutate, expected = BAD_BATCHES[case]
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [corrupt(mutate)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in info.value.details()
    assert info.value.details().startswith("batch ")
    # The collector keeps serving: a good batch right after is acknowledged and queryable.
    assert push(collector.grpc_target, [make_batch(count=7)]) == [1]
    assert samples_of(collector.folded('{comm="worker"}')) == 7
    metrics = collector.collector.registry
    assert metrics.get_sample_value("fleetprof_ingest_batches_total") == 1


def test_bytes_that_are_not_a_batch_are_refused_with_invalid_argument(collector: RunningCollector) -> None:
    with grpc.insecure_channel(collector.grpc_target) as ch:
        raw = ch.stream_stream(
            "/fleetprof.v1.Ingest/Push", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            list(raw(iter([b"\xff\xff\xff not protobuf"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch (unreadable): 16 bytes are not a fleetprof.v1.Batch message" in info.value.details()
    registry = collector.collector.registry
    assert registry.get_sample_value("fleetprof_ingest_rejected_batches_total", {"reason": "unreadable"}) == 1
    assert push(collector.grpc_target, [make_batch(count=3)]) == [1]  # and it keeps serving


def test_oversized_batch_is_refused_with_invalid_argument() -> None:
    from tests.conftest import start_collector

    col = start_collector(max_batch_bytes=4096)
    try:
        big = make_batch()
        big.strings.extend(f"function_{i:06d}" for i in range(300))
        with pytest.raises(grpc.RpcError) as info:
            push(f"127.0.0.1:{col.grpc_port}", [big])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the collector's limit of 4096 bytes" in info.value.details()
        assert (
            col.registry.get_sample_value("fleetprof_ingest_rejected_batches_total", {"reason": "oversized"})
            == 1
        )
    finally:
        col.stop()


def test_resent_batches_are_counted_once(collector: RunningCollector) -> None:
    agent_id = uuid.uuid4().hex
    b1, b2 = make_batch(1, agent_id, count=3), make_batch(2, agent_id, count=4)
    assert push(collector.grpc_target, [b1, b2]) == [1, 2]
    # A reconnecting agent resends what it did not see acknowledged: acked again, stored once.
    assert push(collector.grpc_target, [b1, b2, make_batch(3, agent_id, count=5)]) == [1, 2, 3]
    assert samples_of(collector.folded('{comm="worker"}')) == 12
    assert collector.collector.registry.get_sample_value("fleetprof_ingest_duplicate_batches_total") == 2


def test_same_sequence_from_another_agent_is_not_a_duplicate(collector: RunningCollector) -> None:
    push(collector.grpc_target, [make_batch(1, "agent-one", count=2)])
    push(collector.grpc_target, [make_batch(1, "agent-two", node="node-b", count=3)])
    assert samples_of(collector.folded('{comm="worker"}')) == 5
    assert samples_of(collector.folded('{node="node-b"}')) == 3


def test_labels_from_the_batch_are_selectable(collector: RunningCollector) -> None:
    push(collector.grpc_target, [make_batch(count=9)])
    names = collector.json("/api/v1/labels")["labels"]
    assert {"node", "pid", "comm", "container_id"} <= set(names)
    assert collector.json("/api/v1/labels/container_id/values")["values"] == ["abc123"]
    stacks = collector.folded('{container_id="abc123", pid="42"}')
    assert [f.function for f in next(iter(stacks))] == ["main", "work"]


def test_a_known_gpu_process_with_labels_outside_the_string_table_is_refused(
    collector: RunningCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process the collector knows by wire id is not decoded again, but the GPU section still reads its
    labels (the pod it runs in): out of the string table, that was an IndexError after the batch was
    stored (UNKNOWN, found by tests/wire/test_fuzz_ingest.py); it is INVALID_ARGUMENT, and nothing is
    stored."""
    first = gpu_batch(monkeypatch)
    assert push(collector.grpc_target, [first]) == [1]
    second = pb.Batch()
    second.CopyFrom(first)
    second.sequence = 2
    process = second.gpu_processes[0].process
    second.processes[process].labels[0].value = 10**6
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [second])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"batch 2: gpu process row 0's process {process} label refers to string 1000000"
        in info.value.details()
    )
    assert collector.collector.registry.get_sample_value("fleetprof_ingest_batches_total") == 1
