"""agent/gpu/activity.py on records made here: busy/idle at µs resolution against a brute-force timeline,
gaps and their histogram, what is known and what is not, bounds, and kernel time apportioned to stacks."""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from fleetprof.agent.gpu.activity import (
    MIN_GAP_NS,
    BusyTimeline,
    KernelTotal,
    LaunchIndex,
    ProcessActivity,
    kernel_time,
    launch_counts,
    merge_intervals,
)
from fleetprof.agent.gpu.cupti_ring import (
    KIND_KERNEL,
    KIND_MEMCPY,
    RECORD_DTYPE,
    KernelRecord,
    LaunchRecord,
    RingBatch,
    RingHeader,
)
from fleetprof.agent.model import Gap, GapStats
from fleetprof.gpu_families import GAP_BUCKETS_NS

NAMES = {1: "gemm", 17: "relu"}


def header(flushed_ns: int) -> RingHeader:
    return RingHeader("running", 0, "", 130001, "", 1, 0, 100, 0, flushed_ns, {}, 65536, 4096, 0, 0, 0, 0)


def batch(rows: list[tuple[int, int, int, int, int]], flushed_ns: int, lost: int = 0) -> RingBatch:
    """Records as (kind, device, start, end, name_ref)."""
    acts = np.zeros(len(rows), dtype=RECORD_DTYPE)
    for i, (kind, device, start, end, ref) in enumerate(rows):
        acts[i]["kind"], acts[i]["device_id"], acts[i]["name_ref"] = kind, device, ref
        acts[i]["start_ns"], acts[i]["end_ns"] = start, end
    return RingBatch(1, header(flushed_ns), acts, np.zeros(0, dtype=RECORD_DTYPE), NAMES, lost, 0)


def brute_busy(intervals: list[tuple[int, int]], horizon: int) -> np.ndarray:
    busy = np.zeros(horizon, dtype=bool)
    for s, e in intervals:
        busy[s:e] = True
    # Idle stretches shorter than MIN_GAP_NS between busy ones count as busy.
    idx = np.flatnonzero(busy)
    if len(idx):
        for a, b in zip(idx[:-1], idx[1:], strict=True):
            if 1 < b - a <= MIN_GAP_NS:
                busy[a:b] = True
    return busy


def test_merged_timeline_equals_a_brute_force_one_whatever_the_arrival_order() -> None:
    rng = random.Random(7)
    for _ in range(30):
        horizon = 50_000
        intervals = []
        for _ in range(rng.randint(1, 40)):
            s = rng.randrange(0, horizon - 1)
            intervals.append((s, min(horizon, s + rng.choice((0, 1, 500, 999, 1000, 1001, 4000)))))
        line = BusyTimeline()
        shuffled = intervals[:]
        rng.shuffle(shuffled)
        for k in range(0, len(shuffled), 3):  # in several out-of-order batches
            part = shuffled[k : k + 3]
            line.add(np.array([s for s, _ in part]), np.array([e for _, e in part]))
        expected = brute_busy(intervals, horizon)
        got = np.zeros(horizon, dtype=bool)
        for s, e in zip(line.starts.tolist(), line.ends.tolist(), strict=True):
            got[s:e] = True
        assert (got == expected).all()
        assert (np.diff(line.starts) > 0).all() and (line.starts[1:] - line.ends[:-1] >= MIN_GAP_NS).all()
        t0, t1 = 1234, 40_000
        assert line.busy_ns(t0, t1) == int(expected[t0:t1].sum())
        for t in rng.sample(range(horizon), 50):
            assert line.busy_at(t) == bool(expected[t])


def test_merge_keeps_gaps_of_a_microsecond_and_closes_shorter_ones() -> None:
    s, e = merge_intervals(np.array([0, 1999, 5000]), np.array([1000, 3000, 6000]))
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == [(0, 3000), (5000, 6000)]
    s, e = merge_intervals(np.array([0, 2000]), np.array([1000, 2500]))  # a gap of exactly 1 µs stays
    assert len(s) == 2


def test_state_is_busy_idle_or_unknown_beyond_what_the_records_cover() -> None:
    act = ProcessActivity()
    act.add(batch([(KIND_KERNEL, 0, 1_000_000, 2_000_000, 1), (KIND_MEMCPY, 0, 5_000_000, 6_000_000, 0)],
                  flushed_ns=10_000_000))  # fmt: skip
    assert act.state(999_999) is None  # before the first record: unknown
    assert act.state(1_500_000) == "busy" and act.state(5_999_999) == "busy"  # copies count
    assert act.state(3_000_000) == "idle" and act.is_idle(3_000_000)
    assert act.state(10_000_000) is None  # not flushed yet: a kernel may be running
    assert act.idle_ns(0, 20_000_000) == 9_000_000 - 2_000_000
    gaps = act.gaps(0, 20_000_000)
    assert gaps == [Gap(2_000_000, 5_000_000, False), Gap(6_000_000, 10_000_000, True)]


def test_a_process_is_busy_while_any_of_its_gpus_is() -> None:
    act = ProcessActivity()
    act.add(batch([(KIND_KERNEL, 0, 0, 10_000, 1), (KIND_KERNEL, 1, 20_000, 30_000, 17)], flushed_ns=100_000))
    assert act.device_state(0, 25_000) == "idle" and act.device_state(1, 25_000) == "busy"
    assert act.state(25_000) == "busy" and act.state(15_000) == "idle"
    assert [g.length_ns for g in act.gaps(0, 30_000)] == [10_000]
    assert [g.length_ns for g in act.gaps(0, 30_000, device=0)] == [20_000]
    assert act.kernels == {"gemm": KernelTotal(1, 10_000), "relu": KernelTotal(1, 10_000)}


def test_gap_histogram_buckets_by_length() -> None:
    lengths = [1_500, 50_000, 500_000, 5_000_000, 50_000_000, 500_000_000, 2_000_000_000, 9_999]
    gaps = [Gap(0, n, False) for n in lengths]
    stats = GapStats.of(gaps)
    assert stats.histogram == (2, 1, 1, 1, 1, 1, 1) and len(GAP_BUCKETS_NS) == 6
    assert (stats.count, stats.idle_ns, stats.longest_ns) == (8, sum(lengths), 2_000_000_000)


def test_bounds_drop_the_oldest_intervals_and_what_is_known_moves_with_them() -> None:
    act = ProcessActivity(max_intervals=10)
    rows = [(KIND_KERNEL, 0, i * 10_000, i * 10_000 + 1_000, 1) for i in range(25)]
    act.add(batch(rows, flushed_ns=300_000))
    assert len(act.devices[0].starts) == 10
    assert act.state(5_000) is None  # dropped: no longer known
    assert act.state(245_000) == "idle" and act.state(240_500) == "busy"
    assert act.kernels["gemm"] == KernelTotal(25, 25_000)  # totals are not bounded by the timeline


def test_records_lost_leave_a_span_where_nothing_is_claimed_idle() -> None:
    act = ProcessActivity()
    act.add(batch([(KIND_KERNEL, 0, 0, 1_000_000, 1)], flushed_ns=2_000_000))
    # The next poll found records lost: somewhere after 2 ms (complete then) and before its flush at 9 ms.
    act.add(batch([(KIND_KERNEL, 0, 7_000_000, 8_000_000, 1)], flushed_ns=9_000_000, lost=5))
    act.add(batch([(KIND_KERNEL, 0, 10_000_000, 11_000_000, 1)], flushed_ns=12_000_000))
    assert act.holes == deque([(2_000_000, 9_000_000)])
    assert act.state(1_500_000) == "idle" and act.state(5_000_000) is None and act.state(9_500_000) == "idle"
    assert act.state(7_500_000) is None  # even the surviving record's time: the span is unknown as a whole
    assert act.gaps(0, 12_000_000) == [Gap(1_000_000, 2_000_000, True), Gap(9_000_000, 10_000_000, True),
                                       Gap(11_000_000, 12_000_000, True)]  # fmt: skip
    assert act.idle_ns(0, 12_000_000) == 3_000_000
    assert act.kernels["gemm"] == KernelTotal(3, 3_000_000)  # what survived still counts


def kernel(cid: int, name: str | None, ns: int, name_hash: int = 0) -> KernelRecord:
    return KernelRecord(name, name_hash, 0, ns, 0, 1, 7, cid)


def launch(cid: int, inner: int = 0, weight: int = 1) -> LaunchRecord:
    return LaunchRecord(cid, inner, weight, 1, 0, 1, 211, "runtime", 307 if inner else 0, None, 0)


def test_kernel_time_is_apportioned_per_name_and_each_total_stays_exact() -> None:
    index = LaunchIndex()
    index.add([launch(1, inner=2), launch(3), launch(5)])
    kernels = [
        kernel(2, "relu", 100),  # joined through the inner (driver) id
        kernel(3, "relu", 100),
        kernel(4, "relu", 101),  # not sampled
        kernel(5, "gemm", 1000),
        kernel(6, "adam", 7),  # no launch of this name sampled
        kernel(8, None, 5, name_hash=0xAB),
    ]
    result = kernel_time(kernels, index, {1: "A", 3: "B", 5: "A"})
    # relu: 301 ns in all; sampled 100 under A and 100 under B -> 150.5 each, largest remainder: 151 + 150.
    assert sorted((result.by_stack[("A", "relu")], result.by_stack[("B", "relu")])) == [150, 151]
    assert result.by_stack[("A", "gemm")] == 1000
    assert result.by_stack[(None, "adam")] == 7 and result.by_stack[(None, "[kernel 000000ab]")] == 5
    assert sum(result.by_stack.values()) == sum(k.end_ns - k.start_ns for k in kernels)
    assert result.by_name["relu"] == KernelTotal(3, 301)
    assert (result.sampled_kernels, result.kernels) == (3, 6)


def test_launch_index_is_bounded_and_counts_weigh_each_launch() -> None:
    index = LaunchIndex(max_launches=2)
    index.add([launch(i, inner=i + 1000) for i in range(10)])
    assert len(index) <= 4 and index.get(9) and index.get(1009) and index.get(0) is None
    counts = launch_counts([launch(1, weight=8), launch(2, weight=8), launch(3, weight=16)], {1: "A", 3: "A"})
    assert counts == {"A": 24, None: 8}
