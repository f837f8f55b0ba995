"""Syscall rows through the real collector: validation, /api/v1/syscalls, Prometheus series, the CLI."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof.collector.metrics.syscalls import SyscallMetrics
from fleetprof.collector.model.profile import SyscallAgg
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.wire import hist, make_batch, push, with_syscalls


def test_quantiles_come_from_the_log2_histogram() -> None:
    agg = SyscallAgg(count=160, timed=10, timed_ns=10 * 5_000_000, hist=hist(b22=9, b30=1))
    assert 4_194_304 <= agg.quantile_ns(0.5) < 8_388_608
    assert agg.quantile_ns(0.99) >= 1 << 30
    assert agg.estimated_ns == pytest.approx(160 * 5_000_000)
    assert SyscallAgg(count=5).quantile_ns(0.5) is None


def test_syscalls_api_groups_sorts_and_estimates(collector: RunningCollector) -> None:
    rows = [
        ("nanosleep", 100, 100, 100 * 5_000_000, hist(b22=100)),
        ("getppid", 50_000, 3_125, 3_125 * 300, hist(b8=3_125)),
    ]
    push(collector.grpc_target, [with_syscalls(make_batch(), rows)])
    by_time = collector.json("/api/v1/syscalls", since="5m", sort="time")
    assert [r["labels"]["syscall"] for r in by_time["syscalls"]] == ["nanosleep", "getppid"]
    sleep = by_time["syscalls"][0]
    assert sleep["count"] == 100
    assert sleep["total_seconds"] == pytest.approx(0.5)
    assert 0.0041 < sleep["p50_seconds"] < 0.0084
    by_count = collector.json("/api/v1/syscalls", since="5m", sort="count")
    assert by_count["syscalls"][0]["labels"]["syscall"] == "getppid"
    assert by_count["syscalls"][0]["count"] == 50_000
    assert by_count["syscalls"][0]["total_seconds"] == pytest.approx(50_000 * 300e-9)
    per_process = collector.json("/api/v1/syscalls", since="5m", by="comm,syscall", query='{comm="worker"}')
    assert {tuple(r["labels"].values()) for r in per_process["syscalls"]} == {
        ("worker", "nanosleep"),
        ("worker", "getppid"),
    }


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda b: setattr(b.syscalls[0], "count", 1 << 41), "is over"),
        (lambda b: b.syscalls[0].latency_log2_ns.append(1), "does not add up to timed 100"),
        (lambda b: setattr(b.syscalls[0], "process", 4), "refers to process 4"),
        (lambda b: setattr(b.syscalls[0], "syscall", 0), "has no syscall name"),
    ],
)
def test_inconsistent_syscall_rows_are_refused(mutate, expected: str, collector: RunningCollector) -> None:
    batch = with_syscalls(make_batch(), [("read", 100, 100, 100_000, hist(b10=100))])
    mutate(batch)
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [batch])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in info.value.details()


def test_a_call_counted_in_one_window_and_timed_in_the_next_is_stored(collector: RunningCollector) -> None:
    """The agent counts a call when it enters and times it when it returns: one that blocked across a drain
    leaves a window with timed > count (here a lone epoll_wait: count 0, timed 1). The batch is stored."""
    batch = with_syscalls(make_batch(), [("epoll_wait", 0, 1, 12_000_000_000, hist(b33=1))])
    assert push(collector.grpc_target, [batch]) == [batch.sequence]
    rows = collector.json("/api/v1/syscalls", since="1h")["syscalls"]
    (row,) = [r for r in rows if r["labels"]["syscall"] == "epoll_wait"]
    assert (row["count"], row["timed"]) == (0, 1)


def test_prometheus_exposes_counts_and_a_real_histogram(collector: RunningCollector) -> None:
    rows = [("read", 1000, 10, 10 * 2_000, hist(b10=6, b11=4))]
    push(collector.grpc_target, [with_syscalls(make_batch(), rows)])
    text = http_get(f"{collector.url}/metrics").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = [s for s in families["fleetprof_syscalls"].samples if s.name == "fleetprof_syscalls_total"]
    assert [(s.labels["syscall"], s.labels["node"], s.value) for s in calls] == [("read", "node-a", 1000.0)]
    hist_samples = families["fleetprof_syscall_duration_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in hist_samples if s.name.endswith("_bucket")}
    assert buckets["1.024e-06"] == 0  # 2^10 ns: [1024, 2048) ns is above it
    assert buckets["4.096e-06"] == 10
    assert buckets["+Inf"] == 10
    values = list(buckets.values())
    assert values == sorted(values), "buckets must be cumulative"
    total = next(s.value for s in hist_samples if s.name.endswith("_sum"))
    assert total == pytest.approx(20e-6)


def _calls(m: SyscallMetrics) -> dict[str, float]:
    return {
        s.labels["syscall"]: s.value
        for f in m.collect()
        for s in f.samples
        if s.name == "fleetprof_syscalls_total"
    }


def test_prometheus_series_are_capped_per_pod_by_volume_and_stay_monotonic() -> None:
    clock = [1000.0]
    m = SyscallMetrics(per_pod_limit=3, clock=lambda: clock[0])
    labels = (("namespace", "ml"), ("node", "n1"), ("pod", "p"))

    def observe(**counts: int) -> dict[str, float]:
        m.observe([(labels, name, SyscallAgg(n, 0, 0, [])) for name, n in counts.items()])
        return _calls(m)

    # One batch: the three biggest get series whatever their order in it; the tail goes to "other".
    assert observe(read=2, mmap=1, close=9, futex=7, write=5, openat=1) == {
        "close": 9,
        "futex": 7,
        "write": 5,
        "other": 2 + 1 + 1,
    }
    # read becomes the busiest (volume 42) and takes the weakest place (write, 5) from now on: its earlier
    # calls stay in "other", and write's series stays as it was, exported but no longer growing.
    assert observe(read=40, futex=3) == {"close": 9, "futex": 10, "write": 5, "read": 40, "other": 4}
    # write's new calls go to "other": at 8 it does not outweigh the weakest in the top (close, 9).
    assert observe(write=3) == {"close": 9, "futex": 10, "write": 5, "read": 40, "other": 7}
    # Nor does mmap at 11: a place changes hands only past PROMOTE_RATIO (1.25 x 9), so two syscalls of
    # about equal volume do not swap at every batch.
    assert observe(mmap=10)["other"] == 17
    # Volumes decay (half-life 5 min): an hour on, what the pod does now ranks first, and the series idle
    # for the hour (expire_s) are gone. Every value exported above only ever grew.
    clock[0] += 3601
    assert observe(mmap=10, openat=6) == {"mmap": 10, "openat": 6}


def test_prometheus_keeps_a_pods_top_syscalls_by_volume_when_processes_share_it(
    collector: RunningCollector,
) -> None:
    """Host processes share pod="": a dozen rarely-called syscalls arriving first must not keep their
    series while clock_gettime's millions go to "other" (as /metrics showed before: "other" held 3.1 M of
    ~4 M calls and sched_getparam, 65 calls, had a series). Scraped for real, over two batches."""
    early = [(f"rare_{i:02d}", 60 + i, 0, 0, []) for i in range(12)]
    push(collector.grpc_target, [with_syscalls(make_batch(count=1), early)])
    first = _scraped(collector)
    assert set(first) == {f"rare_{i:02d}" for i in range(12)} and "other" not in first
    busy = [("clock_gettime", 1_700_000, 0, 0, []), ("epoll_wait", 900_000, 0, 0, []), *early]
    push(collector.grpc_target, [with_syscalls(make_batch(count=1), busy)])
    second = _scraped(collector)
    assert second["clock_gettime"] == 1_700_000 and second["epoll_wait"] == 900_000
    # The two smallest of the dozen gave up their places; their calls of the second batch are all that
    # "other" holds, and every counter only grew.
    assert second["other"] == 60 + 61
    assert all(second[name] >= value for name, value in first.items())
    assert sum(second.values()) == 1_700_000 + 900_000 + 2 * sum(c for _, c, *_ in early)


def _scraped(collector: RunningCollector) -> dict[str, float]:
    text = http_get(f"{collector.url}/metrics").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        s.labels["syscall"]: s.value
        for s in families["fleetprof_syscalls"].samples
        if s.name == "fleetprof_syscalls_total"
    }


def test_syscalls_command_prints_top_by_time_and_by_count(collector: RunningCollector) -> None:
    rows = [
        ("nanosleep", 100, 100, 100 * 5_000_000, hist(b22=100)),
        ("getppid", 50_000, 3_125, 3_125 * 300, hist(b8=3_125)),
    ]
    push(collector.grpc_target, [with_syscalls(make_batch(), rows)])
    r = fleetprof("syscalls", "--collector", collector.url, "--since", "5m")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    by_time, by_count = out.split("\n\n")
    assert "by time" in by_time and by_time.splitlines()[2].split()[0] == "nanosleep"
    assert "by count" in by_count and by_count.splitlines()[2].split()[0] == "getppid"
    assert by_time.splitlines()[1].split() == ["SYSCALL", "CALLS", "CALLS/S", "TIME", "P50", "P99"]
