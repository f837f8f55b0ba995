"""GPU-idle profiles on the collector: samples tagged with their GPU's state are selectable with
gpu=idle|busy, and /api/v1/gpus (and `fleetprof gpus`) joins per-pod GPU usage with idle-time CPU stacks."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import stack_wire_id
from fleetprof.collector.render.tree import parse_folded
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.gpu_batches import T0, gpu_batch
from tests.support.wire import push

NOW = time.time()
RANGE = {"from": str(NOW - 60), "until": str(NOW + 60)}


def tagged_batch(monkeypatch: pytest.MonkeyPatch) -> pb.Batch:
    """The GPU test batch (trainer-0's GPU idle in 2 of 4 polls) plus CPU samples of its pid 1001:
    30 while the GPU was idle, 10 while busy, 5 untagged (unknown state)."""
    batch = gpu_batch(monkeypatch)
    shift = int((NOW - T0) * 1e9)  # the scripted polls ran at T0; the store keeps only recent windows
    batch.start_unix_ns += shift
    batch.end_unix_ns += shift
    proc = next(i for i, p in enumerate(batch.processes) if p.pid == 1001)
    base = len(batch.strings)
    batch.strings.extend(["load_batch", "collate", "launch_kernels", "python3"])
    batch.stacks.append(pb.Stack(functions=[base + 1, base], modules=[base + 3] * 2, kernel_start=2))
    batch.stack_ids.append(stack_wire_id(["collate", "load_batch"], ["python3"] * 2, 2))
    batch.stacks.append(pb.Stack(functions=[base + 2], modules=[base + 3], kernel_start=1))
    batch.stack_ids.append(stack_wire_id(["launch_kernels"], ["python3"], 1))
    idle, busy = len(batch.stacks) - 2, len(batch.stacks) - 1
    cols = batch.sample_columns
    assert not cols.process  # the scripted GPU batch has no CPU samples of its own
    cols.process.extend([proc] * 3)
    cols.stack.extend([idle, busy, busy])
    cols.count.extend([30, 10, 5])
    cols.gpu.extend([pb.GPU_STATE_IDLE, pb.GPU_STATE_BUSY, pb.GPU_STATE_NONE])
    return batch


def folded(col: RunningCollector, **params: str) -> dict:
    q = urllib.parse.urlencode({"query": '{pod="trainer-0"}', "format": "folded", **RANGE, **params})
    return {
        tuple(f.function for f in stack): n
        for stack, n in parse_folded(http_get(f"{col.url}/api/v1/profile?{q}").decode()).items()
    }


def test_samples_select_by_the_gpu_state_at_sample_time(
    collector: RunningCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert push(collector.grpc_target, [tagged_batch(monkeypatch)]) == [1]
    assert folded(collector, gpu="idle") == {("collate", "load_batch"): 30}
    assert folded(collector, gpu="busy") == {("launch_kernels",): 10}
    assert folded(collector) == {("collate", "load_batch"): 30, ("launch_kernels",): 15}
    # gpu_state is an ordinary label too, and gpu= composes with any selector.
    assert collector.json("/api/v1/labels/gpu_state/values", **RANGE)["values"] == ["busy", "idle"]
    top = collector.json("/api/v1/top", query='{namespace="ml"}', gpu="idle", **RANGE)
    assert top["total"] == 30 and top["functions"][0]["function"] == "load_batch"
    with pytest.raises(urllib.error.HTTPError) as bad:
        folded(collector, gpu="sleepy")
    assert bad.value.code == 400
    assert json.loads(bad.value.read())["error"] == '"gpu" must be "idle" or "busy", got \'sleepy\''


def test_gpus_joins_pod_gpu_usage_with_idle_time_stacks(
    collector: RunningCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    push(collector.grpc_target, [tagged_batch(monkeypatch)])
    pods = {(p["namespace"], p["pod"]): p for p in collector.json("/api/v1/gpus", **RANGE)["pods"]}
    trainer = pods[("ml", "trainer-0")]
    assert trainer["gpus"] == ["gpu-node-1/0"]
    assert trainer["idle_ratio"] == 0.5  # the GPU was below 5% in 2 of its 4 polls
    assert trainer["memory_used_bytes"] == 8 << 30  # pids 1001 + 1002
    assert (trainer["cpu_samples_gpu_idle"], trainer["cpu_samples_gpu_busy"]) == (30, 10)
    assert [f["function"] for f in trainer["idle_top_functions"]][:2] == ["load_batch", "collate"]
    # The inference pod's GPU reports no per-process utilization: it is alone there, so it gets the GPU's.
    assert pods[("ml", "infer-0")]["utilization_ratio"] == 0.03
    only = collector.json("/api/v1/gpus", query='{pod="infer-0"}', **RANGE)["pods"]
    assert [p["pod"] for p in only] == ["infer-0"]

    r = fleetprof("gpus", "--collector", collector.url, "--from", RANGE["from"], "--until", RANGE["until"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    row = next(line for line in out.splitlines() if "trainer-0" in line)
    assert row.split()[:3] == ["ml", "trainer-0", "gpu-node-1/0"] and row.split()[-2:] == ["50%", "75%"]
    assert "100.0% of its CPU while idle: load_batch" in out  # self time, of its idle-time samples

    r = fleetprof(
        "flame", "--gpu-idle", "--collector", collector.url, "--query", '{pod="trainer-0"}',
        "--from", RANGE["from"], "--until", RANGE["until"],
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    flame = r.stdout
    assert flame.strip().endswith("load_batch 30") and "launch_kernels" not in flame


def test_gpus_shows_where_the_idle_time_went_running_or_waiting(
    collector: RunningCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer-0's 30 idle-time samples (at the batch's frequency) plus 4 s its threads spent blocked in
    read_shard while the GPU idled: the wall view puts read_shard first."""
    batch = tagged_batch(monkeypatch)
    proc = next(i for i, p in enumerate(batch.processes) if p.pid == 1001)
    # read_shard in read() as the agent records it on this kernel (tests/collector/test_waits.py)
    names = ["read_shard", "read", "entry_SYSCALL_64_after_hwframe", "do_syscall_64", "ksys_read"]
    names += ["vfs_read", "schedule", "__schedule"]
    modules = ["python3", "libc.so.6", *["[kernel]"] * 6]
    base = len(batch.strings)
    batch.strings.extend([*names, "libc.so.6", "[kernel]"])
    module_ids = {"python3": base - 1, "libc.so.6": base + len(names), "[kernel]": base + len(names) + 1}
    assert batch.strings[base - 1] == "python3"
    batch.stacks.append(
        pb.Stack(
            functions=range(base, base + len(names)), modules=[module_ids[m] for m in modules], kernel_start=2
        )
    )
    batch.stack_ids.append(stack_wire_id(names, modules, 2))
    oc = batch.offcpu_columns
    oc.process.append(proc)
    oc.stack.append(len(batch.stacks) - 1)
    oc.blocked_ns.append(4_000_000_000)
    oc.gpu.append(pb.GPU_STATE_IDLE)
    assert push(collector.grpc_target, [batch]) == [1]
    pods = {(p["namespace"], p["pod"]): p for p in collector.json("/api/v1/gpus", **RANGE)["pods"]}
    trainer = pods[("ml", "trainer-0")]
    assert trainer["cpu_samples_gpu_idle"] == 30  # CPU counts stay samples
    cpu_ns = 30 * round(1e9 / batch.frequency_hz)
    assert trainer["idle_wall_seconds"] == round((cpu_ns + 4_000_000_000) / 1e9, 3)
    # By frame, the wait's leaf is the scheduler; by where it blocked, read_shard in read.
    assert trainer["idle_wall_top_functions"][0]["function"] == "__schedule"
    first = trainer["idle_wall_top_waits"][0]
    assert (first["function"], first["reason"], first["value"]) == ("read_shard", "read", 4_000_000_000)
    r = fleetprof("gpus", "--collector", collector.url, "--from", RANGE["from"], "--until", RANGE["until"])
    assert r.returncode == 0, r.stderr
    assert "of its wall time while idle: read_shard (read)" in r.stdout
    assert "of its wall time while idle: load_batch (running)" in r.stdout
