"""A scripted GPU batch: two fake GPUs polled four times by the real poller, encoded as the agent does."""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.attribution import Attributor
from fleetprof.agent.batch import encode_window
from fleetprof.agent.gpu.poller import GpuPoller, GpuPollerConfig
from fleetprof.agent.kube.pods import PodMeta
from fleetprof.agent.model import CgroupIdentity, DeviceAssignment, ProcessInfo, Window
from fleetprof.agent.resolver import window_processes
from tests.support.fake_pynvml import CONSTANTS, FakeGpu, FakeNvml

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


def _gpm(sm: float, occupancy: float, tensor: float, dram: float) -> dict[int, float]:
    names = ("SM_UTIL", "SM_OCCUPANCY", "ANY_TENSOR_UTIL", "DRAM_BW_UTIL")
    return {
        CONSTANTS[f"NVML_GPM_METRIC_{n}"]: v
        for n, v in zip(names, (sm, occupancy, tensor, dram), strict=True)
    }


def gpu_batch(monkeypatch: pytest.MonkeyPatch) -> pb.Batch:
    """Four polls one second apart of two GPUs; encoded the way Agent.drain_once does it."""
    us = int(T0 * 1e6)
    train = FakeGpu(
        "GPU-train",
        utilization=[(80, 30), (0, 0), (0, 0), (90, 40)],
        compute={1001: 6 * GIB, 1002: 2 * GIB, 3001: GIB // 2},
        # pid 1001's kernels: 60% before the first poll, nothing for two polls, 100% before the fourth
        process_samples=[(1001, us - 500_000, 60, 10)],
        # GPM (an H100 has it): SM active, occupancy, tensor active, DRAM bandwidth over each poll's
        # interval; the first poll has no pair yet.
        gpm=[_gpm(50, 20, 10, 30), _gpm(0, 0, 0, 0), _gpm(0, 0, 0, 0), _gpm(90, 45, 70, 60)],
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
    window = Window(start_ns=int(T0 * 1e9), end_ns=int((T0 + 4) * 1e9), samples=[], frequency_hz=19, gpu=gpu)
    window.labels = Attributor(_Pods()).by_process(window_processes(window))
    identity = pb.AgentIdentity(node="gpu-node-1", agent_id=uuid.uuid4().hex, boot_time_unix_ns=1)
    batch = encode_window(window, identity)
    batch.sequence = 1
    return batch
