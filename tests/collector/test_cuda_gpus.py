"""Exact GPU idle per pod: the CUPTI activity rows through the real collector into /api/v1/gpus and
`fleetprof gpus` (idle time, gap count and lengths, the CPU and wall stacks while idle), with NVML's
reading beside it, and pods without the library answered from NVML as before."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.wire import BatchBuilder, push

MS = 1_000_000
TRAINER = {"namespace": "ml", "pod": "trainer-0", "container": "main"}
SERVER = {"namespace": "ml", "pod": "infer-0", "container": "server"}
LOAD = [("main", "train.py"), ("slow_collate (train.py:40)", "train.py")]
STEP = [("main", "train.py"), ("step (train.py:12)", "train.py")]
WAIT = [("main", "train.py"), ("get (queue.py:171)", "queue.py"), ("futex_wait", "[kernel]")]


def window(seq: int, end_ns: int, gaps_ms: list[float]) -> pb.Batch:
    """A 1 s window of node gpu-1: GPU-A (NVML index 0) busy at every poll, 80% utilization, used by
    trainer-0 whose CUPTI records see it idle in `gaps_ms`; GPU-B (index 1) used by infer-0, idle in 2 of
    its 4 polls, without the library. The trainer's CPU samples and off-CPU time tagged by the agent."""
    b = BatchBuilder("gpu-1", "c0da0000000000000000000000000003", seq, end_ns=end_ns, window_s=1.0)
    trainer = b.process(11, "python3", TRAINER)
    server = b.process(12, "tritonserver", SERVER)
    a = b.batch.gpu_devices.add(index=0, uuid=b.string("GPU-A"), name=b.string("NVIDIA H100"))
    bb = b.batch.gpu_devices.add(index=1, uuid=b.string("GPU-B"), name=b.string("NVIDIA H100"))
    for i in range(4):
        t = b.batch.start_unix_ns + i * 250 * MS
        a.samples.add(time_unix_ns=t, gpu_utilization_percent=80)
        bb.samples.add(time_unix_ns=t, gpu_utilization_percent=0 if i % 2 else 60)
    b.batch.gpu_source.MergeFrom(pb.GpuSource(up=True, state=b.string("up"), idle_below_percent=5))
    b.batch.gpu_processes.add(process=trainer, device=0, polls=4, state_polls=4, idle_polls=0)
    b.batch.gpu_processes.add(process=server, device=1, polls=4, state_polls=4, idle_polls=2)
    b.cuda_activity(trainer, 0, known_ns=900 * MS, gaps_ns=[int(g * MS) for g in gaps_ms], uuid="GPU-A")
    b.sample(trainer, b.stack(LOAD), 6, pb.GPU_STATE_IDLE)
    b.sample(trainer, b.stack(STEP), 12, pb.GPU_STATE_BUSY)
    b.offcpu(trainer, b.stack(WAIT), 40 * MS, pb.GPU_STATE_IDLE)
    return b.build()


@pytest.fixture
def pods(collector: RunningCollector) -> dict:
    end = time.time_ns()
    batches = [window(1, end - 10**9, [5, 20, 0.02]), window(2, end, [12, 0.004])]
    assert push(collector.grpc_target, batches) == [1, 2]
    got = collector.json("/api/v1/gpus", since="5m", functions="3")
    return {p["pod"]: p for p in got["pods"]}


def test_exact_idle_gaps_and_lengths_come_from_the_activity(pods: dict) -> None:
    trainer = pods["trainer-0"]
    idle_ms = 5 + 20 + 0.02 + 12 + 0.004
    assert trainer["idle_source"] == "activity"
    assert trainer["idle_seconds"] == pytest.approx(idle_ms / 1e3)
    assert trainer["activity_seconds"] == pytest.approx(1.8)
    assert trainer["idle_ratio"] == pytest.approx(idle_ms / 1800, abs=1e-4)
    # NVML saw the GPU at 80% in every poll: the gaps, all far below its sample period, are invisible to it.
    assert trainer["nvml_idle_ratio"] == 0.0
    assert trainer["gaps"] == 5 and trainer["longest_gap_seconds"] == pytest.approx(0.02)
    hist = {b["le_seconds"]: b["count"] for b in trainer["gap_histogram"]}
    # 4 µs in [0, 10 µs), 20 µs in [10, 100 µs), 5 ms in [1, 10 ms), 12 and 20 ms in [10, 100 ms)
    assert hist == {1e-5: 1, 1e-4: 1, 1e-3: 0, 1e-2: 1, 1e-1: 2, 1.0: 0, None: 0}
    assert trainer["gpus"] == ["gpu-1/0"]
    assert trainer["records_lost"] == 0


def test_the_cpu_and_wall_stacks_of_the_gaps_are_the_idle_tagged_ones(pods: dict) -> None:
    trainer = pods["trainer-0"]
    assert (trainer["cpu_samples_gpu_idle"], trainer["cpu_samples_gpu_busy"]) == (12, 24)
    assert [f["function"] for f in trainer["idle_top_functions"]][:1] == ["slow_collate (train.py)"]
    wall = {f["function"]: f["self"] for f in trainer["idle_wall_top_functions"]}
    assert wall["futex_wait"] == 80 * MS  # the off-CPU wait, in ns; the CPU samples beside it
    assert trainer["idle_wall_seconds"] == pytest.approx(0.08 + 12 / 19, abs=1e-3)


def test_a_pod_without_the_library_is_answered_from_nvml(pods: dict) -> None:
    server = pods["infer-0"]
    assert server["idle_source"] == "nvml"
    assert server["idle_ratio"] == 0.5 == server["nvml_idle_ratio"]
    assert (server["gaps"], server["idle_seconds"], server["activity_seconds"]) == (0, None, 0.0)


def test_gpus_command_prints_the_exact_idle_and_the_gaps(collector: RunningCollector, pods: dict) -> None:
    r = fleetprof("gpus", "--collector", collector.url, "--since", "5m")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("ml") and "trainer-0" in line)
    assert lines[row].split()[-2] == "2%"  # 37 ms of 1.8 s
    detail = lines[row + 1]
    assert "IDLE is exact (CUPTI): 37.0ms of 1.8s seen, in 5 gaps" in detail
    assert "1.0ms-10.0ms 1" in detail and "10.0ms-100.0ms 2" in detail and "longest 20.0ms" in detail
    server = next(line for line in lines if "infer-0" in line)
    assert server.split()[-2] == "50%" and "IDLE is exact" not in lines[lines.index(server) + 1]


def test_prometheus_has_the_exact_idle_of_the_latest_window_beside_nvmls(
    collector: RunningCollector, pods: dict
) -> None:
    text = http_get(f"{collector.url}/metrics").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    exact = {s.labels["pod"]: s.value for s in families["fleetprof_pod_gpu_exact_idle_ratio"].samples}
    assert exact == {"trainer-0": pytest.approx(12.004 / 900)}  # the newest window: gaps of 12 ms and 4 µs
    nvml = {s.labels["pod"]: s.value for s in families["fleetprof_pod_gpu_idle_ratio"].samples}
    assert nvml == {"trainer-0": 0.0, "infer-0": 0.5}
