"""The syscall tracer against the real kernel: exact counts across drains, latency buckets, no leaks."""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetprof.agent.model import EVENT_EXEC, EVENT_EXIT, EVENT_NEW, SyscallDrain
from fleetprof.agent.syscalls import (
    DEFAULT_SAMPLE_EVERY,
    NBUCKETS,
    STAT_NAMES,
    LatencyDuty,
    SyscallConfig,
    SyscallTracer,
    parse_latency_duty,
    parse_sample_fraction,
    syscall_name,
)
from tests.conftest import require_bpf, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

DRAIN_EVERY_S = 0.15
ALWAYS = LatencyDuty(window_s=1.0, period_s=1.0)  # timing windows cover all the time


@pytest.fixture(scope="module")
def storm_bin(workload_bin: Callable[[str], Path]) -> Path:
    return workload_bin("syscall_storm")  # threads: glibc >= 2.34 needs no -lpthread


@pytest.fixture(scope="module")
def default_tracer() -> Iterator[SyscallTracer]:
    require_bpf()
    tracer = SyscallTracer(SyscallConfig())
    yield tracer
    tracer.close()


@pytest.fixture(scope="module")
def sampling_tracer() -> Iterator[SyscallTracer]:
    """The default 1-in-N sampling, with the timing window always open."""
    require_bpf()
    tracer = SyscallTracer(SyscallConfig(latency_duty=ALWAYS))
    yield tracer
    tracer.close()


@pytest.fixture(scope="module")
def timing_tracer() -> Iterator[SyscallTracer]:
    """Times every call (1/1), always. Room for 65,536 (process, syscall) keys a window: the fork test's 3,000
    children take ~10,000 of them, and in make test's BPF phase the test beside this one starts processes
    of its own (the default 16,384 filled once, and children went uncounted)."""
    require_bpf()
    tracer = SyscallTracer(SyscallConfig(latency_sample_every=1, latency_duty=ALWAYS, table_size=1 << 16))
    yield tracer
    tracer.close()


def drain_while_running(
    tracer: SyscallTracer, argv: list[str], out: list[str] | None = None
) -> tuple[int, list[SyscallDrain]]:
    """Start `argv` in a fresh window, drain every DRAIN_EVERY_S until it exits, then once more;
    returns its pid and the drains (and its stdout's lines into `out`, where given)."""
    tracer.drain()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(argv, stdout=stdout)
        drains = []
        while proc.poll() is None:
            time.sleep(DRAIN_EVERY_S)
            drains.append(tracer.drain())
        assert proc.returncode == 0, f"{argv} failed with {proc.returncode}"
        drains.append(tracer.drain())
        if out is not None:
            stdout.seek(0)
            out.extend(stdout.read().split())
    return proc.pid, drains


def totals(drains: list[SyscallDrain], tgid: int, name: str) -> tuple[int, int, int, list[int]]:
    """(count, timed, timed_ns, hist) of `tgid`'s calls of `name`, summed over drains."""
    count = timed = timed_ns = 0
    hist = [0] * NBUCKETS
    for d in drains:
        for s in d.stats:
            if s.tgid == tgid and s.name == name:
                count += s.count
                timed += s.timed
                timed_ns += s.timed_ns
                hist = [a + b for a, b in zip(hist, s.hist, strict=True)]
    return count, timed, timed_ns, hist


def bucket_of(ns: int) -> int:
    return ns.bit_length() - 1


@pytest.mark.parametrize("calls, threads", [(12345, 1), (54321, 4)])
def test_every_getppid_is_counted_exactly_across_drains(
    default_tracer: SyscallTracer, storm_bin: Path, calls: int, threads: int
) -> None:
    # 10 batches 120 ms apart: the run lasts >= 1.08 s, ~7 drains of 0.15 s, and still spans 3 windows if
    # a busy machine holds each pass of the drain loop up to 0.5 s. (At 60 ms apart it lasted 0.54 s:
    # passes held up past 0.27 s would have left the calls in 2 windows.)
    argv = [str(storm_bin), "count", str(calls), str(threads), "10", "120"]
    pid, drains = drain_while_running(default_tracer, argv)
    per_window = [totals([d], pid, "getppid")[0] for d in drains]
    assert sum(per_window) == calls, per_window
    # The calls are spread over >= 3 windows: the tracer flipped and drained at least twice mid-run.
    assert sum(1 for c in per_window if c) >= 3, per_window
    assert all(d.counters["table_full"] == 0 for d in drains)


def test_default_sampling_times_one_call_in_n(sampling_tracer: SyscallTracer, storm_bin: Path) -> None:
    calls = 200_000
    pid, drains = drain_while_running(sampling_tracer, [str(storm_bin), "count", str(calls), "2", "4", "20"])
    count, timed, timed_ns, hist = totals(drains, pid, "getppid")
    assert count == calls
    p = 1 / DEFAULT_SAMPLE_EVERY
    sd = math.sqrt(calls * p * (1 - p))
    assert abs(timed - calls * p) < 6 * sd, (timed, calls * p, sd)
    assert sum(hist) == timed and timed_ns > 0
    assert bucket_of(timed_ns // timed) < 20  # a getppid takes well under a millisecond


def test_nanosleep_p50_lands_in_the_5ms_log2_bucket(
    timing_tracer: SyscallTracer, workload_bin: Callable[[str], Path]
) -> None:
    k, ms = 20, 5
    took: list[str] = []
    pid, drains = drain_while_running(timing_tracer, [str(workload_bin("sleep_loop")), str(k), str(ms)], took)
    count, timed, timed_ns, hist = totals(drains, pid, "clock_nanosleep")
    assert count == k and timed == k, (count, timed)
    cumulative, p50 = 0, None
    for i, n in enumerate(hist):
        cumulative += n
        if cumulative * 2 >= timed:
            p50 = i
            break
    # Each call's time in the tracer lies within the workload's own (its clock read just before and after
    # the call), and no sleep ends early (the kernel's promise): the median's bucket lies between that of
    # 5 ms, [4.19, 8.39) ms, and that of the workload's own median. On a quiet machine both are 22; beside
    # the rest of make test and two CPU burners the wake-ups came late and the own median was 12 ms (23).
    # Nanoseconds counted as microseconds read bucket 12, a wrong clock or a missed exit anything.
    own = sorted(int(ns) for ns in took)
    assert len(own) == k, took
    buckets = {i: n for i, n in enumerate(hist) if n}
    median = own[(k + 1) // 2 - 1]  # the call p50 counts up to: the 10th shortest of 20
    print(f"clock_nanosleep: {buckets} (log2 ns bucket: calls), {timed_ns} ns in all; own median {median}")
    assert bucket_of(ms * 1_000_000) == 22 <= p50 <= bucket_of(median), (p50, own)
    # The sum of the timed durations lies within the edges of the buckets they were counted in: exact,
    # however late the wake-ups. (The mean was held under 8.39 ms, which a few late wake-ups break: with
    # both CPUs busy one sleep took > 16.8 ms and the mean reached 6.2 ms.) No sleep ends early: the
    # kernel's promise. Nanoseconds counted as microseconds, or a sum that missed calls, read 1000x or up
    # to 20x off.
    edges_lo = sum(n << i for i, n in enumerate(hist))
    edges_hi = sum(n << (i + 1) for i, n in enumerate(hist))
    assert k * ms * 1_000_000 <= timed_ns and edges_lo <= timed_ns < edges_hi, (timed_ns, edges_lo, edges_hi)


def test_processes_killed_inside_syscalls_leave_nothing_behind(
    timing_tracer: SyscallTracer, workload_bin: Callable[[str], Path], storm_bin: Path
) -> None:
    children = 3000
    timing_tracer.drain()
    out = subprocess.run(
        [str(workload_bin("fork_kill")), str(children), "100"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    pids = {int(x) for x in out.stdout.split()}
    assert len(pids) == children

    first = timing_tracer.drain()
    assert {s.tgid for s in first.stats} >= pids  # each child was counted before it was killed
    blocked = [s for s in first.stats if s.tgid in pids and s.name in ("read", "clock_nanosleep")]
    assert sum(s.count for s in blocked) == children  # every child entered its blocking call once

    second = timing_tracer.drain()
    stray = {s.tgid for s in second.stats if s.tgid in pids and not os.path.exists(f"/proc/{s.tgid}")}
    assert not stray, f"dead processes still reported after a drain: {sorted(stray)[:10]}"
    # What the maps hold now is what ran since the last drain, not what accumulated before it: no key of
    # a dead child is left. (A count of all keys, < children, read 5,761 beside a loaded make test on a
    # slow VM: other processes' keys since the drain.)
    assert not timing_tracer.table_tgids() & pids

    # Thousands of tasks died with a start pending in task storage: timing still works for new ones.
    pid, drains = drain_while_running(timing_tracer, [str(storm_bin), "count", "5000", "1", "1", "0"])
    count, timed, _, _ = totals(drains, pid, "getppid")
    assert count == timed == 5000
    for d in (first, second, *drains):
        assert d.counters["storage_failed"] == 0
        assert d.counters["table_full"] == 0 and d.counters["latency_table_full"] == 0


class EventLog:
    """A tracer whose process events are polled on a thread of their own, as the agent's event thread
    polls them (there, through the sampler's ring-buffer manager)."""

    def __init__(self) -> None:
        require_bpf()
        self.events: list[tuple[int, int, int]] = []
        self.tracer = SyscallTracer(SyscallConfig(latency_sample_every=0), on_process_event=self._add)
        assert self.tracer.events_table is not None
        self.tracer.events_table.open_ring_buffer(self.tracer.on_event)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _add(self, tgid: int, kind: int, ns: int) -> None:
        self.events.append((tgid, kind, ns))

    def _poll(self) -> None:
        bpf = self.tracer.events_table.bpf
        while not self._stop.is_set():
            bpf.ring_buffer_poll(50)
            bpf.ring_buffer_consume()  # exits do not wake a poller: the agent reads them once a window

    def of(self, pid: int) -> list[int]:
        return [kind for tgid, kind, _ in list(self.events) if tgid == pid]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.tracer.close()


def test_a_process_is_told_at_its_first_syscall_each_exec_and_its_exit(
    workload_bin: Callable[[str], Path],
) -> None:
    log = EventLog()
    try:
        before = time.monotonic_ns()
        # The child of Popen (a fork of this Python) execs sh, which execs the workload: 2 execs.
        proc = subprocess.Popen(["sh", "-c", f"exec {workload_bin('getppid_n')} 5000 5"])
        for _ in range(3):  # new (tgid, nr) keys in several windows: still one NEW for the lifetime
            time.sleep(0.01)
            log.tracer.drain()
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: EVENT_EXIT in log.of(proc.pid), 10, "the workload's exit event")
        assert log.of(proc.pid) == [EVENT_NEW, EVENT_EXEC, EVENT_EXEC, EVENT_EXIT]
        times = [ns for tgid, _, ns in log.events if tgid == proc.pid]
        assert before <= times[0] and times == sorted(times) and times[-1] <= time.monotonic_ns()

        # Thousands of short processes (killed inside a blocking call): each one told once, then its exit.
        out = subprocess.run(
            [str(workload_bin("fork_kill")), "1000", "100"], capture_output=True, text=True, timeout=60
        )
        pids = {int(x) for x in out.stdout.split()}
        assert len(pids) == 1000
        wait_until(lambda: all(EVENT_EXIT in log.of(p) for p in pids), 10, "1,000 exit events")
        assert all(log.of(p) == [EVENT_NEW, EVENT_EXIT] for p in pids)
        assert log.tracer.drain().counters["events_lost"] == 0
    finally:
        log.close()


def test_counters_are_deltas_and_count_full_tables(workload_bin: Callable[[str], Path]) -> None:
    require_bpf()
    tracer = SyscallTracer(SyscallConfig(latency_sample_every=1, table_size=64, latency_duty=ALWAYS))
    try:
        tracer.drain()
        subprocess.run([str(workload_bin("fork_kill")), "300", "50"], capture_output=True, check=True)
        full = tracer.drain()
        assert set(full.counters) == set(STAT_NAMES)
        assert full.counters["table_full"] > 0  # 300 processes x 2 syscalls > 64 keys
        assert full.counters["latency_table_full"] > 0
        assert full.counters["idle_skipped"] == 0
        assert len({(s.tgid, s.nr) for s in full.stats if s.count}) <= 64
        assert tracer.table_entries() <= 2 * 2 * 64
        quiet = tracer.drain()  # deltas, not totals: the burst is not reported again
        assert quiet.counters["table_full"] < full.counters["table_full"]
        assert quiet.end_ns > quiet.start_ns == full.end_ns
    finally:
        tracer.close()


def test_duty_cycle_times_calls_only_inside_its_windows(workload_bin: Callable[[str], Path]) -> None:
    require_bpf()
    duty = LatencyDuty(window_s=0.25, period_s=1.0)
    tracer = SyscallTracer(SyscallConfig(latency_sample_every=1, latency_duty=duty))
    try:
        k, ms = 600, 5  # ~3.3 s of 5 ms sleeps: three or four windows
        t0 = time.monotonic()
        took: list[str] = []
        pid, drains = drain_while_running(tracer, [str(workload_bin("sleep_loop")), str(k), str(ms)], took)
        elapsed = time.monotonic() - t0
    finally:
        tracer.close()
    count, timed, timed_ns, hist = totals(drains, pid, "clock_nanosleep")
    assert count == k  # counting never pauses
    # Timed: the calls that started inside a window, about window/period of them (the run covers a
    # whole number of periods give or take one window, hence the bounds).
    periods = elapsed / duty.period_s
    lo = (math.floor(periods) - 1) * duty.window_s / elapsed
    hi = (math.ceil(periods) + 1) * duty.window_s / elapsed
    assert lo * k <= timed <= hi * k, (timed, k, lo, hi)
    assert timed >= 100
    # Every timed call is a ~5 ms sleep: no start left over from a closed window was timed across the
    # gap to the next one (that would be >= 0.5 s, bucket 28+).
    assert sum(hist) == timed and max(i for i, n in enumerate(hist) if n) < 26
    # The timed calls' mean: at least 5 ms (the kernel's promise), at most the workload's own longest call
    # (each timed call lies within its own); both bucket 22 on a quiet machine.
    longest = max(int(ns) for ns in took)
    mean = timed_ns // timed
    assert bucket_of(ms * 1_000_000) <= bucket_of(mean) <= bucket_of(longest), (mean, longest)


def test_a_call_that_outlives_its_timing_window_is_dropped_not_timed(
    workload_bin: Callable[[str], Path],
) -> None:
    require_bpf()
    # A long window opens at load; the test opens the next one by hand while a sleep is in flight.
    tracer = SyscallTracer(SyscallConfig(latency_sample_every=1, latency_duty=LatencyDuty(60.0, 120.0)))
    try:
        tracer.drain()
        proc = subprocess.Popen([str(workload_bin("sleep_loop")), "1", "1200"], stdout=subprocess.DEVNULL)
        time.sleep(0.4)  # the sleep started in window 1
        tracer.open_timing_window()  # window 2: the sleep's start is now stale
        assert proc.wait(timeout=10) == 0
        drain = tracer.drain()
    finally:
        tracer.close()
    count, timed, _, _ = totals([drain], proc.pid, "clock_nanosleep")
    assert (count, timed) == (1, 0)
    assert drain.counters["stale_start"] >= 1


def test_parse_sample_fraction() -> None:
    assert parse_sample_fraction("1/16") == 16
    assert parse_sample_fraction("1") == parse_sample_fraction("1/1") == 1
    assert parse_sample_fraction(" 0 ") == 0
    for bad in ("1/3", "2/16", "x", "1/0", "-1", "1/"):
        with pytest.raises(ValueError, match="latency sampling"):
            parse_sample_fraction(bad)


def test_parse_latency_duty() -> None:
    assert parse_latency_duty("1/10") == LatencyDuty(1.0, 10.0)
    assert parse_latency_duty("0.5/5").fraction == 0.1
    assert parse_latency_duty("1/1").always
    for bad in ("10/1", "0/10", "x/10", "1", "1/", "-1/10", "1/7200"):
        with pytest.raises(ValueError, match="latency duty"):
            parse_latency_duty(bad)


def test_missing_tracepoints_leave_the_agent_running_and_are_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel refusing the raw tracepoints (BCC's attach raises, as on a kernel without them) turns
    syscall tracing off with one warning; the agent goes on."""
    require_bpf()
    import bcc

    from fleetprof.agent.main import Agent, AgentConfig

    def refuse(self, tp: bytes = b"", fn_name: bytes = b"") -> None:  # BCC's signature
        raise Exception(f"Failed to attach BPF to raw tracepoint {tp.decode()}")

    monkeypatch.setattr(bcc.BPF, "attach_raw_tracepoint", refuse)
    agent = Agent(AgentConfig(http="127.0.0.1:0", kubernetes=False, pod_resources_socket="/nonexistent"))
    with caplog.at_level("WARNING"):
        assert agent._start_syscalls() is None
    said = [r.getMessage() for r in caplog.records if "syscall" in r.getMessage()]
    assert len(said) == 1, said
    assert "syscall tracing is off" in said[0] and "raw tracepoint sys_exit" in said[0]


def test_syscall_names_come_from_the_running_arch() -> None:
    expected = {
        "x86_64": ("read", "getppid", "clock_nanosleep"),  # 0, 110, 230
        "aarch64": ("io_setup", "timer_settime", "mlockall"),  # the same numbers on arm64
    }
    assert (syscall_name(0), syscall_name(110), syscall_name(230)) == expected[os.uname().machine]
    assert syscall_name(99999) == "syscall_99999"
