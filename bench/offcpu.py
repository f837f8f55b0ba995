"""What off-CPU profiling costs each context switch, and a CPU-bound node: fleetprof vs. bcc offcputime.

Run as root from the repository root:

    .venv/bin/python bench/offcpu.py --quick     # ~12 minutes on a busy 2-vCPU VM: 3 rounds of 0.5 s runs
    .venv/bin/python bench/offcpu.py             # ~30 minutes there: 7 rounds of 1 s runs

Method
------
Workloads (built here with gcc -O2 -fno-omit-frame-pointer):
  * switch storm (tests/workloads/switch_storm.c): two processes ping-pong one byte over two pipes, both
    pinned to the last CPU (taskset), so every round trip is exactly two context switches, each straight
    from one process to the other, and the CPU is never idle. It reports its switches (getrusage) and
    the CPU time of both processes: ns per switch = CPU ns / switches. The sched_switch program runs in
    the outgoing task's context and is charged to it, so this is the cost of a switch plus the program,
    without the noise of other processes taking the CPU (the wall clock would hold that). Switches/s of
    wall time are shown too.
  * CPU-bound (bench/workloads/spin.c): one `spin run` per CPU; records per second of the workers' own CPU
    time (in-task) and of wall time. A busy CPU switches rarely: this shows what off-CPU profiling costs a
    node that mostly computes (the scheduler tick, other processes' switches on the same CPUs).

A/B pairs: a run of both workloads with no tracer and one with a tracer loaded, the order alternating from
pair to pair, conditions rotating within each round, so every row sees the same drift of the machine.
Each traced run loads its tracer fresh (compile and attach stay outside the timed runs); fleetprof drains
once after the runs (the agent drains every interval; draining is user-space work, not per switch).
Per pair, added ns = traced - untraced ns per switch; the table quotes the median over rounds, [min..max].
Conditions:
  * floor: an empty program on sched:sched_switch (a classic tracepoint, as fleetprof uses): what any
    tracer of this tracepoint pays before doing anything;
  * fleetprof CPU sampler alone (off-CPU off: no sched_switch program), as a check that it adds nothing;
  * fleetprof off-CPU at 1/N sampling (bpf_get_prandom_u32) for several N, with the default minimum wait,
    and 1/1 with no minimum;
  * bcc `offcputime-bpfcc` (user + kernel stacks of every wait, all threads) as the anchor. It attaches a
    kprobe to finish_task_switch; where kprobes are off (CONFIG_KPROBES=n, as on this fleet) its program
    is run as a port to the sched_switch tracepoint (PORT below): the same maps, the same work per switch
    (a start time per switch, two BPF_STACK_TRACE ids and a count per wait), the stacks taken at the
    switch-out because at a tracepoint the current task is the one leaving.

"BPF ns, tables" is the same with the storm's two processes described to the table unwinder (their user
stacks walked by call-frame information, as the agent walks every described process's CPU samples and
recorded waits; the other rows' storm is not described, so its stacks are taken by frame pointer). Per
recorded wait, the walk costs (BPF ns, tables - BPF ns) / sampled. With a threshold for exact waits (the
default), every syscall return of the node also runs a sys_exit program; "sys_exit ns" is its net run time
per run during the storm (two syscalls a switch), and its walks of long waits are too rare there to matter.

"BPF ns" is a second, noise-free measure taken after the pairs: the kernel's own accounting of the
tracer's sched_switch program (BPF_ENABLE_STATS) over a storm, per program run (every switch on the node),
net of what the accounting adds (an empty program's run time per run, measured in each round).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import (
    SPIN_SOURCE,
    BccTool,
    BenchError,
    BpfProgram,
    BpfRunTimeStats,
    Children,
    Tracer,
    bpf_programs,
    build,
    run_workload,
    spread_pct,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetprof.agent.offcpu import (  # noqa: E402
    DEFAULT_OFFCPU_EXACT_US,
    DEFAULT_OFFCPU_MIN_BLOCK_US,
    DEFAULT_OFFCPU_SAMPLE_EVERY,
)
from fleetprof.agent.process.table import ProcessTable  # noqa: E402
from fleetprof.agent.sampler import CpuSampler, SamplerConfig  # noqa: E402
from fleetprof.agent.unwind.unwinder import Unwinder  # noqa: E402

STORM_SOURCE = REPO / "tests" / "workloads" / "switch_storm.c"
OFFCPUTIME = "offcputime-bpfcc"
BPF_PROG_TYPE_TRACEPOINT = "5"
BPF_PROG_TYPE_RAW_TRACEPOINT = "17"

# The floor: an empty program (not fleetprof code; loaded from this string only to measure the machinery).
EMPTY_PROGRAM = b"TRACEPOINT_PROBE(sched, sched_switch) { return 0; }\n"

# bcc's offcputime (tools/offcputime.py, bpfcc-tools 0.26, default options: all threads, user + kernel
# stacks, 1 us <= wait <= U64_MAX, 16,384 stack ids) moved from its finish_task_switch kprobe to the
# sched_switch tracepoint. Changes: the pids come from the tracepoint's arguments instead of
# prev->pid/tgid (a kernel struct read through headers, which mismatched headers corrupt), and the stack
# ids and comm are taken for the task leaving and kept with its start time (the original takes them for
# the task arriving, which is `current` in finish_task_switch). Per switch: one start update with two
# get_stackid calls, one lookup + delete, one count increment: the original's work.
PORT = b"""
#include <uapi/linux/ptrace.h>
struct key_t {
    u32 pid;
    u32 tgid;
    int user_stack_id;
    int kernel_stack_id;
    char name[16];
};
struct start_t {
    u64 ts;
    struct key_t key;
};
BPF_HASH(counts, struct key_t);
BPF_HASH(start, u32, struct start_t);
BPF_STACK_TRACE(stack_traces, 16384);

TRACEPOINT_PROBE(sched, sched_switch) {
    u32 pid = args->prev_pid;
    struct start_t s = {};
    s.key.pid = pid;
    s.key.tgid = bpf_get_current_pid_tgid() >> 32;
    s.key.user_stack_id = stack_traces.get_stackid(args, BPF_F_USER_STACK);
    s.key.kernel_stack_id = stack_traces.get_stackid(args, 0);
    bpf_get_current_comm(&s.key.name, sizeof(s.key.name));
    s.ts = bpf_ktime_get_ns();
    start.update(&pid, &s);

    pid = args->next_pid;
    struct start_t *sp = start.lookup(&pid);
    if (sp == 0)
        return 0;
    u64 t_start = sp->ts, t_end = bpf_ktime_get_ns();
    struct key_t key = sp->key;
    start.delete(&pid);
    if (t_start > t_end)
        return 0;
    u64 delta = (t_end - t_start) / 1000;
    if (delta < 1)
        return 0;
    counts.increment(key, delta);
    return 0;
}
"""


# -- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Binaries:
    storm: Path
    spin: Path


@dataclass(frozen=True)
class Storm:
    ns_per_switch: float  # CPU ns of both processes per context switch
    switches_per_s: float
    switches: int


def run_storm(binary: Path, seconds: float) -> Storm:
    cpu = str((os.cpu_count() or 1) - 1)
    out = subprocess.run(
        ["taskset", "-c", cpu, str(binary), f"{seconds:g}"], capture_output=True, text=True, check=True
    )
    rounds, elapsed_ns, cpu_ns, switches = (int(x) for x in out.stdout.split())
    if switches < 1.9 * rounds:
        raise BenchError(f"the storm switched {switches} times in {rounds} round trips: not pinned?")
    return Storm(cpu_ns / switches, switches / (elapsed_ns / 1e9), switches)


def run_workloads(bins: Binaries, seconds: float) -> dict[str, float]:
    storm = run_storm(bins.storm, seconds)
    children = Children()
    try:
        spin = run_workload(children, bins.spin, os.cpu_count() or 1, seconds)
    finally:
        children.close()
    return {
        "ns": storm.ns_per_switch,
        "rate": storm.switches_per_s,
        "cpu": spin.per_cpu_second,
        "wall": spin.throughput,
    }


# -- tracers --------------------------------------------------------------------------------------
class Fleetprof(Tracer):
    def __init__(self, config: SamplerConfig):
        self.config = config
        self._sampler: CpuSampler | None = None
        self.stats: dict[str, int] = {}

    def start(self) -> None:
        self._sampler = CpuSampler(self.config)

    def stop(self) -> None:
        assert self._sampler is not None
        drain = self._sampler.drain()
        for k, v in drain.stats.items():
            self.stats[k] = self.stats.get(k, 0) + v
        lost = sum(drain.stats.get(k, 0) for k in ("offcpu_count_table_full", "offcpu_state_table_full"))
        lost += drain.stats.get("stack_table_full", 0)
        if lost:
            print(f"  (fleetprof lost {lost} waits or stacks to full tables)", file=sys.stderr)
        self._sampler.close()
        self._sampler = None


class Program(Tracer):
    """A BPF program from a string, its TRACEPOINT_PROBE attached by BCC."""

    def __init__(self, text: bytes):
        self.text = text
        self._bpf = None

    def start(self) -> None:
        from bcc import BPF

        self._bpf = BPF(text=self.text)

    def stop(self) -> None:
        assert self._bpf is not None
        self._bpf.cleanup()
        self._bpf = None


def offcputime_runs() -> str:
    """'' if offcputime-bpfcc starts here, else why not."""
    if shutil.which(OFFCPUTIME) is None:
        return f"{OFFCPUTIME} is not installed (Debian bpfcc-tools)"
    try:
        tracer = BccTool(OFFCPUTIME)
        tracer.start()
        tracer.stop()
    except BenchError as exc:
        return str(exc)
    return ""


def fleetprof(
    every: int, min_block_us: int = DEFAULT_OFFCPU_MIN_BLOCK_US, exact_us: int = DEFAULT_OFFCPU_EXACT_US
) -> Callable[[], Tracer]:
    config = SamplerConfig(
        offcpu_sample_every=every, offcpu_min_block_us=min_block_us, offcpu_exact_us=exact_us
    )
    return lambda: Fleetprof(config)


def conditions(anchor: str, everies: list[int]) -> list[tuple[str, Callable[[], Tracer]]]:
    """(name, tracer factory); the first must be the empty program (measure_bpf_time relies on it)."""
    min_us = DEFAULT_OFFCPU_MIN_BLOCK_US
    out: list[tuple[str, Callable[[], Tracer]]] = [
        ("floor: empty program on sched_switch", lambda: Program(EMPTY_PROGRAM)),
        ("fleetprof CPU sampler only (off-CPU off)", lambda: Fleetprof(SamplerConfig(off_cpu=False))),
    ]
    for every in sorted({*everies, DEFAULT_OFFCPU_SAMPLE_EVERY}):
        mark = " (default)" if every == DEFAULT_OFFCPU_SAMPLE_EVERY else ""
        out.append((f"fleetprof off-CPU 1/{every}, min {min_us} us{mark}", fleetprof(every)))
    # The storm's waits are ~1 us: a minimum above them leaves the wake-up's recording out. The difference
    # to the row at the default minimum is what recording a wait costs.
    out.append(("fleetprof off-CPU 1/1, min 1000 us", fleetprof(1, 1000)))
    # Exact long waits cost a task-storage write per switch-out and a sys_exit program on every syscall.
    every = DEFAULT_OFFCPU_SAMPLE_EVERY
    out.append((f"fleetprof off-CPU 1/{every}, exact waits off", fleetprof(every, min_us, 0)))
    if anchor == "tool":
        out.append((f"bcc {OFFCPUTIME}", lambda: BccTool(OFFCPUTIME)))
    elif anchor == "port":
        out.append((f"bcc {OFFCPUTIME} program on sched_switch (port)", lambda: Program(PORT)))
    return out


# -- the experiment -------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    added_ns: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    cpu_slowdown_pct: list[float] = field(default_factory=list)
    wall_slowdown_pct: list[float] = field(default_factory=list)
    bpf_ns: float | None = None  # net BPF run time per sched_switch run
    bpf_tables_ns: float | None = None  # ... with the storm's stacks walked by tables (fleetprof rows)
    sys_exit_ns: float | None = None  # net run time per run of the exact waits' sys_exit program
    bpf_node_pct: float | None = None  # its run time during the CPU-bound runs, % of the node
    sampled_per_switch: float | None = None


def measure_pair(row: Row, make: Callable[[], Tracer], bins: Binaries, seconds: float, traced_first: bool,
                 untraced: dict[str, list[float]]) -> None:  # fmt: skip
    results: dict[bool, dict[str, float]] = {}
    for traced in (True, False) if traced_first else (False, True):
        if not traced:
            results[False] = run_workloads(bins, seconds)
            continue
        tracer = make()
        tracer.start()
        try:
            results[True] = run_workloads(bins, seconds)
        finally:
            tracer.stop()
        if isinstance(tracer, Fleetprof) and tracer.stats.get("offcpu_switches"):
            row.sampled_per_switch = tracer.stats["offcpu_sampled"] / tracer.stats["offcpu_switches"]
    base, traced_run = results[False], results[True]
    for key in ("ns", "rate", "cpu", "wall"):
        untraced[key].append(base[key])
    row.added_ns.append(traced_run["ns"] - base["ns"])
    row.rate.append(traced_run["rate"])
    row.cpu_slowdown_pct.append((1 - traced_run["cpu"] / base["cpu"]) * 100)
    row.wall_slowdown_pct.append((1 - traced_run["wall"] / base["wall"]) * 100)
    print(
        f"  {row.name}: {base['ns']:.0f} -> {traced_run['ns']:.0f} ns a switch, "
        f"cpu-bound {row.cpu_slowdown_pct[-1]:+.2f}% in-task, {row.wall_slowdown_pct[-1]:+.2f}% wall",
        file=sys.stderr,
    )


def switch_program_time(make: Callable[[], Tracer], work: Callable[[], object]) -> tuple[int, int]:
    """(ns, runs) of the tracer's sched_switch program while `work()` runs, from the kernel's stats."""
    tracer = make()
    tracer.start()
    try:
        before = bpf_programs(tracer.pid)
        work()
        after = bpf_programs(tracer.pid)
    finally:
        tracer.stop()
    best = (0, 0)
    for prog_id, prog in after.items():
        if prog.prog_type != BPF_PROG_TYPE_TRACEPOINT:
            continue  # the CPU sampler's perf event program
        was = before.get(prog_id, BpfProgram(prog.prog_type, 0, 0))
        runs = prog.run_cnt - was.run_cnt
        if runs > best[1]:  # sched_switch: by far the most runs (exec/exit run per process)
            best = (prog.run_time_ns - was.run_time_ns, runs)
    return best


def measure_bpf_time(rows: list[Row], conds: list[tuple[str, Callable[[], Tracer]]], bins: Binaries,
                     seconds: float, rounds: int) -> float | None:  # fmt: skip
    """Fill each row's bpf_ns (median over rounds) and bpf_node_pct; returns the accounting's own ns per
    program run (the empty program's, conds[0], measured in each round: it drifts with the machine)."""
    ncpus = os.cpu_count() or 1

    def spin() -> None:
        children = Children()
        try:
            run_workload(children, bins.spin, ncpus, seconds)
        finally:
            children.close()

    with BpfRunTimeStats() as stats:
        if stats.error:
            print(f"(no BPF run-time stats: {stats.error})", file=sys.stderr)
            return None
        per_switch: list[list[float]] = [[] for _ in rows]
        node_pct: list[list[float]] = [[] for _ in rows]
        accounting: list[float] = []
        for _ in range(rounds):
            ns, runs = switch_program_time(conds[0][1], lambda: run_storm(bins.storm, seconds))
            accounting.append(ns / runs)
            for i, (name, make) in enumerate(conds):
                if name.startswith("fleetprof CPU sampler only"):
                    continue  # no sched_switch program
                ns, runs = switch_program_time(make, lambda: run_storm(bins.storm, seconds))
                if runs:
                    per_switch[i].append(ns / runs - accounting[-1])
                ns, runs = switch_program_time(make, spin)
                node_pct[i].append((ns - accounting[-1] * runs) / (ncpus * seconds * 1e9) * 100)
        for row, values, pct in zip(rows, per_switch, node_pct, strict=True):
            row.bpf_ns = statistics.median(values) if values else None
            row.bpf_node_pct = statistics.median(pct) if pct else None
        return statistics.median(accounting)


def _storm_pids(parent: int) -> list[int]:
    """The storm's two processes once both have mapped libc (the child is forked after the parent did)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        pids = [parent, *(int(c) for c in children)]
        if len(pids) == 2 and all("/libc.so" in Path(f"/proc/{p}/maps").read_text() for p in pids):
            return pids
    except OSError:
        pass
    return []


def walked_switch_time(config: SamplerConfig, bins: Binaries, seconds: float) -> tuple[float, float] | None:
    """(ns per sched_switch run, ns per sys_exit run) of fleetprof's programs while a storm runs whose two
    processes are described to the table unwinder (their stacks walked by tables); None if it could not be
    described in time."""
    sampler = CpuSampler(config)
    maps = sampler.unwind_maps()
    if maps is None:
        sampler.close()
        return None
    unwinder = Unwinder(maps)
    table = ProcessTable(on_capture=unwinder.describe)
    cpu = str((os.cpu_count() or 1) - 1)
    # Long enough to describe both processes and build their tables first (a second or two), then measure.
    storm = subprocess.Popen(
        ["taskset", "-c", cpu, str(bins.storm), f"{seconds + 10:g}"], stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 5
        pids: list[int] = []
        while not pids and time.monotonic() < deadline:
            time.sleep(0.005)
            pids = _storm_pids(storm.pid)
        if not pids:
            return None
        for pid in pids:
            table.refresh(pid)
        unwinder.build_pending()
        sampler.drain()
        before = bpf_programs(os.getpid())
        time.sleep(seconds)
        after = bpf_programs(os.getpid())
        drained = sampler.drain()
        if not drained.stats.get("unwind_walks") and not drained.stats.get("offcpu_sampled"):
            return None
    finally:
        storm.kill()
        storm.wait()
        unwinder.stop()
        sampler.close()
    best = {BPF_PROG_TYPE_TRACEPOINT: (0, 0), BPF_PROG_TYPE_RAW_TRACEPOINT: (0, 0)}
    for prog_id, prog in after.items():
        if prog.prog_type not in best:
            continue
        was = before.get(prog_id, BpfProgram(prog.prog_type, 0, 0))
        runs = prog.run_cnt - was.run_cnt
        if runs > best[prog.prog_type][1]:
            best[prog.prog_type] = (prog.run_time_ns - was.run_time_ns, runs)
    (sw_ns, sw_runs), (ex_ns, ex_runs) = best[BPF_PROG_TYPE_TRACEPOINT], best[BPF_PROG_TYPE_RAW_TRACEPOINT]
    return (sw_ns / sw_runs if sw_runs else 0.0, ex_ns / ex_runs if ex_runs else 0.0)


def measure_walk_time(rows: list[Row], conds: list[tuple[str, Callable[[], Tracer]]], bins: Binaries,
                      seconds: float, rounds: int, accounting_ns: float) -> None:  # fmt: skip
    """Fill the fleetprof off-CPU rows' bpf_tables_ns and sys_exit_ns (medians over rounds, net of the
    accounting's own ns per run)."""
    with BpfRunTimeStats() as stats:
        if stats.error:
            return
        for row, (_, make) in zip(rows, conds, strict=True):
            tracer = make()
            if not isinstance(tracer, Fleetprof) or not tracer.config.off_cpu:
                continue
            walked, exits = [], []
            for _ in range(rounds):
                got = walked_switch_time(tracer.config, bins, seconds)
                if got is not None:
                    walked.append(got[0] - accounting_ns)
                    exits.append(got[1] - accounting_ns)
            if walked:
                row.bpf_tables_ns = statistics.median(walked)
                row.sys_exit_ns = statistics.median(exits) if tracer.config.offcpu_exact_us else None


def table(rows: list[Row], untraced: dict[str, list[float]], accounting_ns: float | None) -> str:
    base_ns, base_rate = statistics.median(untraced["ns"]), statistics.median(untraced["rate"])
    lines = [
        "| tracer | ns added per switch (%) [min..max] | switches/s | CPU-bound slowdown %: in-task, wall "
        "| BPF ns per switch | BPF ns, tables | ns per recorded wait, tables | sys_exit ns "
        "| BPF % of node, CPU-bound | sampled |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| none | 0 ({base_ns:.0f} ns a switch) | {base_rate / 1e3:.0f}k | 0, 0 | 0 | | | | 0 | |",
    ]
    for row in rows:
        added = statistics.median(row.added_ns)
        lo, hi = min(row.added_ns), max(row.added_ns)
        cpu, wall = statistics.median(row.cpu_slowdown_pct), statistics.median(row.wall_slowdown_pct)
        bpf = "n/a" if row.bpf_ns is None else f"{row.bpf_ns:.0f}"
        node = "n/a" if row.bpf_node_pct is None else f"{row.bpf_node_pct:.4f}"
        sampled = "" if row.sampled_per_switch is None else f"{row.sampled_per_switch:.3f}"
        tables = "" if row.bpf_tables_ns is None else f"{row.bpf_tables_ns:.0f}"
        per_wait = ""
        if row.bpf_tables_ns is not None and row.bpf_ns is not None and row.sampled_per_switch:
            per_wait = f"{(row.bpf_tables_ns - row.bpf_ns) / row.sampled_per_switch:+.0f}"
        exits = "" if row.sys_exit_ns is None else f"{row.sys_exit_ns:.0f}"
        lines.append(
            f"| {row.name} | {added:+.0f} ({added / base_ns * 100:+.1f}%) [{lo:+.0f}..{hi:+.0f}] "
            f"| {statistics.median(row.rate) / 1e3:.0f}k | {cpu:+.2f}, {wall:+.2f} | {bpf} | {tables} "
            f"| {per_wait} | {exits} | {node} | {sampled} |"
        )
    lines.append("")
    lines.append(
        "Medians over rounds. Untraced spread (max - min over all untraced runs / median): "
        + ", ".join(f"{k} {spread_pct(untraced[k]):.1f}%" for k in ("ns", "cpu", "wall"))
        + ". sampled: switch-outs that took stacks, per switch on the node (storm and CPU-bound runs)."
    )
    if accounting_ns is not None:
        lines.append(
            "BPF ns: kernel run-time stats of the sched_switch program over a storm, median over rounds, "
            f"per run, net of the ~{accounting_ns:.0f} ns per run that the accounting itself adds (an empty "
            "program's run time, measured in each round); BPF % of node: the same program's net run time "
            "during the CPU-bound runs, over ncpus x their length."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s runs (default: 7 of 1 s)")
    parser.add_argument("--rounds", type=int, help="A/B pairs per condition")
    parser.add_argument("--seconds", type=float, help="length of each workload run")
    parser.add_argument("--every", default="1,4,8,16,64", help="fleetprof sampling rates 1/N to measure")
    parser.add_argument("--no-anchor", action="store_true", help=f"skip bcc {OFFCPUTIME}")
    parser.add_argument(
        "--run-by-clock",
        action="store_true",
        help="time each wait's run by the clock from its switch-in, as before 172a248 (the task_struct "
        "offsets withheld from the sampler): the A side of the scheduler's count's cost",
    )
    args = parser.parse_args()
    if args.run_by_clock:
        import fleetprof.agent.sampler as sampler

        sampler.task_run_offsets = lambda: None  # cpu_sampler.c run_ending falls back to the clock's span
    rounds = args.rounds or (3 if args.quick else 7)
    seconds = args.seconds or (0.5 if args.quick else 1.0)
    if os.geteuid() != 0:
        print("run as root: the tracers load eBPF programs", file=sys.stderr)
        return 2
    if shutil.which("taskset") is None:
        raise BenchError("taskset (util-linux) is needed to pin the switch storm")
    anchor = "none"
    if not args.no_anchor:
        why = offcputime_runs()
        anchor = "tool" if not why else "port"
        if why:
            print(f"({OFFCPUTIME} cannot run here: {why}; its program runs on sched_switch instead)")
    conds = conditions(anchor, [int(x) for x in args.every.split(",") if x])
    rows = [Row(name) for name, _ in conds]
    untraced: dict[str, list[float]] = {k: [] for k in ("ns", "rate", "cpu", "wall")}
    with tempfile.TemporaryDirectory(prefix="bench-offcpu-") as tmp:
        bins = Binaries(build(STORM_SOURCE, Path(tmp)), build(SPIN_SOURCE, Path(tmp)))
        run_workloads(bins, seconds)  # warm-up, not counted
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
            for i in range(len(conds)):
                j = (i + r) % len(conds)  # rotate who goes first in each round
                measure_pair(rows[j], conds[j][1], bins, seconds, (r + i) % 2 == 0, untraced)
        accounting_ns = measure_bpf_time(rows, conds, bins, seconds, rounds)
        if accounting_ns is not None:
            measure_walk_time(rows, conds, bins, seconds, rounds, accounting_ns)
    print(f"\n{rounds} rounds of {seconds:g} s runs, {os.cpu_count()} CPUs, kernel {os.uname().release}\n")
    print(table(rows, untraced, accounting_ns))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"bench/offcpu.py: {exc}", file=sys.stderr)
        sys.exit(1)
