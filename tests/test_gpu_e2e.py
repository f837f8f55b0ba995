"""GPU data end to end: scripted NVML → poller → window attributed to pods → Batch → real gRPC → a real
collector, whose /metrics shows device and per-pod GPU series with the right labels and values."""

from __future__ import annotations

import sys
import time
import uuid

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.attribution import Attributor
from agent.batch import encode_window
from agent.gpu.poller import GpuPoller, GpuPollerConfig
from agent.kube.podresources import DeviceAssignment
from agent.kube.pods import PodMeta
from agent.process.cgroups import CgroupIdentity
from agent.process.table import ProcessInfo
from agent.resolver import Window
from fleetprof.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, http_get
from tests.fake_pynvml import FakeGpu, FakeNvml
from tests.test_ingest import make_batch, push

T0 = float(int(time.time()) - 60)  # recent: the collector refuses windows older than 2 h
TRAINER_UID = "0b7c6a52-1111-4c1e-9d1a-aaaaaaaaaaaa"
TRAINER_CID = "c" * 64
GIB = 1 << 30


class _Pods:
    def lookup(self, uid: str) -> PodMeta | None:
        if uid != TRAINER_UID:
            return None
        return PodMeta(
            uid=uid,
            namespace="ml",
            name="trainer-0",
            node="gpu-node-1",
            workload_kind="StatefulSet",
            workload="trainer",
            containers={TRAINER_CID: "trainer"},
            labels={},
            phase="Running",
        )


def _process(pid: int) -> ProcessInfo | None:
    if pid in (1001, 1002):
        cg = CgroupIdentity("/kubepods/pod" + TRAINER_UID, TRAINER_CID, "containerd", TRAINER_UID)
    elif pid == 3001:
        cg = CgroupIdentity("/system.slice/nvidia-persistenced.service")
    else:
        return None  # 2001 exited before the drain
    return ProcessInfo(pid, 12345, f"proc{pid}", "/usr/bin/python3", cg, ())


def _owner(gpu_uuid: str) -> DeviceAssignment | None:
    if gpu_uuid == "GPU-infer":
        return DeviceAssignment("ml", "infer-0", "server", "nvidia.com/gpu", gpu_uuid)
    return None


def gpu_batch(monkeypatch: pytest.MonkeyPatch) -> pb.Batch:
    """Four polls one second apart of two GPUs; encoded the way Agent.drain_once does it."""
    us = int(T0 * 1e6)
    train = FakeGpu(
        "GPU-train",
        utilization=[(80, 30), (0, 0), (0, 0), (90, 40)],
        compute={1001: 6 * GIB, 1002: 2 * GIB, 3001: GIB // 2},
        # pid 1001's kernels: 60% before the first poll, nothing for two polls, 100% before the fourth
        process_samples=[(1001, us - 500_000, 60, 10)],
    )
    infer = FakeGpu(
        "GPU-infer",
        name="NVIDIA L4",
        utilization=[(3, 1)],
        memory=(GIB, 24 * GIB),
        compute={2001: GIB},
        not_supported={"nvmlDeviceGetProcessUtilization"},
        xid_supported=False,
    )
    world = FakeNvml([train, infer])
    monkeypatch.setitem(sys.modules, "pynvml", world.module)
    now = [0.0]
    poller = GpuPoller(GpuPollerConfig(interval_s=1.0), clock=lambda: T0 + now[0], monotonic=lambda: now[0])
    for step in range(4):
        world.step = step
        if step == 2:
            world.events.append(("GPU-train", 79))
        if step == 3:
            train.process_samples.append((1001, us + 2_900_000, 100, 20))
        assert poller.poll_once() is not None
        now[0] += 1.0
    gpu = poller.drain().attributed(_process, _owner)
    window = Window(start_ns=int(T0 * 1e9), end_ns=int((T0 + 4) * 1e9), samples=[])
    identity = pb.AgentIdentity(node="gpu-node-1", agent_id=uuid.uuid4().hex, boot_time_unix_ns=1)
    batch = encode_window(window, identity, 19, Attributor(_Pods()), gpu)
    batch.sequence = 1
    return batch


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
    rows = {b.processes[u.process].pid: u for u in b.gpu_processes}
    assert set(rows) == {1001, 1002, 3001, 2001}
    assert (rows[1001].polls, rows[1001].state_polls, rows[1001].idle_polls) == (4, 4, 2)
    assert rows[1001].sm_utilization_percent == 40  # (60 + 0 + 0 + 100) / 4
    assert not rows[2001].HasField("sm_utilization_percent")  # not supported on that GPU
    labels = {s[lb.name]: s[lb.value] for lb in b.processes[rows[1001].process].labels}
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("ml", "trainer-0", "trainer")
    assert list(b.process_ids) == [p.id for p in b.processes] and all(b.process_ids)  # packed ids, parallel
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
    infer = device("1", "GPU-infer", "NVIDIA L4")
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
def test_bad_gpu_sections_are_refused_by_name(collector: RunningCollector, mutate, expected: str) -> None:  # noqa: ANN001
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
