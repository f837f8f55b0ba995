"""What the syscall tracer costs each syscall: fleetprof's count-only and timed modes vs. bcc syscount.

Run as root from the repository root:

    .venv/bin/python bench/syscalls.py --quick     # ~3 minutes: 3 rounds of 0.5 s runs
    .venv/bin/python bench/syscalls.py             # ~10 minutes: 7 rounds of 1 s runs

Method
------
Workloads (tests/workloads/syscall_storm.c and bench/workloads/spin.c, built here with gcc -O2):
  * getppid: one thread calls syscall(SYS_getppid) in a tight loop (the cheapest real syscall);
  * pipe: one thread writes 1 byte into a pipe and reads it back (two syscalls that do a little work);
  * cpu: one `spin run` per CPU hashes records in user space and makes almost no syscalls.
The storms report their calls and their thread's CPU time: ns per syscall = CPU ns / calls. The BPF
programs and the tracepoint machinery run in the calling task's context and are charged to it, so this
measures the tracer's cost without the noise of other processes taking the CPU (wall time would hold
it). The CPU-bound workload reports records per second of its own CPU time, for the same reason.

A/B pairs: a run of the three workloads with no tracer and one with a tracer loaded, the order
alternating from pair to pair (A B, B A, ...). The conditions take turns within each round, so every row
sees the same drift of the machine (these VMs share their host: the cost of the tracepoint machinery
itself moved by 2x between hours here). Each traced run loads its tracer fresh (compile and attach stay
outside the timed runs); fleetprof drains once after the runs, as the agent does every interval.
Per pair, added ns = traced - untraced ns per syscall; the table quotes the median over rounds, [min..max],
and % of the median untraced ns per syscall. Conditions:
  * floor: empty BPF programs on raw sys_enter, and on sys_enter + sys_exit: what any raw-tracepoint
    syscall tracer pays before doing anything (the syscall slow path, the tracepoint, the program call);
  * fleetprof count only (sampling 0): sys_enter only, per-CPU hash per (tgid, nr);
  * fleetprof timing 1/64, 1/16, 1/1 (bpf_get_prandom_u32) and 1/16 timed by a per-CPU counter: adds
    sys_exit with a task storage lookup per call, and for timed calls the clock reads and the histogram;
  * bcc `syscount-bpfcc` (per-syscall counts; classic tracepoints) and `syscount-bpfcc -L` (adds
    latency: a hash of start times keyed by thread) as anchors.

"BPF ns" is a second, noise-free measure taken after the pairs: the kernel's own accounting of the
tracer's programs (BPF_ENABLE_STATS) over a getppid storm, per syscall, net of what the accounting adds
(the run time of an empty program, subtracted per program run). It is the tracer's own code; the rest
of "ns added" is the tracepoint machinery, which the floor rows show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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

from fleetprof.agent.syscalls import LatencyDuty, SyscallConfig, SyscallTracer  # noqa: E402

STORM_SOURCE = REPO / "tests" / "workloads" / "syscall_storm.c"
SYSCOUNT = "syscount-bpfcc"
STORMS = ("getppid", "pipe")
# The floor: empty programs (not fleetprof code; loaded from this string only to measure the machinery).
EMPTY_PROGRAMS = b"int on_sys_enter(void *ctx) { return 0; }\nint on_sys_exit(void *ctx) { return 0; }\n"


# -- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Binaries:
    storm: Path
    spin: Path


def storm_ns_per_call(binary: Path, mode: str, seconds: float) -> float:
    argv = [str(binary), "bench", mode, str(seconds)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    calls, _elapsed_ns, cpu_ns = (int(x) for x in out.stdout.split())
    return cpu_ns / calls


def spin_records_per_cpu_s(binary: Path, seconds: float) -> float:
    """Records per second of the workers' own CPU time, one worker per CPU."""
    children = Children()
    try:
        return run_workload(children, binary, os.cpu_count() or 1, seconds).per_cpu_second
    finally:
        children.close()


def run_workloads(bins: Binaries, seconds: float) -> dict[str, float]:
    """ns per syscall for each storm, records per CPU-second for cpu."""
    result = {mode: storm_ns_per_call(bins.storm, mode, seconds) for mode in STORMS}
    result["cpu"] = spin_records_per_cpu_s(bins.spin, seconds)
    return result


# -- tracers --------------------------------------------------------------------------------------
class Fleetprof(Tracer):
    def __init__(self, config: SyscallConfig):
        self.config = config
        self._tracer: SyscallTracer | None = None

    def start(self) -> None:
        self._tracer = SyscallTracer(self.config)

    def stop(self) -> None:
        assert self._tracer is not None
        drain = self._tracer.drain()
        lost = drain.counters["table_full"] + drain.counters["latency_table_full"]
        if lost:
            print(f"  (fleetprof lost {lost} keys to full tables)", file=sys.stderr)
        self._tracer.close()
        self._tracer = None


class EmptyPrograms(Tracer):
    def __init__(self, tracepoints: tuple[str, ...]):
        self.tracepoints = tracepoints
        self._bpf = None

    def start(self) -> None:
        from bcc import BPF

        self._bpf = BPF(text=EMPTY_PROGRAMS)
        for tp in self.tracepoints:
            self._bpf.attach_raw_tracepoint(tp=tp.encode(), fn_name=f"on_{tp}".encode())

    def stop(self) -> None:
        assert self._bpf is not None
        self._bpf.cleanup()
        self._bpf = None


ALWAYS = LatencyDuty(window_s=1.0, period_s=1.0)


def fleetprof(every: int, sample_by: str = "random", duty: LatencyDuty = ALWAYS) -> Callable[[], Tracer]:
    config = SyscallConfig(latency_sample_every=every, sample_by=sample_by, latency_duty=duty)
    return lambda: Fleetprof(config)


def conditions(anchors: bool, seconds: float) -> list[tuple[str, Callable[[], Tracer]]]:
    # The agent's duty cycle (a timing window of DEFAULT's window/period) scaled down so each run spans
    # five whole periods. Shorter periods toggle sys_exit more often than the agent does (every 10 s),
    # so these rows, if anything, overstate the cost.
    default = LatencyDuty()
    period = seconds / 5
    duty = LatencyDuty(window_s=period * default.window_s / default.period_s, period_s=period)
    share = f"{default.window_s:g} s in {default.period_s:g}"
    out: list[tuple[str, Callable[[], Tracer]]] = [
        ("floor: empty program on sys_enter", lambda: EmptyPrograms(("sys_enter",))),
        ("floor: empty programs on sys_enter + sys_exit", lambda: EmptyPrograms(("sys_exit", "sys_enter"))),
        ("fleetprof count only (0)", fleetprof(0)),
        ("fleetprof timing 1/64, always", fleetprof(64)),
        ("fleetprof timing 1/16, always", fleetprof(16)),
        ("fleetprof timing 1/16, always, per-CPU counter", fleetprof(16, "counter")),
        ("fleetprof timing 1/1, always", fleetprof(1)),
        (f"fleetprof timing 1/16 during {share}", fleetprof(16, duty=duty)),
        (f"fleetprof timing 1/4 during {share}", fleetprof(4, duty=duty)),
        (f"fleetprof timing 1/1 during {share}", fleetprof(1, duty=duty)),
    ]
    if anchors:
        out += [
            (f"bcc {SYSCOUNT}", lambda: BccTool(SYSCOUNT)),
            (f"bcc {SYSCOUNT} -L", lambda: BccTool(SYSCOUNT, "-L")),
        ]
    return out


# -- the experiment -------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    added_ns: dict[str, list[float]] = field(default_factory=lambda: {mode: [] for mode in STORMS})
    cpu_slowdown_pct: list[float] = field(default_factory=list)
    bpf_ns: float | None = None  # net BPF run time per syscall (getppid storm)


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
    for mode in STORMS:
        untraced[mode].append(results[False][mode])
        row.added_ns[mode].append(results[True][mode] - results[False][mode])
    untraced["cpu"].append(results[False]["cpu"])
    row.cpu_slowdown_pct.append((1 - results[True]["cpu"] / results[False]["cpu"]) * 100)
    print(
        f"  {row.name}: "
        + ", ".join(f"{m} {results[False][m]:.0f} -> {results[True][m]:.0f} ns" for m in STORMS)
        + f", cpu {row.cpu_slowdown_pct[-1]:+.2f}%",
        file=sys.stderr,
    )


def bpf_run_time(make: Callable[[], Tracer], bins: Binaries, seconds: float) -> tuple[float, int, int]:
    """(ns, program runs, syscalls) the tracer's programs spent on a getppid storm, from kernel stats."""
    tracer = make()
    tracer.start()
    try:
        before = bpf_programs(tracer.pid)
        storm_ns_per_call(bins.storm, "getppid", seconds)
        after = bpf_programs(tracer.pid)
    finally:
        tracer.stop()
    ns = runs = syscalls = 0
    for prog_id, prog in after.items():
        was = before.get(prog_id, BpfProgram(prog.prog_type, 0, 0))
        ns += prog.run_time_ns - was.run_time_ns
        runs += prog.run_cnt - was.run_cnt
        # sys_enter runs once per syscall (sys_exit as often)
        syscalls = max(syscalls, prog.run_cnt - was.run_cnt)
    return ns, runs, syscalls


def measure_bpf_time(rows: list[Row], conds: list[tuple[str, Callable[[], Tracer]]], bins: Binaries,
                     seconds: float, rounds: int) -> float | None:  # fmt: skip
    """Fill each row's bpf_ns (median over rounds); returns the accounting's own ns per program run.

    conds[0] must be the empty program on sys_enter: its run time is what the accounting adds, and it is
    measured again in each round because it drifts with the machine.
    """
    with BpfRunTimeStats() as stats:
        if stats.error:
            print(f"(no BPF run-time stats: {stats.error})", file=sys.stderr)
            return None
        per_row: list[list[float]] = [[] for _ in rows]
        accounting: list[float] = []
        for _ in range(rounds):
            ns, runs, _ = bpf_run_time(conds[0][1], bins, seconds)
            accounting.append(ns / runs)
            for i, (_, make) in enumerate(conds):
                ns, runs, syscalls = bpf_run_time(make, bins, seconds)
                per_row[i].append((ns - accounting[-1] * runs) / syscalls)
        for row, values in zip(rows, per_row, strict=True):
            row.bpf_ns = statistics.median(values)
        return statistics.median(accounting)


def table(rows: list[Row], untraced: dict[str, list[float]], accounting_ns: float | None) -> str:
    base = {mode: statistics.median(untraced[mode]) for mode in STORMS}
    lines = [
        "| tracer | getppid: ns added (%) [min..max] | pipe 1-byte write/read: ns added (%) [min..max] "
        "| CPU-bound slowdown % | BPF ns per syscall |",
        "|---|---|---|---|---|",
        f"| none (untraced: getppid {base['getppid']:.0f} ns, pipe {base['pipe']:.0f} ns per syscall) "
        "| 0 | 0 | 0 | 0 |",
    ]
    for row in rows:
        cells = []
        for mode in STORMS:
            added = statistics.median(row.added_ns[mode])
            lo, hi = min(row.added_ns[mode]), max(row.added_ns[mode])
            cells.append(f"+{added:.0f} ({added / base[mode] * 100:+.0f}%) [{lo:.0f}..{hi:.0f}]")
        cpu = statistics.median(row.cpu_slowdown_pct)
        bpf = "n/a" if row.bpf_ns is None else f"{row.bpf_ns:.0f}"
        lines.append(f"| {row.name} | {cells[0]} | {cells[1]} | {cpu:+.2f} | {bpf} |")
    lines.append("")
    lines.append(
        "Medians over rounds. Untraced spread (max - min over all untraced runs / median): "
        + ", ".join(f"{m} {spread_pct(untraced[m]):.1f}%" for m in (*STORMS, "cpu"))
        + "."
    )
    if accounting_ns is not None:
        lines.append(
            f"BPF ns: kernel run-time stats over a getppid storm, median over rounds, net of the ~"
            f"{accounting_ns:.0f} ns per program run that the accounting itself adds (an empty program's "
            "run time, measured in each round)."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s runs (default: 7 of 1 s)")
    parser.add_argument("--rounds", type=int, help="A/B pairs per condition")
    parser.add_argument("--seconds", type=float, help="length of each workload run")
    parser.add_argument("--no-anchors", action="store_true", help=f"skip bcc {SYSCOUNT}")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    seconds = args.seconds or (0.5 if args.quick else 1.0)
    if os.geteuid() != 0:
        print("run as root: the tracers load eBPF programs", file=sys.stderr)
        return 2
    anchors = not args.no_anchors
    if anchors and shutil.which(SYSCOUNT) is None:
        print(f"({SYSCOUNT} not found: install Debian's bpfcc-tools for the anchors)", file=sys.stderr)
        anchors = False
    conds = conditions(anchors, seconds)
    rows = [Row(name) for name, _ in conds]
    untraced: dict[str, list[float]] = {mode: [] for mode in (*STORMS, "cpu")}
    with tempfile.TemporaryDirectory(prefix="bench-syscalls-") as tmp:
        bins = Binaries(build(STORM_SOURCE, Path(tmp)), build(SPIN_SOURCE, Path(tmp)))
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
            for i in range(len(conds)):
                j = (i + r) % len(conds)  # rotate who goes first in each round
                measure_pair(rows[j], conds[j][1], bins, seconds, (r + i) % 2 == 0, untraced)
        accounting_ns = measure_bpf_time(rows, conds, bins, seconds, rounds)
    print(f"\n{rounds} rounds of {seconds:g} s runs, {os.cpu_count()} CPUs, kernel {os.uname().release}\n")
    print(table(rows, untraced, accounting_ns))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"bench/syscalls.py: {exc}", file=sys.stderr)
        sys.exit(1)
