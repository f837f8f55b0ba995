"""GPU data end to end: scripted NVML → poller → window attributed to pods → Batch → real gRPC → a real
collector, whose /metrics shows device and per-pod GPU series with the right labels and values."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, http_get
from tests.support.gpu_batches import GIB, gpu_batch
from tests.support.wire import make_batch, push


def scrape(col: RunningCollector) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(http_get(f"{col.url}/metrics").decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def device(gpu: str, uid: str, model: str) -> tuple:
    return (("gpu", gpu), ("model", model), ("node", "gpu-node-1"), ("uuid", uid))


def pod(ns: str, name: str, container: str, gpu: str) -> tuple:
    return (("container", container), ("gpu", gpu), ("namespace", ns), ("node", "gpu-node-1"), ("pod", name))


def test_the_batch_carries_the_gpu_section(monkeypatch: pytest.MonkeyPatch) -> None:
    b = gpu_batch(monkeypatch)
    s = b.strings
    assert b.gpu_source.up and s[b.gpu_source.state] == "up" and b.gpu_source.idle_below_percent == 5
    assert [s[d.uuid] for d in b.gpu_devices] == ["GPU-train", "GPU-infer"]
    train = b.gpu_devices[0]
    assert [x.gpu_utilization_percent for x in train.samples] == [80, 0, 0, 90]
    assert (train.xid_errors, list(train.xid_codes), train.xid_watched) == (1, [79], True)
    assert b.gpu_devices[1].samples[0].HasField("power_milliwatts")  # supported there: present
    # GPM: from the second poll on (a pair of samples), on the H100 only (the L4 has none).
    assert [x.sm_active_percent for x in train.samples[1:]] == [0, 0, 90]
    assert not train.samples[0].HasField("sm_active_percent")
    assert not any(x.HasField("sm_active_percent") for x in b.gpu_devices[1].samples)
    rows = {b.processes[u.process].pid: u for u in b.gpu_processes}
    assert set(rows) == {1001, 1002, 3001, 2001}
    assert (rows[1001].polls, rows[1001].state_polls, rows[1001].idle_polls) == (4, 4, 2)
    assert rows[1001].sm_utilization_percent == 40  # (60 + 0 + 0 + 100) / 4
    assert not rows[2001].HasField("sm_utilization_percent")  # not supported on that GPU
    labels = {s[lb.name]: s[lb.value] for lb in b.processes[rows[1001].process].labels}
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("ml", "trainer-0", "trainer")
    assert len(b.process_ids) == len(b.processes) and all(b.process_ids)  # one packed id per process
    infer = b.gpu_devices[1]
    assert (s[infer.owner_namespace], s[infer.owner_pod], s[infer.owner_container]) == (
        "ml",
        "infer-0",
        "server",
    )


def test_collector_exports_gpu_and_pod_series(
    monkeypatch: pytest.MonkeyPatch, collector: RunningCollector
) -> None:
    batch = gpu_batch(monkeypatch)
    assert push(collector.grpc_target, [batch]) == [1]
    m = scrape(collector)
    train = device("0", "GPU-train", "NVIDIA H100 80GB HBM3")
    assert m[("fleetprof_gpu_utilization_ratio", train)] == pytest.approx(0.425)  # mean of the window
    assert m[("fleetprof_gpu_memory_used_bytes", train)] == 10 * GIB
    assert m[("fleetprof_gpu_memory_total_bytes", train)] == 80 * GIB
    assert m[("fleetprof_gpu_power_watts", train)] == pytest.approx(250.0)
    assert m[("fleetprof_gpu_energy_joules_total", train)] == pytest.approx(1000.0)
    assert m[("fleetprof_gpu_temperature_celsius", train)] == 50
    assert m[("fleetprof_gpu_sm_clock_hertz", train)] == pytest.approx(1.98e9)
    assert m[("fleetprof_gpu_xid_errors_total", train)] == 1
    # GPM beside utilization, the window's mean of its readings
    assert m[("fleetprof_gpu_sm_active_ratio", train)] == pytest.approx(0.30)
    assert m[("fleetprof_gpu_sm_occupancy_ratio", train)] == pytest.approx(0.15)
    assert m[("fleetprof_gpu_tensor_active_ratio", train)] == pytest.approx(0.70 / 3)
    assert m[("fleetprof_gpu_dram_bandwidth_ratio", train)] == pytest.approx(0.20)
    infer = device("1", "GPU-infer", "NVIDIA L4")
    assert ("fleetprof_gpu_sm_active_ratio", infer) not in m  # no GPM there
    assert m[("fleetprof_gpu_utilization_ratio", infer)] == pytest.approx(0.03)
    assert ("fleetprof_gpu_xid_errors_total", infer) not in m  # XID events not supported there
    assert m[("fleetprof_gpu_source_up", (("node", "gpu-node-1"),))] == 1

    trainer = pod("ml", "trainer-0", "trainer", "0")
    assert m[("fleetprof_pod_gpu_utilization_ratio", trainer)] == pytest.approx(0.40)
    assert m[("fleetprof_pod_gpu_memory_used_bytes", trainer)] == 8 * GIB
    assert m[("fleetprof_pod_gpu_idle_ratio", trainer)] == pytest.approx(0.5)
    # the exited process is credited to the pod the kubelet says holds its GPU; no per-process
    # utilization on that GPU, and the pod is alone on it: the GPU's own utilization
    server = pod("ml", "infer-0", "server", "1")
    assert m[("fleetprof_pod_gpu_utilization_ratio", server)] == pytest.approx(0.03)
    assert m[("fleetprof_pod_gpu_memory_used_bytes", server)] == GIB
    assert m[("fleetprof_pod_gpu_idle_ratio", server)] == pytest.approx(1.0)
    # the host process (nvidia-persistenced) gets no pod series
    pods = {dict(k[1])["pod"] for k in m if k[0].startswith("fleetprof_pod_gpu_")}
    assert pods == {"trainer-0", "infer-0"}

    # a resent duplicate does not count the XID twice
    assert push(collector.grpc_target, [batch]) == [1]
    assert scrape(collector)[("fleetprof_gpu_xid_errors_total", train)] == 1


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda b: setattr(b.gpu_processes[0], "device", 9), "refers to gpu device 9"),
        (lambda b: setattr(b.gpu_processes[0], "process", 50), "refers to process 50"),
        (lambda b: setattr(b.gpu_processes[0], "idle_polls", 7), "does not hold"),
        (lambda b: setattr(b.gpu_devices[0], "uuid", 999), "uuid refers to string 999"),
    ],
)
def test_bad_gpu_sections_are_refused_by_name(collector: RunningCollector, mutate, expected: str) -> None:
    b = make_batch()
    b.strings.extend(["GPU-x", "up"])
    b.gpu_source.CopyFrom(pb.GpuSource(up=True, state=len(b.strings) - 1))
    b.gpu_devices.append(pb.GpuDevice(uuid=len(b.strings) - 2, samples=[pb.GpuSample(time_unix_ns=1)]))
    b.gpu_processes.append(pb.GpuProcessUsage(process=0, device=0, polls=1, state_polls=1, idle_polls=1))
    mutate(b)
    with pytest.raises(grpc.RpcError) as err:
        push(collector.grpc_target, [b])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()


def test_batches_without_gpus_export_nothing(collector: RunningCollector) -> None:
    assert push(collector.grpc_target, [make_batch()]) == [1]
    assert not [k for k in scrape(collector) if k[0].startswith(("fleetprof_gpu_", "fleetprof_pod_gpu_"))]
