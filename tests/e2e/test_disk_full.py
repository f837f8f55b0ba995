"""A full disk, for real: the collector's --data-dir is a small tmpfs, filled to the last byte while a real
agent streams a workload's samples, then freed; the collector is killed with -9 and restarted. Every
sample the workload's CPU time accounts for is there, once."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, http_get, start_agent, stop_agent, stop_process, wait_until
from tests.support.collector_process import start_collector_process
from tests.support.cpu_time import alone_possible, run_alone, sample_band, steal_seconds

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

FREQUENCY = 99
WORKLOAD_S = 14


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: a disk the test can fill to the last byte without touching the machine's own."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> int:
    """Write until the filesystem refuses a single byte more; returns the bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    n = os.write(fd, block)
                except OSError as err:
                    assert err.errno == errno.ENOSPC, err
                    break
                written += n
                if n < size:
                    break
    finally:
        os.close(fd)
    return written


def metrics(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(http_get(f"{url}/metrics").decode()):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


AGENT_TALLY = re.compile(
    r"agent stopped: (\d+) samples drained; batches: (\d+) acknowledged, (\d+) refused as invalid, "
    r"(\d+) dropped \(queue full\), (\d+) unacknowledged at exit"
)


def node_samples(url: str, node: str) -> int:
    q = urllib.parse.urlencode({"query": f'{{node="{node}"}}', "since": "2h", "limit": "1"})
    return json.loads(http_get(f"{url}/api/v1/top?{q}", timeout=30))["total"]


def pid_samples(url: str, pid: int) -> int:
    q = urllib.parse.urlencode({"query": f'{{pid="{pid}"}}', "since": "2h", "limit": "1"})
    return json.loads(http_get(f"{url}/api/v1/top?{q}", timeout=30))["total"]


def test_a_disk_filled_and_freed_while_an_agent_streams_loses_and_doubles_nothing(
    small_disk: Path, workload_bin
) -> None:
    data = small_disk / "data"
    grpc_port, http_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    col = start_collector_process(data, grpc_port, http_port, "--flush-interval", "1")
    agent = start_agent(f"127.0.0.1:{grpc_port}", FREQUENCY, 1.0)
    filler = small_disk / "filler"
    try:
        steal_before = steal_seconds()
        work = subprocess.Popen(
            run_alone([workload_bin("two_funcs"), WORKLOAD_S, "50"]), stdout=subprocess.PIPE
        )
        wait_until(lambda: pid_samples(url, work.pid) > 0, 30, "the workload's first samples")
        # Fill it while rows wait for their flush (each second one does), so that a flush meets the full
        # disk too, not only the WAL.
        wait_until(lambda: metrics(url)["fleetprof_store_pending_rows"] > 0, 30, "rows waiting for a flush")
        fill(filler)
        full = metrics(url)
        assert full["fleetprof_store_data_dir_free_bytes"] < 64 * 1024
        # Batches are refused (the WAL cannot take them), and queries are still answered. Rows the WAL took
        # before the disk filled cannot be flushed now: a flush fails. (Those rows may have been flushed
        # in the milliseconds the fill took; then no flush is left to fail, which is no fault to wait for.)
        unflushed = full["fleetprof_store_pending_rows"]
        seen: dict[str, float] = {}

        def refused_and_failed() -> bool:
            seen.update(metrics(url))
            return seen["fleetprof_ingest_deferred_batches_total"] >= 3 and (
                seen["fleetprof_store_flush_errors"] >= 1 or not unflushed
            )

        try:
            wait_until(
                refused_and_failed, 30, "the collector to refuse batches and fail flushes on the full disk"
            )
        except AssertionError as e:
            keys = ("deferred_batches", "flush_errors", "wal_append_errors", "pending_rows", "backlog_rows")
            shown = {k: v for k, v in seen.items() if any(x in k for x in keys)}
            raise AssertionError(f"{e}; {unflushed:.0f} rows unflushed at the fill; now {shown}") from None
        assert pid_samples(url, work.pid) > 0
        filler.unlink()  # space is back: the agent resends, the flusher catches up by itself
        _, status, usage = os.wait4(work.pid, 0)
        work.returncode = os.waitstatus_to_exitcode(status)
        work.stdout.close()
        steal = steal_seconds() - steal_before
        cpu_s = usage.ru_utime + usage.ru_stime

        def agent_metrics() -> dict[str, float]:
            return {
                f.name: f.samples[0].value
                for f in text_string_to_metric_families(agent.metrics())
                if f.samples and not f.samples[0].labels
            }

        # The window the workload ended in is queued by the first drain to begin after its exit: wait for
        # two more drains (one may have begun before it), or the empty queue below can come first, and a
        # busy machine then read back 68-91 samples (most of a window) short.
        drains = agent_metrics()["fleetprof_agent_drains"]
        wait_until(
            lambda: agent_metrics()["fleetprof_agent_drains"] >= drains + 2, 30, "two drains after the exit"
        )

        def caught_up() -> bool:
            m = metrics(url)
            queued = agent_metrics()["fleetprof_agent_queue_batches"]
            return queued == 0 and m["fleetprof_store_backlog_rows"] == 0

        wait_until(caught_up, 90, "the agent's queue and the collector's flush backlog to drain")
        wait_until(lambda: metrics(url)["fleetprof_store_pending_rows"] == 0, 30, "a flush")
        before = pid_samples(url, work.pid)
        os.kill(col.pid, signal.SIGKILL)
        col.wait()
        log = col.stderr.read().decode()
        col.stderr.close()
        col = start_collector_process(data, grpc_port, http_port, "--flush-interval", "1")
        after = pid_samples(url, work.pid)
        # The agent's queue grew while the collector was down, and its shipper retries with a backoff
        # that doubled meanwhile (up to 30 s): wait for it to reach the restarted collector and empty the
        # queue, as an agent left running does. Stopped sooner, it only waits 5 s for acks, and a busy
        # machine's slow restart left it in a backoff longer than that: 9 batches unacknowledged at exit.
        wait_until(
            lambda: agent_metrics()["fleetprof_agent_queue_batches"] == 0,
            90,
            "the agent to resend its queue to the restarted collector",
        )
        # The agent's own tally, said when it stops (its last window and queue go to the restarted
        # collector first): every sample it drained must be stored once, the disk-full minutes included.
        stop_process(agent.proc, 30)
        said = AGENT_TALLY.search(agent.proc.stderr.read().decode())
        agent.proc.stderr.close()
        assert said, "the agent did not say its tally when it stopped"
        drained, acked, refused, dropped, unacked = map(int, said.groups())
        stored = node_samples(url, "test-node")
    finally:
        stop_agent(agent)
        if col.poll() is None:
            col.send_signal(signal.SIGTERM)
            col.wait(timeout=30)
            col.stderr.close()
    print(
        f"disk full: workload {after} samples read back for {cpu_s:.2f} CPU s at {FREQUENCY} Hz "
        f"(expected {cpu_s * FREQUENCY:.0f}, + {steal:.2f} s stolen), {before} before the kill -9; node: "
        f"{stored} stored of {drained} drained by the agent ({acked} batches acknowledged); "
        f"{log.count('cannot append')} WAL and {log.count('cannot commit')} flush fault reports in the log"
    )
    assert after == before, f"{before} samples before the kill -9, {after} after the restart"
    assert (refused, dropped, unacked) == (0, 0, 0)
    assert stored == drained, f"the agent drained {drained} samples, the collector stored {stored}"
    # The workload against its own CPU time: the CPU clock ticks at exactly 1/frequency, so the slack is
    # the partial tick at each end of each unbroken stretch on a CPU plus the hypervisor's steal. Run alone
    # (SCHED_FIFO) the workload breaks only for RT throttling: ~15 stretches in 14 s, sigma <= sqrt(15/4)
    # = 2 samples against the 3% band of 42 (21 sigma); time-sliced with other busy processes it would be
    # ~sqrt(1,386) = 37 (1.1 sigma). One lost 1 s window would be 99 of ~1,390 samples (7%), outside the
    # band. On one CPU it runs time-sliced, and the band is 4.5 sigma of that (sample_band: 12%) above; below,
    # only half: there every program of every agent and test shares the one CPU, and a tick that fires while
    # another tracepoint program runs there is dropped by the kernel, counted nowhere (perf's BPF overflow
    # handler skips it while bpf_prog_active is held): a fresh-clone `taskset -c 0` run read 1,210 samples for
    # 14.00 CPU s at 99 Hz, 12.7% short, while every sample drained was stored. The exact checks above catch
    # even one lost sample of any process.
    assert work.returncode == 0, f"the workload failed ({work.returncode}): is SCHED_FIFO allowed here?"
    margin = sample_band(cpu_s * FREQUENCY)
    lo, hi = (1 - margin) * cpu_s * FREQUENCY, (1 + margin) * (cpu_s + steal) * FREQUENCY
    if not alone_possible():
        lo = 0.5 * cpu_s * FREQUENCY
    assert lo <= after <= hi, (
        f"{after} samples for {cpu_s:.2f} CPU s (+ {steal:.2f} s stolen) at {FREQUENCY} Hz"
    )
    # Said once per fault, not once per refused batch.
    assert 1 <= log.count("cannot append to the write-ahead log") <= 3, log[-3000:]
