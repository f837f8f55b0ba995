"""Exact GPU idle and kernel time end to end: a workload in a pod's cgroup runs known kernels with known
loader gaps on the CUDA stand-ins (tests/cuda_standin) with our real CUPTI library injected; the real agent
finds it, reads its ring every drain and ships the activity to a real collector, whose /api/v1/gpus,
`fleetprof gpus` and /api/v1/profile?type=gpu are checked against the simulated device's truth."""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent.test_cupti_library import CLOCK_TOLERANCE_NS, EXACT, kernel_bounds
from tests.conftest import (
    acked_batches,
    fleetprof,
    wait_until,
)
from tests.cuda_standin import CudaStandins, build_standins
from tests.e2e.test_kubernetes_e2e import V1_CPU, Cluster, kube_cluster, make_cgroup, remove_cgroups
from tests.support.fake_apiserver import event, make_pod

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

NODE = "test-node"
MS = 1_000_000
POD = "trainer-0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kube_cluster(tmp_path_factory) as running:
        yield running


@dataclass
class Run:
    pid: int
    events: list[dict]

    def logged(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]


def run_in_pod(cluster: Cluster, cuda: CudaStandins, leaf: Path, argv: list[str]) -> Run:
    """The launcher in the pod's cgroup: it waits once the driver has loaded our library until the agent
    has opened its ring (so its whole timeline is known), runs, and holds until the agent has drained past
    its last kernel."""
    script = f'echo $$ > {leaf / "cgroup.procs"} && exec "$@"'
    proc = subprocess.Popen(
        ["sh", "-c", script, "sh", str(cuda.launcher), *argv],
        # Synchronizing calls spin, as CUDA's default schedule does: CPU samples while the GPU runs.
        env=cuda.env(HOLD="1", WAIT_AFTER_INIT="1", STANDIN_SYNC_SPIN="1", **EXACT),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events: list[dict] = []
    said: dict[str, threading.Event] = {"initialised": threading.Event(), "holding": threading.Event()}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["ev"] in said:
                said[events[-1]["ev"]].set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert proc.stdin is not None
        assert said["initialised"].wait(60), proc.stderr.read() if proc.poll() is not None else "no start"
        # Found by its capture (it maps libcuda) and opened at a drain.
        wait_until(
            lambda: cluster.agent.value("fleetprof_agent_cupti_processes") >= 1,
            30,
            "the agent to open the workload's ring",
        )
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert said["holding"].wait(120), "the workload did not finish"
        # The library flushes every 100 ms; the agent reports what was flushed by each 1 s drain.
        first = acked_batches(cluster.agent)
        wait_until(lambda: acked_batches(cluster.agent) >= first + 3, 60, "three more batches acknowledged")
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        first = acked_batches(cluster.agent)
        wait_until(lambda: acked_batches(cluster.agent) >= first + 2, 60, "two more batches acknowledged")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Run(proc.pid, events)


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    if not (V1_CPU / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu hierarchy on this machine")
    cuda = build_standins(tmp_path_factory.mktemp("cuda"))
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    pod = make_pod(POD, uid, node=NODE, namespace="ml", resource_version="101", containers={"main": cid})
    cluster.api.push(event("ADDED", pod))
    wait_until(lambda: cluster.agent.value("fleetprof_agent_pods") >= 1, 20, "the pod in the agent's cache")
    leaf = make_cgroup(V1_CPU / "kubepods" / "burstable" / f"pod{uid}" / cid)
    try:
        return run_in_pod(cluster, cuda, leaf, ["phases", "4", "5,12,20"])
    finally:
        remove_cgroups(leaf, V1_CPU)


def test_gpus_gives_the_exact_idle_time_and_gaps_of_the_simulated_device(
    cluster: Cluster, trained: Run
) -> None:
    got = cluster.collector.json("/api/v1/gpus", since="5m", functions="0")
    (row,) = [p for p in got["pods"] if p["pod"] == POD]
    launches, loads = trained.logged("launch"), trained.logged("load")
    bounds = kernel_bounds(launches)
    tol = CLOCK_TOLERANCE_NS
    assert row["idle_source"] == "activity" and row["records_lost"] == 0
    assert row["gpus"] == [f"{NODE}/cuda0"]
    # The ring was open before the first kernel and the agent drained past the last one: every kernel is
    # inside what is known, which starts at the first kernel.
    span = bounds[-1][2] - bounds[0][1]
    known_ns = round(row["activity_seconds"] * 1e9)
    assert known_ns >= span - 2 * tol
    # Idle is what is known less the kernels (one stream: they never overlap); a stretch under 1 µs between
    # two kernels counts as busy; the API rounds seconds to the µs.
    busy = sum(e["dur"] for e in launches)
    idle_ns = round(row["idle_seconds"] * 1e9)
    assert known_ns - busy - 1_000 * len(launches) - 2_000 <= idle_ns <= known_ns - busy + 2_000
    # Each loader pause is one gap of 1 ms or more; the log says which gaps must exist and which may (a
    # kernel's start is known to within its launch call, and a busy machine may pause the CPU between
    # launches longer than the GPU takes to run them).
    lengths = [
        (lo_next - hi_end - 2 * tol, hi_next - lo_end + 2 * tol)
        for (_, _, lo_end, hi_end), (lo_next, hi_next, _, _) in zip(bounds, bounds[1:], strict=False)
    ]
    between = [ld for ld in loads if ld["end"] < launches[-1]["enter"]]
    assert len(between) >= 50 and sum(lo >= MS for lo, _ in lengths) >= len(between)
    hist = {b["le_seconds"]: b["count"] for b in row["gap_histogram"]}
    # Per bucket from 1 ms up: the gaps whose possible lengths lie wholly in it, and those that may.
    edges = [(MS, 10 * MS, 1e-2), (10 * MS, 100 * MS, 1e-1), (100 * MS, 1_000 * MS, 1.0)]
    for lo_b, hi_b, le in edges:
        must = sum(lo_b <= lo and hi < hi_b for lo, hi in lengths)
        may = sum(hi >= lo_b and lo < hi_b for lo, hi in lengths)
        assert must <= hist[le] <= may, (le, must, hist[le], may)
    must = sum(lo >= MS for lo, _ in lengths)
    may = sum(hi >= MS for _, hi in lengths)
    assert must <= hist[1e-2] + hist[1e-1] + hist[1.0] + hist[None] <= may
    assert row["longest_gap_seconds"] * 1e9 >= max(ld["end"] - ld["start"] for ld in between)
    print(f"exact idle: {idle_ns / 1e6:.3f} ms of {known_ns / 1e6:.3f} ms in {row['gaps']} gaps; {hist}")

    r = fleetprof("gpus", "--collector", cluster.collector.url, "--since", "5m")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if POD in line)
    assert "IDLE is exact (CUPTI)" in lines[at + 1] and f"in {row['gaps']} gaps" in lines[at + 1]


def test_gpu_profile_gives_kernel_time_per_kernel_name(cluster: Cluster, trained: Run) -> None:
    truth: dict[str, int] = defaultdict(int)
    for e in trained.logged("launch"):
        truth[e["kernel"]] += e["dur"]
    stacks = cluster.collector.folded(f'{{pid="{trained.pid}"}}', type="gpu")
    ours: dict[str, int] = defaultdict(int)
    under_train_step = 0
    elsewhere: dict[str, int] = {}  # gemm's stacks without train_step, folded: what a failure needs told
    gemm = "gemm_kernel(float const*, float const*, float*, int)"
    for stack, ns in stacks.items():
        ours[stack[-1].function] += ns  # the kernel is the leaf, under its launching stack (the uprobes')
        if stack[-1].function == gemm:
            if any(f.function == "train_step" for f in stack):
                under_train_step += ns
            else:
                elsewhere[";".join(f.function for f in stack)] = ns
    shown = {"_Z11gemm_kernelPKfS0_Pfi": gemm}
    assert ours == {shown.get(k, k): v for k, v in truth.items()}
    # gemm is launched from train_step only: all of its time is there, to the ns, but in a window where none
    # of its ~100 launches was sampled (1 in 8: (7/8)^100 = 1.6e-6), which keeps the kernel alone.
    walks = [
        line for line in cluster.agent.metrics().splitlines() if line.startswith("fleetprof_agent_unwind_")
    ]
    assert under_train_step == truth["_Z11gemm_kernelPKfS0_Pfi"], f"elsewhere: {elsewhere}; {walks}"


def test_cpu_samples_are_tagged_by_the_exact_timeline(cluster: Cluster, trained: Run) -> None:
    """The loader runs on the CPU only while the GPU has nothing to do: its samples are tagged idle by the
    process's own timeline (100 µs slots, judged at their middle), never by NVML (there is none here)."""

    def samples_in(function: str, state: str) -> int:
        stacks = cluster.collector.folded(f'{{pid="{trained.pid}", gpu_state="{state}"}}')
        return sum(n for st, n in stacks.items() if any(f.function == function for f in st))

    loader = sum(
        n
        for st, n in cluster.collector.folded(f'{{pid="{trained.pid}"}}').items()
        if any(f.function == "load_batch" for f in st)
    )
    idle, busy = samples_in("load_batch", "idle"), samples_in("load_batch", "busy")
    loads = trained.logged("load")
    # 4 s of phases, ~85% of it in the loader, at 99 Hz: ~330 samples there on an idle machine, fewer as
    # the loader's CPU share falls on a busy one (it spins on the wall clock); enough to judge the tags.
    assert loader >= 20
    # A loader sample is tagged busy only if its 100 µs slot's middle falls before the gap began: the loader
    # starts within µs of the GPU going idle, so at most a 50 µs head of each load (>= 5 ms) can be misjudged:
    # p <= 0.01 a sample; over n samples, n*p + 4 sigma.
    n, p = loader, 50_000 / min(ld["end"] - ld["start"] for ld in loads)
    assert busy <= n * p + 4 * (n * p * (1 - p)) ** 0.5 + 1
    # Untagged: samples past what the library had flushed (every 100 ms) when their window was drained,
    # about a tenth of each 1 s window; half is far below what the timeline must tag.
    assert idle >= loader // 2
    got = cluster.collector.json("/api/v1/gpus", since="5m", functions="3")
    (row,) = [p for p in got["pods"] if p["pod"] == POD]
    assert row["cpu_samples_gpu_idle"] >= idle
    # The loader's loop: its own code and the clock it reads.
    top = row["idle_top_functions"][0]["function"]
    assert top.startswith(("load_batch", "__vdso_clock_gettime")), row["idle_top_functions"]
    # The other way round: synchronize() spins while the step's kernels (870 µs of them) run, so its samples
    # are busy but for those whose slot's middle falls past the last kernel's end (the spin ends within µs
    # of it): p <= 50 µs / 870 µs a sample.
    sync_busy, sync_idle = samples_in("synchronize", "busy"), samples_in("synchronize", "idle")
    # It spins ~7% of the workload's CPU time: ~10 samples, judged as many as there are.
    m, q = sync_busy + sync_idle, 50 / 870
    assert sync_idle <= m * q + 4 * (m * q * (1 - q)) ** 0.5 + 1
    print(
        f"loader samples {loader}: idle {idle}, busy {busy}; synchronize: {sync_busy} busy, {sync_idle} idle"
    )
