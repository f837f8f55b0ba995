"""Off-CPU time in the agent's user space, without BPF: which threads are idle in a window, and how their
rows go on the wire (the BPF half is tests/agent/test_offcpu_bpf.py, the whole path
tests/e2e/test_offcpu_e2e.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import encode_window
from fleetprof.agent.model import CgroupIdentity, Frame, ProcessInfo, ResolvedSample, Window
from fleetprof.agent.offcpu import ACTIVE_SHARE, StolenTime, idle_threads
from tests.support.wire import stacks_of

MS = 1_000_000
US = 1_000


def test_threads_that_mostly_wait_are_idle_and_threads_that_work_are_not() -> None:
    rows = [
        # a pool thread: 200 naps of 50 ms, ~10 us of work each, over two stacks
        (11, 100 * 50 * MS, 100 * 10 * US),
        (11, 100 * 50 * MS, 100 * 10 * US),
        # a loader: reads of 2 ms, 0.5 ms of decoding each
        (12, 400 * 2 * MS, 400 * 500 * US),
        # a training loop: 80% waiting on the GPU, 20% launching
        (13, 8000 * MS, 2000 * MS),
        # one long wait after a short run: idle for this window
        (14, 30_000 * MS, 50 * US),
    ]
    assert idle_threads(rows) == {11, 14}


def test_the_line_is_the_active_share_of_the_threads_time() -> None:
    waited = 1_000_000
    at = round(ACTIVE_SHARE * waited / (1 - ACTIVE_SHARE))  # ran / (ran + waited) == ACTIVE_SHARE
    assert idle_threads([(1, waited, at - 1)]) == {1}
    assert idle_threads([(1, waited, at + 1)]) == set()
    # Summed over the thread's rows, not judged row by row: a thread that ran before one wait only.
    assert idle_threads([(2, waited, 0), (2, waited, 2 * at + 2)]) == set()


def test_a_reused_tid_in_another_process_is_another_thread() -> None:
    """pid_max is 32,768 by default: a node that churns threads gives a dead busy thread's tid to a new
    pool thread within seconds, and both may have rows in one window. Judged by tid alone, the pool thread
    was active (its naps stood in a wall view); by (tgid, tid), each is judged on its own."""
    busy = ((500, 77), 100 * MS, 900 * MS)  # ran 90% of its time, then died
    pool = ((600, 77), 20 * 50 * MS, 20 * 10 * US)  # born later with the same tid: naps
    assert idle_threads([busy, pool]) == {(600, 77)}
    assert idle_threads([(77, *busy[1:]), (77, *pool[1:])]) == set()  # what one tid alone judged


def test_time_a_cpu_spent_on_others_is_not_the_threads_run() -> None:
    """A pool thread woke for 10 us while the hypervisor held its vCPU for 20 ms: the switch-to-switch clock
    reads a 20 ms run, over the active line for a second of naps. With the window's stolen time taken off
    the run, it is idle again; a thread that worked for 300 ms stays active."""
    pool = [(1, 20 * 50 * MS, 19 * 10 * US + 20 * MS)]
    worker = [(2, 700 * MS, 300 * MS)]
    assert idle_threads(pool + worker) == set()
    assert idle_threads(pool + worker, stolen_ns=20 * MS) == {1}


def test_stolen_time_is_the_busiest_cpus_irq_softirq_and_steal(tmp_path: Path) -> None:
    """/proc/stat as the kernel writes it; ticks of irq + softirq + steal per CPU since the last call, the
    most of any CPU, in ns (USER_HZ ticks)."""
    hz = os.sysconf("SC_CLK_TCK")

    def stat(cpu0: tuple[int, int, int], cpu1: tuple[int, int, int]) -> str:
        lines = ["cpu  9 9 9 9 9 9 9 9 0 0"]
        for n, (irq, soft, steal) in enumerate((cpu0, cpu1)):
            lines.append(f"cpu{n} 4705 150 1120 16250 520 {irq} {soft} {steal} 0 0")
        return "\n".join([*lines, "intr 114930548 113199788 3", "ctxt 1990473", "btime 1062191376", ""])

    path = tmp_path / "stat"
    path.write_text(stat((0, 10, 5), (1, 20, 0)))
    stolen = StolenTime(str(path))
    path.write_text(stat((0, 12, 9), (1, 21, 0)))  # cpu0: 6 ticks, cpu1: 1
    assert stolen.take_ns() == 6 * 1_000_000_000 // hz
    assert stolen.take_ns() == 0  # nothing since
    path.unlink()
    assert stolen.take_ns() == 0  # unreadable: nothing taken off
    # Where BPF times a run by the scheduler's count, steal is out of it already: irq + softirq only.
    path.write_text(stat((0, 10, 5), (1, 20, 0)))
    no_steal = StolenTime(str(path), steal=False)
    path.write_text(stat((0, 12, 9), (1, 21, 0)))  # cpu0: 2 ticks, cpu1: 1
    assert no_steal.take_ns() == 2 * 1_000_000_000 // hz


def test_idle_rows_go_on_the_wire_apart_from_active_ones() -> None:
    proc = ProcessInfo(7, 100, "trainer", "/usr/bin/trainer", CgroupIdentity("/"), ())
    wait = (Frame("worker", "trainer"), Frame("futex_wait", "libc.so.6"))
    end = time.time_ns()
    window = Window(
        end - 10**10,
        end,
        [],
        offcpu=[
            ResolvedSample(proc, 8, wait, 2, 300 * MS),  # a working thread waits here too
            ResolvedSample(proc, 9, wait, 2, 9000 * MS, idle=True),
            ResolvedSample(proc, 10, wait, 2, 8000 * MS, idle=True),
        ],
        frequency_hz=19,
    )
    batch = encode_window(window, pb.AgentIdentity(node="n1", agent_id="a"))
    oc = batch.offcpu_columns
    assert sorted(zip(oc.idle, oc.blocked_ns, strict=True)) == [(False, 300 * MS), (True, 17_000 * MS)]
    assert len(stacks_of(batch)) == 1


def test_the_exact_wait_threshold_goes_from_the_flag_to_the_bpf_object() -> None:
    from fleetprof.agent.sampler import SamplerConfig
    from fleetprof.cli.parser import build_parser

    parser = build_parser()
    assert parser.parse_args(["agent", "--off-cpu-exact-ms", "25"]).off_cpu_exact_ms == 25
    assert parser.parse_args(["agent"]).off_cpu_exact_ms is None  # the agent's default (10 ms)
    for bad in ("-1", "ten", "3600001"):
        try:
            parser.parse_args(["agent", "--off-cpu-exact-ms", bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"--off-cpu-exact-ms {bad} was accepted")
    assert "-DOFFCPU_EXACT_NS=10000000ULL" in SamplerConfig().offcpu_flags(2)
    assert "-DOFFCPU_EXACT_NS=25000000ULL" in SamplerConfig(offcpu_exact_us=25_000).offcpu_flags(2)
    # Off-CPU off: no exact path at all (no sys_exit program, no per-switch bookkeeping).
    assert "-DOFFCPU_EXACT_NS=0ULL" in SamplerConfig(off_cpu=False).offcpu_flags(2)
