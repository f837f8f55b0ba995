"""The CUDA section of the wire (proto 50-59, GPM fields of GpuSample): what ingest makes of it, and every
hostile or inconsistent part refused by name, leaving nothing behind, through the real gRPC ingest too."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.validate import BatchError, IngestLimits
from fleetprof.collector.model.ids import ContentIds
from fleetprof.gpu_families import GAP_BUCKETS_NS
from tests.conftest import RunningCollector
from tests.support.wire import BatchBuilder, hist, kernel_stack, push

AGENT = "c0da0000000000000000000000000001"
TRAIN = [("main", "train.py"), ("step (train.py:12)", "train.py")]


def cuda_batch(seq: int = 1, node: str = "node-a") -> BatchBuilder:
    """One pod's trainer: CPU samples, launches and kernel time of two kernels, two CUDA calls, and its
    activity on GPU 0 (gaps of 5 ms and 20 µs in a 1 s window)."""
    b = BatchBuilder(node, AGENT, seq)
    p = b.process(7, "python3", {"namespace": "ml", "pod": "trainer-0", "container": "main"})
    b.sample(p, b.stack(TRAIN), 4)
    gemm = b.stack(kernel_stack(TRAIN, "ampere_sgemm_128x64_nn", "libcublasLt.so.12"))
    relu = b.stack(kernel_stack(TRAIN, "void at::native::relu_kernel<float>(float*, int)"))
    b.cuda_launch(p, gemm, 800, gpu=pb.GPU_STATE_BUSY)
    b.cuda_launch(p, relu, 400)
    b.gpu_kernel(p, gemm, 600_000_000)
    b.gpu_kernel(p, b.stack([("unsampled_kernel", "[cuda]")]), 1_000)
    b.cuda_call(p, "cudaStreamSynchronize", 10, 30_000_000, hist(b21=10))
    b.cuda_call(p, "cudaMalloc", 3, 3_000, hist(b9=3))
    b.cuda_activity(p, 0, known_ns=900_000_000, gaps_ns=[5_000_000, 20_000], uuid="GPU-1234")
    return b


def test_cuda_rows_become_typed_rows_and_calls() -> None:
    rows = Decoder(ContentIds()).decode(cuda_batch().build(), IngestLimits())
    by_type: dict[str, int] = {}
    for labels, stack, count in rows.rows:
        lb = dict(labels)
        by_type[lb.get("__type__", "")] = by_type.get(lb.get("__type__", ""), 0) + count
        if lb.get("__type__") in ("cuda_launch", "gpu"):
            assert lb["pod"] == "trainer-0"
            assert stack[-1].function in (
                "ampere_sgemm_128x64_nn",
                "void at::native::relu_kernel<float>(float*, int)",
                "unsampled_kernel",
            )
    assert by_type == {"": 4, "cuda_launch": 1200, "gpu": 600_001_000}
    assert rows.total == 4  # CPU samples only
    launch_labels = {
        dict(lb).get("gpu_state", "") for lb, _, _ in rows.rows if ("__type__", "cuda_launch") in lb
    }
    assert launch_labels == {"busy", ""}
    assert not rows.syscall_rows
    calls = {name: (dict(labels), agg) for labels, name, agg in rows.cuda_calls}
    assert set(calls) == {"cudaStreamSynchronize", "cudaMalloc"}
    labels, sync = calls["cudaStreamSynchronize"]
    assert labels["__type__"] == "cuda" and labels["pod"] == "trainer-0"
    assert (sync.count, sync.timed, sync.timed_ns) == (10, 10, 30_000_000)
    # Every row's label set is in the table the stores write (ProfileRows' promise).
    assert {lb for lb, _, _ in rows.cuda_calls} <= {ls for _, ls in rows.label_sets}


def test_the_gap_histogram_is_the_protos_fixed_buckets() -> None:
    batch = cuda_batch().build()
    (act,) = batch.cuda_activity
    assert len(act.gap_histogram) == len(GAP_BUCKETS_NS) + 1 == 7
    # 20 µs in [10 µs, 100 µs), 5 ms in [1 ms, 10 ms)
    assert list(act.gap_histogram) == [0, 1, 0, 1, 0, 0, 0]
    assert (act.gaps, act.idle_ns, act.longest_gap_ns) == (2, 5_020_000, 5_000_000)


def _spoil(mutate: Callable[[pb.Batch, BatchBuilder], None]) -> Callable[[int], pb.Batch]:
    def make(seq: int) -> pb.Batch:
        b = cuda_batch(seq)
        # New stacks and processes before the spoiled part: none may be learned.
        p = b.process(1000 + seq, f"new{seq}", {"pod": f"p-{seq}"})
        b.sample(p, b.stack([("main", "app"), (f"new-{seq}", "app")]), 2)
        mutate(b.batch, b)
        return b.build()

    return make


def _gpm(value: float) -> Callable[[pb.Batch, BatchBuilder], None]:
    def mutate(batch: pb.Batch, b: BatchBuilder) -> None:
        d = batch.gpu_devices.add(index=0, uuid=b.string("GPU-1234"), name=b.string("NVIDIA H100"))
        d.samples.add(time_unix_ns=batch.end_unix_ns, gpu_utilization_percent=50, sm_active_percent=value)

    return mutate


def _set(field: str, attr: str, value: object, row: int = 0) -> Callable[[pb.Batch, BatchBuilder], None]:
    def mutate(batch: pb.Batch, b: BatchBuilder) -> None:
        target = getattr(batch, field)
        target = target[row] if field in ("cuda_calls", "cuda_activity") else target
        if isinstance(value, list):
            getattr(target, attr).extend(value)
        else:
            setattr(target, attr, value)

    return mutate


def _empty_launch_stack(batch: pb.Batch, b: BatchBuilder) -> None:
    b.cuda_launch(0, b.stack([]), 5)


def _empty_kernel_stack(batch: pb.Batch, b: BatchBuilder) -> None:
    b.gpu_kernel(0, b.stack([]), 5)


def _second_activity_row(batch: pb.Batch, b: BatchBuilder) -> None:
    b.cuda_activity(0, 0, known_ns=1_000)


def _call_name(name: str) -> Callable[[pb.Batch, BatchBuilder], None]:
    return lambda batch, b: b.cuda_call(0, name, 1, 10, hist(b3=1))


SPOILED: dict[str, tuple[Callable[[pb.Batch, BatchBuilder], None], str, str]] = {
    "launch columns of unequal length": (
        _set("cuda_launch_columns", "stack", [99]),
        "bad_cuda_launch",
        "cuda_launch_columns have 2 processes, 3 stacks",
    ),
    "launch row past the stacks": (
        lambda batch, b: b.cuda_launch(0, 99, 1),
        "bad_cuda_launch",
        "CUDA launch row 2 refers to stack 99",
    ),
    "launch count 0": (lambda batch, b: b.cuda_launch(0, 1, 0), "bad_count", "CUDA launch row 2 has count 0"),
    "launch of an empty stack": (_empty_launch_stack, "bad_cuda_launch", "which is empty"),
    "launch GPU state unknown": (
        lambda batch, b: b.cuda_launch(0, 1, 3, gpu=7),
        "bad_cuda_launch",
        "unknown GPU state 7",
    ),
    "kernel ns over 2^53": (
        lambda batch, b: b.gpu_kernel(0, 1, (1 << 53) + 1),
        "bad_count",
        "GPU kernel row 2 has kernel_ns",
    ),
    "kernel row of a missing process": (
        lambda batch, b: b.gpu_kernel(5, 1, 10),
        "bad_gpu_kernel",
        "GPU kernel row 2 refers to process 5",
    ),
    "kernel of an empty stack": (_empty_kernel_stack, "bad_gpu_kernel", "which is empty"),
    "kernel columns of unequal length": (
        _set("cuda_kernel_columns", "kernel_ns", [1]),
        "bad_gpu_kernel",
        "each needs one per row",
    ),
    "call name with a space": (_call_name("cuda Malloc"), "bad_cuda_call", "is a C identifier"),
    "call name of 200 bytes": (_call_name("c" * 200), "bad_cuda_call", "is a C identifier"),
    "call histogram not adding up": (
        _set("cuda_calls", "latency_log2_ns", [1]),
        "bad_cuda_call",
        "does not add up to timed 10",
    ),
    "call of a missing process": (_set("cuda_calls", "process", 9), "bad_cuda_call", "refers to process 9"),
    "call name missing from the string table": (
        _set("cuda_calls", "call", 10_000),
        "bad_string_id",
        "refers to string 10000",
    ),
    "idle longer than known": (
        _set("cuda_activity", "idle_ns", 900_000_001),
        "bad_cuda_activity",
        "idle_ns 900000001 <= known_ns 900000000",
    ),
    "known longer than the window": (
        _set("cuda_activity", "known_ns", 2_000_000_000),
        "bad_cuda_activity",
        "the window's 1000000000 ns",
    ),
    "gap histogram of other buckets": (
        _set("cuda_activity", "gap_histogram", [0]),
        "bad_cuda_activity",
        "in the 7 buckets the proto fixes",
    ),
    "more gaps than a window holds": (
        _set("cuda_activity", "gaps", 10**9),
        "bad_cuda_activity",
        "cannot end in a 1000000000 ns window",
    ),
    "activity twice for one device": (
        _second_activity_row,
        "bad_cuda_activity",
        "repeats process 0 on device 0",
    ),
    "activity of device 4096": (_set("cuda_activity", "device", 4096), "bad_cuda_activity", "device 4096"),
    "sampled more launches than seen": (
        lambda batch, b: batch.cuda_stats.MergeFrom(pb.CudaStats(launches=1, launches_sampled=2)),
        "bad_cuda_stats",
        "launches_sampled 2 <= launches 1",
    ),
    "GPM SM active NaN": (_gpm(float("nan")), "bad_gpu", "sm_active_percent is nan"),
    "GPM SM active negative": (_gpm(-1.0), "bad_gpu", "must be in 0..200"),
}


@pytest.mark.parametrize("spoiled", list(SPOILED), ids=list(SPOILED))
def test_a_spoiled_cuda_section_is_refused_by_name_and_leaves_nothing(spoiled: str) -> None:
    mutate, reason, message = SPOILED[spoiled]
    decoder = Decoder(ContentIds())
    limits = IngestLimits()
    decoder.decode(cuda_batch(1).build(), limits)  # the agent is known: its tables exist
    before = decoder.sizes()
    for seq in (2, 3):
        with pytest.raises(BatchError) as info:
            decoder.decode(_spoil(mutate)(seq), limits)
        assert info.value.reason == reason
        assert message in str(info.value) and f"batch {seq}:" in str(info.value)
    assert decoder.sizes() == before
    rows = decoder.decode(_spoil(lambda *_: None)(9), limits)  # a good one afterwards is learned
    assert rows.total == 6


def test_gpm_readings_a_little_over_100_are_accepted() -> None:
    batch = _spoil(_gpm(100.4))(2)
    Decoder(ContentIds()).decode(batch, IngestLimits())


def test_over_grpc_a_spoiled_cuda_batch_is_refused_and_a_good_one_stored(collector: RunningCollector) -> None:
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [_spoil(_call_name("cuda\nMalloc"))(1)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch 1: CUDA call row 2 names the call 'cuda\\nMalloc'" in info.value.details()
    assert collector.collector.ingest.stats.rejected == {"bad_cuda_call": 1}
    assert push(collector.grpc_target, [cuda_batch(2).build()]) == [2]
    assert collector.json("/api/v1/top", since="5m")["total"] == 4  # CPU samples, nothing else
