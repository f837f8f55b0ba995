"""Our CUPTI library (agent/cupti/), the real build, in real processes on the CUDA stand-ins
(tests/cuda_standin): what it records is checked against the workload's own log and the simulated device."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from fleetprof.agent.gpu.activity import LaunchIndex, ProcessActivity
from fleetprof.agent.gpu.cupti_ring import RingError, RingReader
from tests.cuda_standin import CudaStandins, HeldRun, build_standins, run_held

LATENCY_NS = 2_000  # STANDIN_LAUNCH_LATENCY_NS
# The stand-in CUPTI converts its clock to the library's timestamp callback through one bracketed reading
# (tightest of 8); its error is half that bracket, a few tens of ns. 1 µs is the records' stated resolution.
CLOCK_TOLERANCE_NS = 1_000
CBID_CU_LAUNCH_KERNEL_EX, CBID_CU_GRAPH_LAUNCH, CBID_CUDA_LAUNCH_KERNEL = 652, 514, 211
EXACT = {"FLEETPROF_CUPTI_SAMPLE_EVERY": "1", "FLEETPROF_CUPTI_SAMPLE_CAP": "0"}


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


@pytest.fixture(scope="module")
def phases(cuda: CudaStandins) -> HeldRun:
    run = run_held(cuda, ["phases", "1.2", "5,12,20"], **EXACT)
    assert run.returncode == 0, run.stderr
    return run


def kernel_bounds(launches: list[dict]) -> list[tuple[int, int, int, int]]:
    """Each logged kernel's possible [start] range on the one stream they share, from the log alone: it
    starts LATENCY_NS after the driver took it (between the call's entry and exit) or when the kernel before
    it ends, whichever is later. Returns (lo_start, hi_start, lo_end, hi_end) per launch, in order."""
    out, lo_end, hi_end = [], 0, 0
    for launch in launches:
        lo = max(launch["enter"] + LATENCY_NS, lo_end)
        hi = max(launch["exit"] + LATENCY_NS, hi_end)
        lo_end, hi_end = lo + launch["dur"], hi + launch["dur"]
        out.append((lo, hi, lo_end, hi_end))
    return out


def test_every_kernel_is_recorded_with_the_simulated_times_on_the_monotonic_clock(phases: HeldRun) -> None:
    logged = phases.logged("launch")
    kernels = sorted(phases.kernels(), key=lambda k: k.start_ns)
    assert phases.header.state == "running" and phases.header.cupti_path.endswith("libcupti.so.13")
    assert [k.name for k in kernels] == [e["kernel"] for e in logged]
    for k, e, (lo, hi, _, _) in zip(kernels, logged, kernel_bounds(logged), strict=True):
        assert k.end_ns - k.start_ns == e["dur"], (k, e)  # the device's duration, to the ns
        assert lo - CLOCK_TOLERANCE_NS <= k.start_ns <= hi + CLOCK_TOLERANCE_NS, (k, e, lo, hi)
        assert (k.device_id, k.stream_id, k.context_id) == (0, 7, 1)
    # GPU time per kernel name: exactly what was launched.
    truth: dict[str, int] = defaultdict(int)
    for e in logged:
        truth[e["kernel"]] += e["dur"]
    ours: dict[str, int] = defaultdict(int)
    for k in kernels:
        ours[k.name] += k.end_ns - k.start_ns
    assert ours == truth
    assert phases.header.counters["cupti_dropped"] == 0 and sum(b.lost + b.torn for b in phases.batches) == 0


def test_launches_are_counted_once_each_and_nesting_names_both_calls(phases: HeldRun) -> None:
    logged = phases.logged("launch")
    counters = phases.header.counters
    assert counters["launches"] == counters["sampled"] == len(logged)
    assert counters["nesting_repairs"] == 0
    launches = phases.launches()
    assert len(launches) == len(logged) and {launch.weight for launch in launches} == {1}
    by_api = Counter((launch.domain, launch.cbid, launch.inner_domain) for launch in launches)
    runtime = sum(e["api"] == "runtime" for e in logged)
    # cudaLaunchKernel, with the cuLaunchKernel it makes nested; cuLaunchKernelEx alone.
    assert by_api == {
        ("runtime", CBID_CUDA_LAUNCH_KERNEL, "driver"): runtime,
        ("driver", CBID_CU_LAUNCH_KERNEL_EX, None): len(logged) - runtime,
    }
    assert all(launch.result == 0 and launch.tid > 0 for launch in launches)


@pytest.mark.parametrize("which", ["outer", "inner"])
def test_each_kernel_joins_its_launch_whichever_call_cupti_names(cuda: CudaStandins, which: str) -> None:
    run = run_held(cuda, ["phases", "0.3", "5"], STANDIN_KERNEL_CORRELATION=which, **EXACT)
    index = LaunchIndex()
    index.add(run.launches())
    kernels = run.kernels()
    joined = [index.get(k.correlation_id) for k in kernels]
    assert kernels and all(joined), [k for k, j in zip(kernels, joined, strict=True) if j is None][:3]
    # Each launch has exactly its one kernel, which started after the launch call was entered.
    assert len({j.correlation_id for j in joined}) == len(kernels)
    assert all(j.enter_ns < k.start_ns for k, j in zip(kernels, joined, strict=True))


def test_loader_gaps_are_found_at_their_true_length(phases: HeldRun) -> None:
    activity = ProcessActivity()
    for batch in phases.batches:
        activity.add(batch)
    logged = phases.logged("launch")
    bounds = kernel_bounds(logged)
    loads = phases.logged("load")
    gaps = activity.gaps(logged[0]["enter"], phases.events[-1].get("end", 1 << 62))
    assert len(loads) >= 6
    for load in loads[:-1]:
        before = max(i for i, e in enumerate(logged) if e["exit"] <= load["start"])
        after = before + 1
        (gap,) = [g for g in gaps if g.start_ns <= load["start"] and g.end_ns >= load["end"]]
        # The gap runs from the end of the kernel launched last before the loader to the start of the
        # first one after it: both known from the log to within their launch calls.
        tol = CLOCK_TOLERANCE_NS
        assert bounds[before][2] - tol <= gap.start_ns <= bounds[before][3] + tol
        assert bounds[after][0] - tol <= gap.end_ns <= bounds[after][1] + tol
        assert gap.length_ns >= load["end"] - load["start"] >= 5_000_000
        middle = (load["start"] + load["end"]) // 2
        assert activity.state(middle) == "idle" and activity.is_idle(middle)
    for k in phases.kernels()[:50]:
        assert activity.state((k.start_ns + k.end_ns) // 2) == "busy"
    # Past the last flush nothing is claimed.
    assert activity.state(phases.header.flushed_ns + 1) is None


def test_sampled_launches_estimate_each_kernels_launch_count_within_4_sigma(cuda: CudaStandins) -> None:
    every = 8
    run = run_held(cuda, ["phases", "2.5", "2"], FLEETPROF_CUPTI_SAMPLE_EVERY=str(every),
                   FLEETPROF_CUPTI_SAMPLE_CAP="0")  # fmt: skip
    assert run.returncode == 0, run.stderr
    logged = run.logged("launch")
    assert run.header.counters["launches"] == len(logged)  # counted exactly even when sampled
    truth = Counter(e["kernel"] for e in logged)
    index = LaunchIndex()
    launches = run.launches()
    index.add(launches)
    assert launches and {launch.weight for launch in launches} == {every}  # no cap: each weighs N
    estimate: Counter[str] = Counter()
    for k in run.kernels():
        launch = index.get(k.correlation_id)
        if launch is not None:
            estimate[k.name] += launch.weight
    for name, n in truth.items():
        # Each launch is sampled with p = 1/N and weighs N: Var = N^2 * n p (1 - p) = n (N - 1).
        sigma = math.sqrt(n * (every - 1))
        assert abs(estimate[name] - n) <= 4 * sigma, (name, estimate[name], n, sigma)
    # Enough launches for the bound to mean something: relu's 4 sigma is under 40% of its count at 200.
    assert truth["relu_kernel"] >= 200


def test_the_rate_cap_bounds_samples_and_keeps_the_launch_total_unbiased(cuda: CudaStandins) -> None:
    cap = 1000
    run = run_held(cuda, ["loop", "0.6"], FLEETPROF_CUPTI_SAMPLE_EVERY="1",
                   FLEETPROF_CUPTI_SAMPLE_CAP=str(cap))  # fmt: skip
    assert run.returncode == 0, run.stderr
    (loop,) = run.logged("loop")
    counters = run.header.counters
    assert counters["launches"] == loop["launches"]
    # Per 100 ms window at most 3 cap/10 + 1 samples (the hard cap), and the thread's first window started
    # before the loop's clock did: at most one window more than the loop's own seconds hold.
    windows = math.ceil(loop["seconds"] / 0.1) + 1
    assert 0 < counters["sampled"] <= windows * (cap * 3 // 10 + 1)
    # The cap raised the thread's 1-in-N rather than refusing: N follows the launch rate over the cap, and a
    # burst (here the thread's first launches, at 1-in-1) is re-rated within cap/10 samples, before the hard
    # cap. Were N left at 1 until a window's end, all but ~cap/5 launches of that window would be refused,
    # and their weight carried onto one launch's stack. A machine too slow to
    # outrun the cap 4 times proves nothing.
    raised = loop["launches"] / loop["seconds"] / cap
    assert raised >= 4, loop
    assert counters["sample_capped"] <= counters["sampled"], counters
    # The mean weight is the loop's rate over the cap, within the windows' slack (samples <= 3x the cap per
    # window, bounded above), whatever the rate did window by window.
    assert counters["sampled_weight"] / counters["sampled"] >= raised / 4, (counters, raised)
    # The ring's launch records (its last lap only: kernel records fill it at this rate) carry weights no
    # larger than the library's running maximum.
    top = counters["sampled_weight_max"]
    assert all(0 < launch.weight <= top for launch in run.launches()), top
    assert top >= counters["sampled_weight"] / counters["sampled"], counters
    # Each launch was sampled with probability 1/w and weighs w, so the weights' sum estimates the launches
    # without bias; Var = sum over launches of (w - 1) <= launches * (max w - 1). The weight the hard cap
    # carries forward (at most one sample's worth) may still be pending at the end.
    sigma = math.sqrt(loop["launches"] * (top - 1))
    assert abs(counters["sampled_weight"] - loop["launches"]) <= 4 * sigma + top, (counters, loop, sigma)


def test_a_graph_launch_is_one_launch_with_all_its_kernels(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["graph", "40"], **EXACT)
    assert run.returncode == 0, run.stderr
    assert run.header.counters["launches"] == 40
    index = LaunchIndex()
    index.add(run.launches())
    kernels = run.kernels()
    assert Counter(k.name for k in kernels) == dict.fromkeys(("_Z11gemm_kernelPKfS0_Pfi", "relu_kernel",
                                                               "adam_kernel"), 40)  # fmt: skip
    per_launch = Counter(index.get(k.correlation_id).correlation_id for k in kernels)
    assert set(per_launch.values()) == {3}
    assert {launch.cbid for launch in run.launches()} == {CBID_CU_GRAPH_LAUNCH}


def test_copies_are_recorded_with_their_bytes_and_duration(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["copies", "15"], **EXACT)
    assert run.returncode == 0, run.stderr
    copies = run.copies()
    memcpy = [c for c in copies if c.kind == "memcpy"]
    memset = [c for c in copies if c.kind == "memset"]
    assert len(memcpy) == len(memset) == 15
    # 1 MiB host to device at 10 B/ns plus 1 µs; 4 KiB set at 100 B/ns plus 0.5 µs.
    mib = 1 << 20
    assert {(c.copy_kind, c.bytes, c.end_ns - c.start_ns) for c in memcpy} == {(1, mib, 1000 + mib // 10)}
    assert {(c.bytes, c.end_ns - c.start_ns) for c in memset} == {(4096, 500 + 4096 // 100)}
    assert run.header.counters["copies"] == 30 and run.header.counters["launches"] == 0


def test_FLEETPROF_CUPTI_0_records_nothing_and_the_workload_runs_as_without(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["phases", "0.3", "5"], FLEETPROF_CUPTI="0")
    assert run.returncode == 0 and run.logged("done")
    header = run.header
    assert header.state == "disabled" and header.write_seq == 0
    assert all(v == 0 for v in header.counters.values())
    assert not run.kernels() and not run.launches()


def test_a_workload_without_the_injection_runs_unchanged(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["phases", "0.3", "5"], inject=False)
    assert run.returncode == 0 and run.stderr == ""
    assert run.logged("done") and run.batches == []  # no library mapped: nothing to read


def test_no_libcupti_leaves_the_workload_running_and_says_why(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["phases", "0.3", "5"], FLEETPROF_CUPTI_LIBRARY="/nonexistent/libcupti.so.13")
    assert run.returncode == 0 and run.logged("done")
    assert run.header.state == "no_cupti"
    assert "/nonexistent/libcupti.so.13" in run.header.state_message
    assert "fleetprof_cupti: not recording" in run.stderr


def test_a_bad_setting_is_named_on_stderr_and_the_default_used(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["phases", "0.2", "5"], FLEETPROF_CUPTI_SAMPLE_EVERY="often")
    assert run.returncode == 0
    assert "FLEETPROF_CUPTI_SAMPLE_EVERY=often is not an integer" in run.stderr
    assert run.header.state == "running" and run.header.sample_every == 8


# A process where another CUPTI client subscribed first (as torch.profiler's kineto or nsys would).
OTHER_SUBSCRIBER = """
import ctypes, sys
cupti = ctypes.CDLL("libcupti.so.13")
handle = ctypes.c_void_p()
assert cupti.cuptiSubscribe(ctypes.byref(handle), None, None) == 0
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0  # the driver loads our library now; its cuptiSubscribe must fail
print("holding", flush=True)
sys.stdin.readline()
"""


def test_the_library_steps_aside_when_another_cupti_client_holds_the_process(cuda: CudaStandins) -> None:
    proc = subprocess.Popen([sys.executable, "-c", OTHER_SUBSCRIBER], env=cuda.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "holding", proc.stderr.read()
        reader = RingReader.open(proc.pid)
        header = reader.poll().header
        assert header.state == "cupti_error" and header.state_detail == 39  # MULTIPLE_SUBSCRIBERS
        assert "cuptiSubscribe" in header.state_message and "another CUPTI client" in header.state_message
        assert header.write_seq == 0
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        assert "another CUPTI client" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_reader_says_gone_once_the_process_exited(cuda: CudaStandins) -> None:
    proc = subprocess.Popen([str(cuda.launcher), "phases", "0.1", "5"], env=cuda.env(HOLD="1", **EXACT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if "holding" in line:
            break
    reader = RingReader.open(proc.pid)
    reader.poll()
    proc.stdin.close()
    proc.wait(timeout=30)
    with pytest.raises(RingError) as err:
        reader.poll()
    assert err.value.reason == "gone"
    assert not os.path.exists(f"/proc/{proc.pid}/mem")
