"""CUDA data through the real collector (gRPC ingest, HTTP API, Pyroscope API, CLI process, /metrics): the
`cuda_launch` and `gpu` profile types, /api/v1/cuda and `fleetprof cuda`, and the Prometheus series."""

from __future__ import annotations

import gzip
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.collector.test_pyroscope_api import CUDA_LAUNCH, GPU, call, nodes
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.wire import BatchBuilder, hist, kernel_stack, push

TRAIN = [("main", "train.py"), ("step (train.py:12)", "train.py")]
EVAL = [("main", "train.py"), ("evaluate (train.py:30)", "train.py")]
GEMM = "ampere_sgemm_128x64_nn"
RELU = "void at::native::relu_kernel<float>(float*, int)"
POD = {"namespace": "ml", "pod": "trainer-0", "container": "main"}


def trainer_batch(seq: int = 1, node: str = "node-a") -> pb.Batch:
    """A trainer pod and a host process: CPU samples, launches, kernel time and CUDA calls, known amounts."""
    b = BatchBuilder(node, "c0da0000000000000000000000000002", seq)
    p = b.process(7, "python3", POD)
    host = b.process(9, "bench")
    b.sample(p, b.stack(TRAIN), 4)
    gemm = b.stack(kernel_stack(TRAIN, GEMM, "libcublasLt.so.12"))
    relu_train = b.stack(kernel_stack(TRAIN, RELU))
    relu_eval = b.stack(kernel_stack(EVAL, RELU))
    b.cuda_launch(p, gemm, 800, gpu=pb.GPU_STATE_BUSY)
    b.cuda_launch(p, relu_train, 400, gpu=pb.GPU_STATE_IDLE)
    b.cuda_launch(p, relu_eval, 100)
    b.cuda_launch(host, b.stack(kernel_stack([("main", "bench")], "noop")), 5_000)
    b.gpu_kernel(p, gemm, 600_000_000)
    b.gpu_kernel(p, relu_train, 50_000_000)
    b.gpu_kernel(p, relu_eval, 25_000_000)
    b.cuda_call(p, "cudaStreamSynchronize", 10, 30_000_000, hist(b21=8, b22=2))
    b.cuda_call(p, "cudaMalloc", 3, 3_000, hist(b9=3))
    b.cuda_call(host, "cudaStreamSynchronize", 1_000, 1_000_000, hist(b9=1_000))
    b.batch.syscalls.append(pb.SyscallStats(process=0, syscall=b.string("read"), count=5))
    return b.build()


def folded(collector: RunningCollector, query: str, **params: str) -> dict[tuple[str, ...], int]:
    """The folded profile by function names."""
    return {tuple(f.function for f in st): n for st, n in collector.folded(query, **params).items()}


def test_launches_and_kernel_time_are_profiles_of_their_own(collector: RunningCollector) -> None:
    push(collector.grpc_target, [trainer_batch()])
    pod = '{pod="trainer-0"}'
    launches = folded(collector, pod, type="cuda_launch")
    assert launches == {
        ("main", "step (train.py:12)", GEMM): 800,
        ("main", "step (train.py:12)", RELU): 400,
        ("main", "evaluate (train.py:30)", RELU): 100,
    }
    gpu = folded(collector, pod, type="gpu")
    assert gpu == {
        ("main", "step (train.py:12)", GEMM): 600_000_000,
        ("main", "step (train.py:12)", RELU): 50_000_000,
        ("main", "evaluate (train.py:30)", RELU): 25_000_000,
    }
    # CPU samples stay CPU samples; launches while the GPU idled are selected as samples are.
    assert folded(collector, pod) == {("main", "step (train.py:12)"): 4}
    assert folded(collector, pod, type="cuda_launch", gpu="idle") == {
        ("main", "step (train.py:12)", RELU): 400
    }
    top = collector.json("/api/v1/top", query=pod, since="5m", type="cuda_launch", sort="self")
    assert (top["unit"], top["total"], top["frequency_hz"]) == ("launches", 1300, None)
    assert [(f["function"], f["self"]) for f in top["functions"] if f["self"]] == [(GEMM, 800), (RELU, 500)]
    top = collector.json("/api/v1/top", query=pod, since="5m", type="gpu")
    assert (top["unit"], top["total"]) == ("nanoseconds", 675_000_000)
    pods = collector.json("/api/v1/top", since="5m", type="cuda_launch", by="pod")
    assert {g["labels"]["pod"]: g["value"] for g in pods["groups"]} == {"trainer-0": 1300, "comm:bench": 5000}


def test_pprof_and_grafana_read_the_cuda_types(collector: RunningCollector) -> None:
    push(collector.grpc_target, [trainer_batch()])
    q = "query=%7Bpod%3D%22trainer-0%22%7D&since=5m&format=pprof"
    for kind, sample_type, total in (
        ("cuda_launch", ("launches", "count"), 1300),
        ("gpu", ("gpu", "nanoseconds"), 675_000_000),
    ):
        prof = profile_pb2.Profile.FromString(
            gzip.decompress(http_get(f"{collector.url}/api/v1/profile?{q}&type={kind}"))
        )
        st = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
        assert st == [sample_type]
        assert sum(s.value[0] for s in prof.sample) == total
        leaves = {
            prof.string_table[prof.function[prof.location[s.location_id[0] - 1].line[0].function_id - 1].name]
            for s in prof.sample
        }
        assert leaves == {GEMM, RELU}
    now_ms = int(__import__("time").time() * 1000)
    for type_id, total in ((CUDA_LAUNCH, 1300), (GPU, 675_000_000)):
        req = querier_pb2.SelectMergeStacktracesRequest(
            profile_typeID=type_id,
            label_selector='{pod="trainer-0"}',
            start=now_ms - 300_000,
            end=now_ms + 60_000,
        )
        fg = call(
            collector, "SelectMergeStacktraces", req, querier_pb2.SelectMergeStacktracesResponse
        ).flamegraph
        assert fg.total == total
        assert {path[-1] for path in nodes(fg) if len(path) == 4} == {GEMM, RELU}  # total;main;step;kernel


def test_cuda_calls_api_groups_by_pod_and_call_and_leaves_syscalls_alone(collector: RunningCollector) -> None:
    push(collector.grpc_target, [trainer_batch()])
    got = collector.json("/api/v1/cuda", since="5m")
    assert got["by"] == ["namespace", "pod", "call"] and got["total_count"] == 1013
    rows = {(r["labels"]["pod"], r["labels"]["call"]): r for r in got["calls"]}
    assert set(rows) == {
        ("trainer-0", "cudaStreamSynchronize"),
        ("trainer-0", "cudaMalloc"),
        ("", "cudaStreamSynchronize"),
    }
    sync = rows[("trainer-0", "cudaStreamSynchronize")]
    assert (sync["count"], sync["timed"]) == (10, 10)
    assert sync["seconds"] == pytest.approx(0.03)
    assert sync["mean_seconds"] == pytest.approx(0.003)
    assert sync["histogram"] == [[2**22 / 1e9, 8], [2**23 / 1e9, 2]]  # [2^21, 2^22) ns and [2^22, 2^23) ns
    assert 2**21 / 1e9 <= sync["p50_seconds"] <= 2**22 / 1e9
    assert [r["labels"]["call"] for r in got["calls"]][
        0
    ] == "cudaStreamSynchronize"  # by time, the pod's first
    by_count = collector.json("/api/v1/cuda", since="5m", sort="count", by="call")
    assert [(r["labels"], r["count"]) for r in by_count["calls"]] == [
        ({"call": "cudaStreamSynchronize"}, 1010),
        ({"call": "cudaMalloc"}, 3),
    ]
    # The syscall listing shows syscalls only, and the CUDA one CUDA calls only.
    syscalls = collector.json("/api/v1/syscalls", since="5m")
    assert [r["labels"]["syscall"] for r in syscalls["syscalls"]] == ["read"] and syscalls["total_count"] == 5
    # No internal label leaks into the label listing.
    assert "__type__" not in collector.json("/api/v1/labels")["labels"]


def test_cuda_command_and_type_flags_run_as_the_cli(collector: RunningCollector) -> None:
    push(collector.grpc_target, [trainer_batch()])
    r = fleetprof("cuda", "--collector", collector.url, "--since", "5m")
    assert r.returncode == 0, r.stderr
    by_time, by_count = r.stdout.split("\n\n")
    assert by_time.splitlines()[1].split() == [
        "NAMESPACE",
        "POD",
        "CALL",
        "CALLS",
        "CALLS/S",
        "TIME",
        "MEAN",
        "P50",
        "P99",
    ]
    assert by_time.splitlines()[2].split()[:4] == ["ml", "trainer-0", "cudaStreamSynchronize", "10"]
    assert by_count.splitlines()[2].split()[:4] == ["-", "-", "cudaStreamSynchronize", "1000"]
    r = fleetprof(
        "top",
        "--collector",
        collector.url,
        "--since",
        "5m",
        "--type",
        "cuda_launch",
        "--query",
        '{pod="trainer-0"}',
    )
    assert r.returncode == 0, r.stderr
    assert "1300 CUDA kernel launches" in r.stdout.splitlines()[0]
    assert GEMM in r.stdout.splitlines()[2] and "[libcublasLt.so.12]" in r.stdout.splitlines()[2]
    r = fleetprof(
        "flame",
        "--collector",
        collector.url,
        "--since",
        "5m",
        "--type",
        "gpu",
        "--query",
        '{pod="trainer-0"}',
    )
    assert r.returncode == 0, r.stderr
    assert f"main;step (train.py:12);{GEMM} 600000000" in r.stdout.splitlines()
    r = fleetprof(
        "diff", "--collector", collector.url, "--since", "5m", "--type", "cuda_launch",
        "--query", '{pod="trainer-0"}', "--query2", '{comm="bench"}',
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "(1300 launches)" in r.stdout.splitlines()[0] and "(5000 launches)" in r.stdout.splitlines()[1]


def _families(collector: RunningCollector) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http_get(f"{collector.url}/metrics").decode())}


def test_prometheus_exports_cuda_calls_per_pod_and_keeps_them_out_of_cpu_and_syscalls(
    collector: RunningCollector,
) -> None:
    push(collector.grpc_target, [trainer_batch()])
    families = _families(collector)
    calls = {
        (s.labels["pod"], s.labels["call"]): s.value
        for s in families["fleetprof_cuda_calls"].samples
        if s.name == "fleetprof_cuda_calls_total"
    }
    assert calls == {
        ("trainer-0", "cudaStreamSynchronize"): 10,
        ("trainer-0", "cudaMalloc"): 3,
        ("", "cudaStreamSynchronize"): 1000,
    }
    hist_samples = [
        s
        for s in families["fleetprof_cuda_call_duration_seconds"].samples
        if s.labels["pod"] == "trainer-0" and s.labels["call"] == "cudaStreamSynchronize"
    ]
    buckets = {s.labels["le"]: s.value for s in hist_samples if s.name.endswith("_bucket")}
    # 2^21..2^23 ns calls: none under 2^20 ns (1.048576 ms), all 10 under 2^24 ns.
    assert buckets["0.001048576"] == 0 and buckets["0.016777216"] == 10 and buckets["+Inf"] == 10
    assert next(s.value for s in hist_samples if s.name.endswith("_sum")) == pytest.approx(0.03)
    syscalls = [s for s in families["fleetprof_syscalls"].samples if s.name == "fleetprof_syscalls_total"]
    assert [(s.labels["syscall"], s.value) for s in syscalls] == [("read", 5.0)]
    # Launches and kernel nanoseconds are no CPU or off-CPU time.
    cpu = {
        s.labels["pod"]: s.value
        for s in families["fleetprof_cpu_seconds"].samples
        if s.name.endswith("_total")
    }
    assert cpu == {"trainer-0": pytest.approx(4 / 19)}
    assert "fleetprof_offcpu_seconds" not in families


def test_json_profile_names_the_type_and_unit(collector: RunningCollector) -> None:
    push(collector.grpc_target, [trainer_batch()])
    body = json.loads(http_get(f"{collector.url}/api/v1/profile?since=5m&type=cuda_launch"))
    assert (body["type"], body["unit"], body["total"]) == ("cuda_launch", "launches", 6300)
    body = json.loads(http_get(f"{collector.url}/api/v1/profile?since=5m&type=gpu"))
    assert (body["type"], body["unit"], body["total"]) == ("gpu", "nanoseconds", 675_000_000)
