"""GPU-idle tagging end to end in the agent: real eBPF samples of a real workload whose CPU phases
alternate with its (scripted) GPU's busy/idle phases; each sample is tagged with the GPU state at its
time, so the idle-time profile is the idle-phase function."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.main import Agent, AgentConfig
from tests.conftest import RunningCollector, free_port, require_bpf
from tests.fake_pynvml import FakeGpu, FakeNvml
from tests.wire import sample_rows

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

PHASE_MS = 1500  # each phase: GPU busy (CPU in gpu_busy_phase), then GPU idle (CPU in gpu_idle_phase)
POLL_S = 0.2  # GPU poll interval = tagging resolution


def test_samples_carry_the_gpu_state_at_their_time(
    collector: RunningCollector, workload_bin: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    require_bpf()
    gpu = FakeGpu("GPU-phases", utilization=[(95, 60), (0, 0)])
    world = FakeNvml([gpu])
    monkeypatch.setitem(sys.modules, "pynvml", world.module)
    stop = threading.Event()

    def follow_the_clock() -> None:  # the GPU is busy in even phases, idle in odd ones
        while not stop.wait(0.01):
            world.step = int(time.time() * 1000) // PHASE_MS % 2

    config = AgentConfig(
        collector=collector.grpc_target,
        http=f"127.0.0.1:{free_port()}",
        frequency_hz=99,
        interval_s=1.0,
        kubernetes=False,
        pod_resources_socket="/nonexistent",
        syscalls=False,
        python=False,
        gpu_interval_s=POLL_S,
    )
    agent = Agent(config)
    clock = threading.Thread(target=follow_the_clock, daemon=True)
    clock.start()
    agent.start()
    try:
        proc = subprocess.Popen([str(workload_bin("gpu_phases")), "7", str(PHASE_MS)])
        gpu.compute = {proc.pid: 4 << 30}  # NVML lists it as a compute process on the GPU
        time.sleep(0.5)
        batches = []
        while proc.poll() is None:
            time.sleep(1.0)
            batches.append(agent.drain_once())
        time.sleep(2 * POLL_S)  # the poll that covers the last samples
        batches.append(agent.drain_once())
    finally:
        stop.set()
        agent.stop()
        agent._shutdown()
    assert proc.returncode == 0

    by_state: dict[tuple[str, int], int] = {}
    for b in batches:
        for s in sample_rows(b):
            if b.processes[s.process].pid != proc.pid:
                continue
            leaf = b.strings[b.stacks[s.stack].functions[-1]]
            if leaf in ("gpu_busy_phase", "gpu_idle_phase"):
                by_state[(leaf, s.gpu)] = by_state.get((leaf, s.gpu), 0) + s.count
    idle_phase = sum(n for (leaf, _), n in by_state.items() if leaf == "gpu_idle_phase")
    busy_phase = sum(n for (leaf, _), n in by_state.items() if leaf == "gpu_busy_phase")
    assert idle_phase > 150 and busy_phase > 150, by_state
    # Tagging is exact up to the poll resolution: only samples within a poll of a phase change can fall
    # on the wrong side (2 x 0.2 s of each 1.5 s phase at worst).
    assert by_state.get(("gpu_idle_phase", pb.GPU_STATE_IDLE), 0) > 0.7 * idle_phase, by_state
    assert by_state.get(("gpu_busy_phase", pb.GPU_STATE_BUSY), 0) > 0.7 * busy_phase, by_state
    assert by_state.get(("gpu_idle_phase", pb.GPU_STATE_BUSY), 0) < 0.2 * idle_phase, by_state
    assert by_state.get(("gpu_busy_phase", pb.GPU_STATE_IDLE), 0) < 0.2 * busy_phase, by_state
