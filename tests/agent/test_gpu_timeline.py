"""The GPU busy/idle timeline: which poll describes a time, per-pid state, bounds, thread safety."""

from __future__ import annotations

import threading

from fleetprof.agent.gpu.timeline import GpuTimeline


def timeline_of(points: list[tuple[float, int | None, set[int]]], **kw: float) -> GpuTimeline:
    tl = GpuTimeline(max_gap_s=2.0, **kw)
    for t, util, pids in points:
        tl.record(t, {"GPU-a": util}, {"GPU-a": pids})
    return tl


def test_a_poll_describes_the_period_before_it() -> None:
    tl = timeline_of([(10.0, 90, {7}), (11.0, 0, {7}), (12.0, 40, {7})])
    assert tl.state(7, 9.5) == "busy"  # covered by the poll at 10 (90%)
    assert tl.state(7, 10.5) == "idle"  # (10, 11] is the poll at 11: 0%
    assert tl.state(7, 11.0) == "idle"
    assert tl.state(7, 11.2) == "busy"
    assert tl.state(7, 13.5) == "busy"  # after the last poll: the last state, within max_gap
    assert tl.state(7, 14.5) is None  # too far from any poll
    assert tl.state(7, 7.0) is None


def test_threshold_is_five_percent_inclusive() -> None:
    tl = timeline_of([(1.0, 4, {1}), (2.0, 5, {1})])
    assert tl.gpu_state("GPU-a", 1.0) == "idle"
    assert tl.gpu_state("GPU-a", 2.0) == "busy"
    assert tl.idle_below_percent == 5


def test_state_needs_the_pid_on_the_gpu_at_that_time() -> None:
    tl = timeline_of([(1.0, 80, {1}), (2.0, 80, {1, 2}), (3.0, 80, {2})])
    assert tl.state(2, 0.5) is None  # pid 2 was not on the GPU yet
    assert tl.state(2, 1.5) == "busy"
    assert tl.state(1, 2.5) is None  # pid 1 had left
    assert tl.state(99, 2.0) is None
    assert tl.gpu_pids() == {2}
    assert tl.gpus_of(2) == {"GPU-a"}
    assert tl.gpus_of(1) == set()


def test_busy_on_any_gpu_wins_and_unknown_utilization_is_none() -> None:
    tl = GpuTimeline(max_gap_s=2.0)
    tl.record(1.0, {"GPU-a": 0, "GPU-b": 70, "MIG-c": None}, {"GPU-a": {5}, "GPU-b": {5}, "MIG-c": {6}})
    assert tl.state(5, 1.0) == "busy"
    assert tl.state(6, 1.0) is None  # MIG instances report no utilization
    tl.record(2.0, {"GPU-a": 0, "GPU-b": 1, "MIG-c": None}, {"GPU-a": {5}, "GPU-b": {5}, "MIG-c": {6}})
    assert tl.state(5, 2.0) == "idle"
    assert tl.current_states() == {5: "idle"}
    assert tl.gpu_pids() == {5, 6}


def test_bounded_by_points_and_horizon() -> None:
    tl = GpuTimeline(max_gap_s=2.0, max_points=10, horizon_s=1000.0)
    for i in range(50):
        tl.record(float(i), {"GPU-a": 50}, {"GPU-a": {1}})
    assert tl.state(1, 45.0) == "busy"
    assert tl.state(1, 30.0) is None  # only the last 10 polls are kept
    tl2 = GpuTimeline(max_gap_s=2.0, horizon_s=5.0)
    for i in range(20):
        tl2.record(float(i), {"GPU-a": 50}, {"GPU-a": {1}})
    assert tl2.state(1, 10.0) is None and tl2.state(1, 17.0) == "busy"
    tl2.record(100.0, {"GPU-b": 50}, {"GPU-b": {2}})  # GPU-a gone: forgotten past the horizon
    assert tl2.gpu_pids() == {2}
    assert tl2.state(1, 19.0) is None


def test_concurrent_record_and_query() -> None:
    tl = GpuTimeline(max_gap_s=2.0, max_points=100)
    errors: list[BaseException] = []

    def writer() -> None:
        for i in range(3000):
            tl.record(float(i), {"GPU-a": i % 10}, {"GPU-a": {i % 3}})

    def reader() -> None:
        try:
            for i in range(3000):
                tl.state(i % 3, float(i))
                tl.gpu_pids()
                tl.current_states()
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tl.state(2999 % 3, 2999.0) == "busy"
