"""The agent's self-metrics as Prometheus reads them: the unwinder's walks, their ends and its frame counts
are families of their own (a sum over one label never mixes walks with frames), and running totals such as
the table build time are counters whose sums are exact."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof.agent.metrics import AgentCounters, build_registry
from fleetprof.agent.model import CudaWindow, Frame, ProcessCuda
from fleetprof.agent.shipper import ShipperStats


def families(counters: AgentCounters, totals: dict) -> dict:
    registry, _hist = build_registry(counters, ShipperStats, dict, totals=lambda: totals)
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def test_walks_ends_and_frames_are_families_of_their_own() -> None:
    counters = AgentCounters()
    drain = {"unwind_walks": 10, "unwind_end": 7, "unwind_no_mapping": 2, "unwind_depth": 1}
    drain |= {"unwind_fp_frames": 40, "unwind_jit_fp": 3, "unwind_fallback": 5}
    counters.add_drain(drain, samples=15)
    counters.add_drain({"unwind_walks": 1, "unwind_end": 1, "unwind_fp_frames": 2}, samples=1)
    got, text = families(counters, {})
    assert got["fleetprof_agent_unwind_walks"].samples[0].value == 11
    ends = {s.labels["reason"]: s.value for s in got["fleetprof_agent_unwind_walk_ends"].samples}
    assert set(ends) == set(AgentCounters.UNWIND_ENDS)
    assert sum(ends.values()) == 11 and ends["end"] == 8 and ends["no_mapping"] == 2
    assert got["fleetprof_agent_unwind_fp_frames"].samples[0].value == 42
    assert got["fleetprof_agent_unwind_jit_fp_frames"].samples[0].value == 3
    assert got["fleetprof_agent_unwind_fallback_samples"].samples[0].value == 5
    for name in ("walks", "walk_ends", "fp_frames", "jit_fp_frames", "fallback_samples"):
        assert got[f"fleetprof_agent_unwind_{name}"].type == "counter"
    assert "unwind_events" not in text


def test_the_table_build_time_is_a_counter_and_reads_exactly() -> None:
    # 0.1 s + 0.2 s as a float sum is 0.30000000000000004; the agent sums nanoseconds and divides once.
    got, text = families(AgentCounters(), {"unwind_table_build_seconds": (300_000_000 / 1e9, "help")})
    assert got["fleetprof_agent_unwind_table_build_seconds"].type == "counter"
    assert "fleetprof_agent_unwind_table_build_seconds_total 0.3\n" in text
    assert "# TYPE fleetprof_agent_unwind_table_build_seconds gauge" not in text


def test_the_drain_thread_s_cpu_time_is_a_counter_of_exact_seconds() -> None:
    counters = AgentCounters()
    counters.add_drain_cpu({"read": 60_000_000, "resolve": 40_000_000})
    counters.add_drain_cpu({"read": 100_000_000, "encode": 100_000_000})
    got, text = families(counters, {})
    assert got["fleetprof_agent_drain_cpu_seconds"].type == "counter"
    assert "fleetprof_agent_drain_cpu_seconds_total 0.3\n" in text
    # ... and by stage, which add up to it (every stage is there, at 0 before it ran)
    stages = {s.labels["stage"]: s.value for s in got["fleetprof_agent_drain_stage_cpu_seconds"].samples}
    assert stages == {"read": 0.16, "resolve": 0.04, "processes": 0.0, "encode": 0.1, "trim": 0.0}


def test_cuda_launches_and_kernels_attributed_add_up_over_windows() -> None:
    """Kernels whose time went under a launching stack are counted beside all kernels: their ratio is how
    much of a node's GPU time the `gpu` profile puts under code rather than under a kernel name alone."""
    counters = AgentCounters()
    launched = (Frame("train_step", "app"), Frame("gemm", "[cuda]"))
    gemm = ProcessCuda(
        process=None, kernel_ns={"gemm": 900, "relu": 100}, kernel_count={"gemm": 3, "relu": 7}
    )
    gemm.kernels, gemm.kernel_stacks = 10, [(launched, 900)]  # relu's 7 under its name alone
    other = ProcessCuda(process=None, kernel_count={"gemm": 4}, kernels=4, kernel_stacks=[(launched, 50)])
    counters.add_cuda(CudaWindow([gemm, other], launch_sample_every=8, launches_seen=80, launches_sampled=10))
    counters.add_cuda(
        CudaWindow([], launch_sample_every=8, launches_seen=16, launches_sampled=2, table_full=1)
    )
    got, _ = families(counters, {})
    events = {s.labels["event"]: s.value for s in got["fleetprof_agent_cuda_events"].samples}
    assert got["fleetprof_agent_cuda_events"].type == "counter"
    assert events == {
        "launches": 96,
        "launches_sampled": 12,
        "launch_table_full": 1,
        "kernels": 14,
        "kernels_attributed": 7,
    }
