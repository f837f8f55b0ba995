"""What always-on profiling costs a CPU-bound node: fleetprof agent vs. `perf record` and bcc `profile`.

Run as root from the repository root:

    .venv/bin/python bench/overhead.py --quick          # ~3 minutes: 19 Hz, 3 pairs of 5 s runs
    .venv/bin/python bench/overhead.py                  # ~15 minutes: 19/49/99 Hz, 5 pairs of 10 s runs

(Longer on a busy machine, where pairs disturbed by other processes are redone.)

Method
------
Workload: one process per CPU runs bench/workloads/spin.c (built here with gcc -O2 -fno-omit-frame-pointer):
a fixed, deterministic hashing loop (main -> run_batch -> hash_record -> mix_block, so profilers walk real
user stacks) for S seconds. Throughput is the sum over workers of records per second of wall time. Each
worker also reports its own CPU time, which gives a second, steadier measure: records per CPU-second.

Every condition is measured as interleaved A/B pairs: a baseline run with no profiler and a run with the
profiler sampling, the order alternating from pair to pair (A B, B A, ...) so that slow drift of the machine
cancels. Per pair, slowdown = (1 - profiled / baseline) x 100; the table quotes the median over pairs and the
min / max. A pair in which other processes took more than 3% of the node (what neither the workers, nor the
profiler, nor its collector used) is thrown away and redone, up to --max-redos times per row. The profiler
is started fresh for each profiled run and the timed window opens only once it samples, so BPF compiles and
start-up stay outside it:
  * fleetprof agent: /healthz answers (its HTTP server starts after BPF is attached), it has been shown the
    workload once (ncpus x `spin burn 300`: an always-on agent has long since loaded the symbols of spin
    and libc; a fresh one would do it inside the window) and a drain has followed (the first drain also
    reads every running process; later ones are the steady state). The agent
    drains every --agent-interval seconds (default S/2, so each window holds about two drains: a stricter
    test than the default 10 s interval, which drains less often). A collector runs on the same machine
    throughout, because the agent ships to it.
  * perf record / bcc profile: all their per-CPU perf events are open. They are stopped with SIGINT after
    the window, as a user's Ctrl-C, and left to write their output outside the window.

Profiler CPU is the sum of the run time of all the profiler's threads (/proc/PID/task/*/schedstat, in ns)
over the timed windows, divided by the windows' wall time: "% of one core", and "% of node" (/ ncpus).
Peak RSS is VmHWM (over the process's life, so for BCC-based tools it includes compiling the BPF program);
steady RSS is VmRSS at the end of the last window.

Second experiment (--rss-processes N): one agent at 99 Hz; N short-lived processes (spin burn, 30-60 ms of
CPU each, so each is sampled a few times) are started in batches of ncpus; the agent's VmRSS, VmHWM,
process-table size and symbol cache are read before and after, and RSS is checked against the budget.

Reading the numbers
-------------------
"slowdown" (wall-clock throughput) is everything the profiler costs the workload: the BPF program run in
the interrupted task's context on every sample, plus the profiler's user-space work, which on a fully
loaded node takes CPU from the workload. It is also what anything else running on the machine disturbs.
"in-task slowdown" (records per second of the workers' own CPU time) holds only the first part: this
kernel charges interrupt time, and so the BPF program, to the interrupted task (no IRQ_TIME_ACCOUNTING),
and it does not drop when other processes take CPU time from the workers (it still moves by a few % when
they, or other VMs, share the cores' caches and hyperthreads). "BPF" is the kernel's own accounting of the
profiler's programs (BPF_ENABLE_STATS, on for the bench's lifetime): exact µs per sample and % of the node.
"floor" = BPF + the profiler's own CPU, as % of the node: a noise-free lower bound of the slowdown (it
leaves out interrupt entry/exit and cache effects, which are the same for any profiler at one frequency).
When other processes were running (the report says so), trust in-task and floor over the wall clock.

Here the collector shares the machine too (in a fleet it does not); its CPU during the windows is printed
so its share can be taken out of "slowdown". These VMs are noisy: "baseline spread" (max - min of all
baseline runs, relative to their median) is the noise floor, and a median slowdown inside it cannot be
told apart from zero (negative values are noise). More --pairs and longer --seconds narrow it. The agent's
CPU also depends on what else runs: it describes every new process on the node. Quote medians.

Fourth experiment (--unwind-rounds N, bench/unwind_cost.py): BPF µs per sample with --unwind=eh_frame
against fp at each frequency on the spin workload built without frame pointers, and the time and bytes of
the tables of the largest libraries here. Target: <= 10 µs more per sample than the frame-pointer walk.

Targets: slowdown <= 1% at 19 Hz; agent CPU <= 1% of one core per 10 CPUs, i.e. <= 0.1 x ncpus % of one
core (the same as <= 0.1% of the node at any size); agent RSS <= 150 MB on a node with 1,000 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from common import (
    SETTLE_S,
    SPIN_SOURCE,
    START_TIMEOUT_S,
    BenchError,
    BpfRunTimeStats,
    ChildProcess,
    Children,
    Collector,
    FleetprofAgent,
    Run,
    build,
    cpu_seconds,
    fds_of_kind,
    log_tail,
    read_usage,
    run_workload,
    spread_pct,
)
from unwind_cost import format_unwind, measure_tables, measure_unwind

SLOWDOWN_TARGET_PCT = 1.0  # at 19 Hz
CPU_TARGET_CORE_PCT_PER_CPU = 0.1  # 1% of one core per 10 CPUs
RSS_BUDGET_MB = 150.0  # on a node with 1,000 processes
OTHER_LOAD_LIMIT = 0.03  # a pair is redone when other processes took more than this share of the node
AGENT_DEFAULTS = (19, 10.0)  # `fleetprof agent`'s --frequency and --interval defaults (agent/main.py)


# -- profilers ------------------------------------------------------------------------------------
class Profiler(Protocol):
    pid: int

    def start(self) -> None:
        """Start it and return once it samples."""

    def stop(self) -> None: ...


class CommandProfiler(ChildProcess):
    """A profiler run by hand (perf record, bcc profile): ready once its per-CPU perf events are open."""

    def __init__(
        self, children: Children, argv: list[str], ncpus: int, log: Path, output: Path | None = None
    ):
        self._children = children
        self._argv = argv
        self._ncpus = ncpus
        self._log = log
        self._output = output  # removed after each run

    def start(self) -> None:
        with open(self._log, "ab") as log:
            self.proc = self._children.start(self._argv, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(fds_of_kind(self.proc.pid, "anon_inode:[perf_event]")) < self._ncpus:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{self._argv[0]} did not start sampling:\n{log_tail(self._log)}")
            time.sleep(0.05)
        time.sleep(SETTLE_S)

    def stop(self) -> None:
        if self.proc is not None:
            # SIGINT as a user's Ctrl-C: perf writes its file, profile prints its stacks (symbolizing: slow).
            self._children.stop(self.proc, signal.SIGINT, timeout_s=120.0)
        if self._output is not None:
            self._output.unlink(missing_ok=True)


# -- experiment 1: A/B pairs ----------------------------------------------------------------------
@dataclass(frozen=True)
class Condition:
    name: str
    command: str  # what a reader would run, for the legend
    make: Callable[[], Profiler]
    agent_frequency: int | None = None  # set for fleetprof agent rows


@dataclass(frozen=True)
class ProfiledWindow:
    """What the profiler (and the collector, for the agent) used during one profiled run."""

    wall_s: float
    profiler_cpu_s: float
    collector_cpu_s: float
    rss_kb: int
    hwm_kb: int
    bpf_ns: int  # run time of all the profiler's BPF programs (0 when the kernel's BPF stats are off)
    sampler_ns: int  # of its perf_event (sampling) programs
    sampler_runs: int

    def node_share(self, ncpus: int) -> float:
        return (self.profiler_cpu_s + self.collector_cpu_s) / (self.wall_s * ncpus)


@dataclass
class ConditionResult:
    name: str
    command: str
    agent_frequency: int | None
    baseline: list[Run] = field(default_factory=list)  # one per kept pair
    profiled: list[Run] = field(default_factory=list)
    windows: list[ProfiledWindow] = field(default_factory=list)
    other_load: list[float] = field(default_factory=list)  # per kept pair, share of the node
    redone: int = 0  # pairs thrown away because other processes took CPU

    def _ratios(self, metric: str) -> list[float]:
        return [
            getattr(p, metric) / getattr(b, metric) for b, p in zip(self.baseline, self.profiled, strict=True)
        ]

    @property
    def slowdowns(self) -> list[float]:
        """Per pair, % less wall-clock throughput with the profiler."""
        return [(1 - r) * 100 for r in self._ratios("throughput")]

    @property
    def median_slowdown(self) -> float:
        return (1 - statistics.median(self._ratios("throughput"))) * 100

    @property
    def median_in_task_slowdown(self) -> float:
        """% fewer records per second of the workers' own CPU: the in-context cost."""
        return (1 - statistics.median(self._ratios("per_cpu_second"))) * 100

    @property
    def window_s(self) -> float:
        return sum(w.wall_s for w in self.windows)

    def cpu_core_pct(self) -> float:
        return 100 * sum(w.profiler_cpu_s for w in self.windows) / self.window_s

    def collector_core_pct(self) -> float:
        return 100 * sum(w.collector_cpu_s for w in self.windows) / self.window_s

    def bpf_us_per_sample(self) -> float | None:
        runs = sum(w.sampler_runs for w in self.windows)
        return sum(w.sampler_ns for w in self.windows) / runs / 1e3 if runs else None

    def bpf_node_pct(self, ncpus: int) -> float:
        return 100 * sum(w.bpf_ns for w in self.windows) / 1e9 / (self.window_s * ncpus)

    @property
    def peak_rss_kb(self) -> int:
        return max(w.hwm_kb for w in self.windows)

    @property
    def steady_rss_kb(self) -> int:
        return self.windows[-1].rss_kb


def profiled_run(
    children: Children, prof: Profiler, binary: Path, ncpus: int, seconds: float, collector: Collector | None
) -> tuple[Run, ProfiledWindow]:
    try:
        prof.start()
        before = read_usage(prof.pid)
        col_before = read_usage(collector.pid) if collector else None
        t0 = time.monotonic()
        run = run_workload(children, binary, ncpus, seconds)
        wall_s = time.monotonic() - t0
        after = read_usage(prof.pid)
        col_s = cpu_seconds(col_before, read_usage(collector.pid)) if collector and col_before else 0.0
    finally:
        prof.stop()
    return run, ProfiledWindow(
        wall_s,
        cpu_seconds(before, after),
        col_s,
        after.rss_kb,
        after.hwm_kb,
        after.bpf_ns - before.bpf_ns,
        after.sampler_ns - before.sampler_ns,
        after.sampler_runs - before.sampler_runs,
    )


def measure_condition(
    children: Children,
    cond: Condition,
    binary: Path,
    ncpus: int,
    args: argparse.Namespace,
    collector: Collector | None,
) -> ConditionResult:
    """`args.pairs` A/B pairs; a pair in which other processes took CPU is redone (up to --max-redos)."""
    result = ConditionResult(cond.name, cond.command, cond.agent_frequency)
    attempt = 0
    while len(result.baseline) < args.pairs:
        runs: dict[bool, Run] = {}
        window = None
        for with_profiler in (False, True) if attempt % 2 == 0 else (True, False):
            if with_profiler:
                col = collector if cond.agent_frequency else None
                runs[True], window = profiled_run(children, cond.make(), binary, ncpus, args.seconds, col)
            else:
                runs[False] = run_workload(children, binary, ncpus, args.seconds)
        attempt += 1
        baseline, profiled = runs[False], runs[True]
        assert window is not None
        # What neither the workers nor the profiler (nor its collector) used went to someone else.
        other = max(1 - baseline.cpu_share, 1 - profiled.cpu_share - window.node_share(ncpus), 0.0)
        slowdown = (1 - profiled.throughput / baseline.throughput) * 100
        in_task = (1 - profiled.per_cpu_second / baseline.per_cpu_second) * 100
        line = (
            f"  {cond.name}: pair {len(result.baseline) + 1}/{args.pairs}  baseline "
            f"{baseline.throughput / 1e6:.3f} M/s  profiled {profiled.throughput / 1e6:.3f} M/s  "
            f"slowdown {slowdown:+.2f}%  in-task {in_task:+.2f}%  profiler "
            f"{100 * window.profiler_cpu_s / window.wall_s:.2f}% of a core  other load {other:.1%}"
        )
        if other > OTHER_LOAD_LIMIT and result.redone < args.max_redos:
            result.redone += 1
            print(f"{line}: redone ({result.redone}/{args.max_redos})", file=sys.stderr, flush=True)
            continue
        print(line, file=sys.stderr, flush=True)
        result.baseline.append(baseline)
        result.profiled.append(profiled)
        result.windows.append(window)
        result.other_load.append(other)
    return result


# -- experiment 2: agent memory with many short-lived processes ----------------------------------
@dataclass
class RssResult:
    processes: int
    frequency: int
    interval_s: float
    spawn_s: float = 0.0
    rss_before_kb: int = 0
    rss_after_kb: int = 0
    hwm_before_kb: int = 0
    hwm_after_kb: int = 0
    rss_max_seen_kb: int = 0
    table_before: float = 0.0
    table_max: float = 0.0
    table_after: float = 0.0
    symbol_files: float = 0.0
    symbol_bytes: float = 0.0
    worker_rss_kb: int = 0  # the agent's table worker (agent/unwind/worker.py), a process of its own
    worker_hwm_kb: int = 0
    tables: float = 0.0  # files with an unwind table
    table_rows: float = 0.0
    samples: float = 0.0  # drained during the experiment
    agent_cpu_s: float = 0.0


def measure_rss(
    children: Children, binary: Path, ncpus: int, nprocs: int, collector: Collector, workdir: Path
) -> RssResult:
    res = RssResult(processes=nprocs, frequency=99, interval_s=2.0)
    agent = FleetprofAgent(children, collector, res.frequency, res.interval_s, workdir)
    try:
        agent.start()
        first = agent.metrics()
        before = read_usage(agent.pid)
        res.rss_before_kb, res.hwm_before_kb = before.rss_kb, before.hwm_kb
        res.table_before = res.table_max = first.get("fleetprof_agent_processes", 0)

        def look() -> None:
            m = agent.metrics()
            res.table_max = max(res.table_max, m.get("fleetprof_agent_processes", 0))
            res.rss_max_seen_kb = max(res.rss_max_seen_kb, read_usage(agent.pid).rss_kb)

        t0 = last_look = time.monotonic()
        for start in range(0, nprocs, ncpus):
            # 30-60 ms of CPU each: a few samples at 99 Hz, so every process reaches the resolver.
            batch = [
                children.start([str(binary), "burn", str(30 + (i * 7) % 31)])
                for i in range(start, min(start + ncpus, nprocs))
            ]
            for p in batch:
                p.wait(timeout=60)
            if time.monotonic() - last_look > 0.5:
                look()
                last_look = time.monotonic()
        res.spawn_s = time.monotonic() - t0
        # Let the windows holding the last processes drain (and their exits be seen).
        drains = agent.metrics().get("fleetprof_agent_drains_total", 0)
        deadline = time.monotonic() + 4 * res.interval_s + 10
        while agent.metrics().get("fleetprof_agent_drains_total", 0) < drains + 2:
            if time.monotonic() > deadline:
                raise BenchError("the agent stopped draining during the memory experiment")
            look()
            time.sleep(0.25)
        look()
        last = agent.metrics()
        after = read_usage(agent.pid)
        res.rss_after_kb, res.hwm_after_kb = after.rss_kb, after.hwm_kb
        res.table_after = last.get("fleetprof_agent_processes", 0)
        res.symbol_files = last.get("fleetprof_agent_symbol_files", 0)
        res.symbol_bytes = last.get("fleetprof_agent_symbol_bytes", 0)
        res.tables = last.get("fleetprof_agent_unwind_files_tabled", 0)
        res.table_rows = last.get("fleetprof_agent_unwind_rows", 0)
        for child in _children(agent.pid):
            usage = read_usage(child)
            res.worker_rss_kb += usage.rss_kb
            res.worker_hwm_kb += usage.hwm_kb
        res.samples = last.get("fleetprof_agent_samples_total", 0) - first.get(
            "fleetprof_agent_samples_total", 0
        )
        res.agent_cpu_s = cpu_seconds(before, after)
    finally:
        agent.stop()
    return res


@dataclass
class QuietResult:
    """The agent at its defaults on an otherwise idle node, one fresh agent per round."""

    seconds: float
    core_pcts: list[float] = field(default_factory=list)  # agent CPU per round, % of one core
    node_busy: list[float] = field(default_factory=list)  # the whole node's busy share per round

    @property
    def median(self) -> float:
        return statistics.median(self.core_pcts)


def measure_quiet(
    children: Children, collector: Collector, workdir: Path, rounds: int, seconds: float
) -> QuietResult:
    """What an always-on agent costs where nothing else runs: its fixed costs (drains, syscall counts of
    the node's daemons, timers, gRPC's threads), which dominate on a small node."""
    res = QuietResult(seconds)
    for _ in range(rounds):
        agent = FleetprofAgent(children, collector, *AGENT_DEFAULTS, workdir)
        try:
            agent.start()  # waits for the first drain: the start-up (BPF compiles) stays outside
            before, node_before, t0 = read_usage(agent.pid), node_ticks(), time.monotonic()
            time.sleep(seconds)
            after, node_after = read_usage(agent.pid), node_ticks()
            res.core_pcts.append(100 * cpu_seconds(before, after) / (time.monotonic() - t0))
            res.node_busy.append(busy_between(node_before, node_after))
        finally:
            agent.stop()
    return res


def format_quiet(r: QuietResult, ncpus: int) -> list[str]:
    budget = CPU_TARGET_CORE_PCT_PER_CPU * ncpus
    rounds = ", ".join(f"{c:.3f}%" for c in r.core_pcts)
    busy = max(r.node_busy)
    return [
        f"## Agent CPU on a quiet node at defaults ({AGENT_DEFAULTS[0]} Hz, {AGENT_DEFAULTS[1]:g} s drains, "
        "syscall tracing, Python stacks and GPU polling on)",
        "",
        f"{len(r.core_pcts)} rounds of {r.seconds:g} s, a fresh agent each (start-up outside the window): "
        f"**median {r.median:.3f}% of one core** (rounds: {rounds}) vs budget {budget:.2f}% "
        f"(= {CPU_TARGET_CORE_PCT_PER_CPU} x {ncpus} CPUs) → {verdict(r.median <= budget)}. "
        f"The node was at most {busy:.1%} busy in a round"
        + (" — other work ran: the agent described and counted it too." if busy > 0.05 else "."),
    ]


# -- report ---------------------------------------------------------------------------------------
def mb(kb: int) -> str:
    return f"{kb / 1024:.0f}" if kb else "–"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "OVER"


def format_report(
    results: list[ConditionResult],
    rss: RssResult | None,
    args: argparse.Namespace,
    ncpus: int,
    busy: float,
    bpf_error: str,
    quiet: QuietResult | None = None,
) -> str:
    cpu_budget_core_pct = CPU_TARGET_CORE_PCT_PER_CPU * ncpus
    out = [
        "# Profiler overhead on a CPU-bound node",
        "",
        f"Machine: {ncpus} CPUs, kernel {platform.release()}, {cpu_model()}. "
        f"Workload: {ncpus} x spin (one per CPU), {args.seconds:g} s per run; "
        f"{args.pairs} A/B pairs per row, order alternated. Medians quoted. "
        "This is a shared VM: expect noise (see baseline spread). A pair in which other processes took "
        f"more than {OTHER_LOAD_LIMIT:.0%} of the node is redone, at most {args.max_redos} times per row.",
        "",
        f"Node busy before the bench started anything: {busy:.1%} of its CPU"
        + (" — **other work was running; expect noisy wall-clock numbers**." if busy > 0.05 else "."),
        "",
    ]
    if results:
        out += [
            "| condition | slowdown % (median) | min / max % | in-task slowdown % | BPF µs per sample "
            "| BPF % of node | profiler CPU % of one core | % of node | floor: BPF + own CPU % of node "
            "| peak RSS MB | steady RSS MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results:
            sd = r.slowdowns
            core = r.cpu_core_pct()
            us = r.bpf_us_per_sample()
            bpf_pct = r.bpf_node_pct(ncpus)
            out.append(
                f"| {r.name} | {r.median_slowdown:+.2f} | {min(sd):+.2f} / {max(sd):+.2f} "
                f"| {r.median_in_task_slowdown:+.2f} | {'–' if us is None else f'{us:.1f}'} "
                f"| {bpf_pct:.3f} | {core:.2f} | {core / ncpus:.3f} | {bpf_pct + core / ncpus:.3f} "
                f"| {mb(r.peak_rss_kb)} | {mb(r.steady_rss_kb)} |"
            )
        baselines = [b for r in results for b in r.baseline]
        tput = [b.throughput for b in baselines]
        med = statistics.median(tput)
        rate = [b.per_cpu_second for b in baselines]
        worst = max(o for r in results for o in r.other_load)
        out += [
            "",
            "- slowdown: wall-clock throughput lost, per pair: the direct measure of everything the profiler "
            "costs, and what other load on the machine disturbs most.",
            "- in-task slowdown: records per second of the workers' own CPU time lost (the BPF program, "
            "interrupts and cache effects in the workload's context; other load disturbs it less).",
            "- BPF: the kernel's own accounting of the profiler's BPF programs (BPF_ENABLE_STATS): exact, "
            "noise-free. µs per sample counts the sampling (perf_event) programs; % of node counts all of "
            "them (process events and syscall hooks too). perf record runs none."
            + (f" Not measured here: {bpf_error}." if bpf_error else ""),
            "- floor: BPF + the profiler's CPU, as % of the node: a noise-free lower bound of the slowdown "
            "(it leaves out interrupt entry/exit and cache effects, the same for every profiler at one "
            "frequency).",
            f"- Baseline spread (noise floor): {spread_pct(tput):.2f}% "
            f"(max - min of {len(tput)} baseline runs / median {med / 1e6:.3f} M records/s); "
            f"in-task {spread_pct(rate):.2f}%.",
            "- Peak RSS is VmHWM over the process's life (for BCC tools: includes compiling the BPF "
            "program); steady RSS is VmRSS at the end of the last window.",
        ]
        if worst > OTHER_LOAD_LIMIT:
            out.append(
                f"- **Other processes were running**: they took up to {worst:.1%} of the node in a kept pair "
                "(redos ran out), so the wall-clock slowdown there is mostly noise; read in-task and floor."
            )
        out += ["", "Conditions (pairs redone for other load):"]
        out += [f"- {r.name}: `{r.command}` ({r.redone})" for r in results]
        agents = [r for r in results if r.agent_frequency]
        if agents:
            col = ", ".join(f"{r.agent_frequency} Hz {r.collector_core_pct():.2f}%" for r in agents)
            out += [
                "",
                "Collector CPU during the agent windows (on this machine here, not in a fleet), "
                f"% of one core: {col}.",
                f"Agent drains every {args.agent_interval:g} s here (production default 10 s: fewer drains, "
                "so less CPU per second).",
                "",
                "Targets:",
            ]
            for r in agents:
                core = r.cpu_core_pct()
                line = (
                    f"- {r.agent_frequency} Hz: agent CPU {core:.2f}% of one core vs budget "
                    f"{cpu_budget_core_pct:.2f}% (= {CPU_TARGET_CORE_PCT_PER_CPU} x {ncpus} CPUs, "
                    f"i.e. 1% of one core per 10 CPUs) → {verdict(core <= cpu_budget_core_pct)}"
                )
                if r.agent_frequency == 19:
                    floor = r.bpf_node_pct(ncpus) + core / ncpus
                    line += (
                        f"; slowdown {r.median_slowdown:+.2f}% vs ≤ {SLOWDOWN_TARGET_PCT:g}% → "
                        f"{verdict(r.median_slowdown <= SLOWDOWN_TARGET_PCT)} (floor {floor:.2f}% → "
                        f"{verdict(floor <= SLOWDOWN_TARGET_PCT)})"
                    )
                out.append(line)
    if rss is not None:
        out += ["", *format_rss(rss)]
    if quiet is not None:
        out += ["", *format_quiet(quiet, ncpus)]
    return "\n".join(out)


def format_rss(r: RssResult) -> list[str]:
    lines = [
        f"## Agent memory after {r.processes} short-lived processes "
        f"({r.frequency} Hz, {r.interval_s:g} s drains)",
        "",
        f"{r.processes} x `spin burn 30..60ms` in batches of one per CPU took {r.spawn_s:.1f} s; "
        f"the agent drained {r.samples:.0f} samples and used {r.agent_cpu_s:.2f} s of CPU meanwhile.",
        "",
        "| | before | after |",
        "|---|---:|---:|",
        f"| VmRSS MB | {mb(r.rss_before_kb)} | {mb(r.rss_after_kb)} (max seen {mb(r.rss_max_seen_kb)}) |",
        f"| VmHWM MB (includes the BPF compile) | {mb(r.hwm_before_kb)} | {mb(r.hwm_after_kb)} |",
        f"| fleetprof_agent_processes | {r.table_before:.0f} "
        f"| {r.table_after:.0f} (max seen {r.table_max:.0f}) |",
        f"| fleetprof_agent_symbol_files | | {r.symbol_files:.0f} |",
        f"| fleetprof_agent_symbol_bytes | | {r.symbol_bytes / 1e6:.2f} MB |",
        f"| unwind tables (files, rows) | | {r.tables:.0f}, {r.table_rows:,.0f} "
        f"({r.table_rows * 8 / 1e6:.1f} MB in the kernel) |",
        f"| table worker VmRSS / VmHWM MB | | {mb(r.worker_rss_kb)} / {mb(r.worker_hwm_kb)} |",
        "",
        f"Budget: RSS ≤ {RSS_BUDGET_MB:g} MB on a node with 1,000 processes. "
        f"Steady VmRSS {r.rss_after_kb / 1024:.0f} MB → {verdict(r.rss_after_kb / 1024 <= RSS_BUDGET_MB)}; "
        f"peak VmHWM {r.hwm_after_kb / 1024:.0f} MB → {verdict(r.hwm_after_kb / 1024 <= RSS_BUDGET_MB)}.",
    ]
    if r.processes < 1000:
        lines.append(f"(Measured with {r.processes} processes, not 1,000: run with --rss-processes 1000.)")
    return lines


def _children(pid: int) -> list[int]:
    """Processes `pid` started and that still run (the agent's table worker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return out


def node_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole node since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user .. steal; guest time is already inside user
    return total - idle, total


def busy_between(before: tuple[int, int], after: tuple[int, int]) -> float:
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def node_busy_fraction(seconds: float = 2.0) -> float:
    """Share of the node's CPU in use over `seconds` (from /proc/stat), before anything of ours runs."""
    before = node_ticks()
    time.sleep(seconds)
    return busy_between(before, node_ticks())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


# -- command line ---------------------------------------------------------------------------------
ANCHORS = ("perf99", "profile99", "profile19")


def build_conditions(
    args: argparse.Namespace,
    children: Children,
    collector: Collector | None,
    ncpus: int,
    workdir: Path,
    binary: Path,
) -> list[Condition]:
    conds = []

    def show_workload() -> None:
        for p in [children.start([str(binary), "burn", "300"]) for _ in range(ncpus)]:
            p.wait(timeout=60)

    for hz in args.frequencies:
        assert collector is not None

        def make_agent(hz: int = hz) -> Profiler:
            return FleetprofAgent(children, collector, hz, args.agent_interval, workdir, show_workload)

        conds.append(
            Condition(
                f"fleetprof agent {hz} Hz",
                f"fleetprof agent --frequency {hz} --interval {args.agent_interval:g} (+ collector)",
                make_agent,
                agent_frequency=hz,
            )
        )
    perf_data = workdir / "perf.data"
    for anchor in args.anchors:
        hz = int(anchor.removeprefix("perf").removeprefix("profile"))
        if anchor.startswith("perf"):
            # Same as `perf record -F 99 -g -a -- sleep S`, stopped by SIGINT instead of a sleep.
            argv = [
                "perf",
                "record",
                "-e",
                "cpu-clock",
                "-F",
                str(hz),
                "-g",
                "-a",
                "-q",
                "-o",
                str(perf_data),
            ]
            output: Path | None = perf_data
            name, tool = f"perf record {hz} Hz", "perf"
        else:
            argv = ["profile-bpfcc", "-F", str(hz), "-f", "3600"]  # folded stacks to /dev/null on SIGINT
            output, name, tool = None, f"bcc profile {hz} Hz", "profile-bpfcc"
        if shutil.which(tool) is None:
            print(f"skipping {name}: {tool} is not installed", file=sys.stderr)
            continue

        def make_cmd(argv: list[str] = argv, output: Path | None = output, tool: str = tool) -> Profiler:
            return CommandProfiler(children, argv, ncpus, workdir / f"{tool}.log", output)

        conds.append(Condition(name, " ".join(argv).replace(str(workdir), "$TMP") + " > /dev/null", make_cmd))
    return conds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="19 Hz only, 3 pairs of 5 s, 200 processes (~3 min)")
    p.add_argument(
        "--frequencies", help="agent frequencies, comma-separated, or 'none' (default 19,49,99; quick 19)"
    )
    p.add_argument("--pairs", type=int, help="A/B pairs per condition (default 5; quick 3)")
    p.add_argument("--seconds", type=float, help="seconds per workload run (default 10; quick 5)")
    p.add_argument("--agent-interval", type=float, help="agent drain interval in seconds (default seconds/2)")
    p.add_argument(
        "--anchors",
        help=f"comparison profilers, comma-separated, from {','.join(ANCHORS)} or 'none' "
        "(default all; quick perf99,profile99)",
    )
    p.add_argument(
        "--rss-processes",
        type=int,
        help="short-lived processes for the memory experiment, 0 to skip (default 1000; quick 200)",
    )
    p.add_argument(
        "--max-redos",
        type=int,
        help="per row, pairs that may be redone because other processes took CPU (default: --pairs)",
    )
    p.add_argument(
        "--quiet-rounds",
        type=int,
        help="rounds of the agent at defaults on the idle node, 0 to skip (default 3; quick 1)",
    )
    p.add_argument("--quiet-seconds", type=float, help="seconds per quiet round (default 120; quick 60)")
    p.add_argument(
        "--unwind-rounds",
        type=int,
        help="rounds of the eh_frame-against-fp experiment at 19 and 99 Hz, 0 to skip (default 3; quick 1)",
    )
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args(argv)
    q = args.quick
    freqs = args.frequencies or ("19" if q else "19,49,99")
    args.frequencies = [] if freqs == "none" else [int(f) for f in freqs.split(",") if f]
    args.pairs = args.pairs or (3 if q else 5)
    args.seconds = args.seconds or (5.0 if q else 10.0)
    args.agent_interval = args.agent_interval or args.seconds / 2
    args.max_redos = args.pairs if args.max_redos is None else args.max_redos
    anchors = args.anchors or ("perf99,profile99" if q else ",".join(ANCHORS))
    args.anchors = [] if anchors == "none" else anchors.split(",")
    if args.rss_processes is None:
        args.rss_processes = 200 if q else 1000
    if args.quiet_rounds is None:
        args.quiet_rounds = 1 if q else 3
    args.quiet_seconds = args.quiet_seconds or (60.0 if q else 120.0)
    if args.unwind_rounds is None:
        args.unwind_rounds = 1 if q else 3
    unknown = set(args.anchors) - set(ANCHORS)
    if unknown:
        p.error(f"unknown anchors {sorted(unknown)}; choose from {', '.join(ANCHORS)}")
    if args.pairs < 1 or args.seconds < 1 or args.agent_interval < 0.5:
        p.error("need --pairs >= 1, --seconds >= 1 and --agent-interval >= 0.5")
    return args


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print(
            "overhead.py: run as root (the agent, perf -a and bcc profile load perf events and BPF)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `finally` stops the children on kill too
    # Started in the background by a shell, we inherit SIGINT ignored, and so would every child: then
    # profile-bpfcc (Python) ignores the SIGINT that stops it. A handler here resets children to default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ncpus = os.cpu_count() or 1
    busy = node_busy_fraction()
    children = Children()
    results: list[ConditionResult] = []
    rss = None
    quiet = None
    unwind: list[str] = []
    with BpfRunTimeStats() as bpf_stats, tempfile.TemporaryDirectory(prefix="fleetprof-bench-") as tmp:
        workdir = Path(tmp)
        try:
            binary = build(SPIN_SOURCE, workdir)
            collector = None
            if args.frequencies or args.rss_processes or args.quiet_rounds:
                collector = Collector(children, workdir)
                collector.start()
            conds = build_conditions(args, children, collector, ncpus, workdir, binary)
            run_workload(children, binary, ncpus, 1.0)  # warm-up, not counted
            for cond in conds:
                print(f"{cond.name}: {args.pairs} pairs of {args.seconds:g} s", file=sys.stderr, flush=True)
                results.append(measure_condition(children, cond, binary, ncpus, args, collector))
            if args.rss_processes:
                assert collector is not None
                print(
                    f"agent memory: {args.rss_processes} short-lived processes", file=sys.stderr, flush=True
                )
                rss = measure_rss(children, binary, ncpus, args.rss_processes, collector, workdir)
            if args.quiet_rounds:
                assert collector is not None
                print(
                    f"quiet node: {args.quiet_rounds} x {args.quiet_seconds:g} s of the agent at defaults",
                    file=sys.stderr,
                    flush=True,
                )
                quiet = measure_quiet(children, collector, workdir, args.quiet_rounds, args.quiet_seconds)
            if args.unwind_rounds:
                print(f"unwinding: {args.unwind_rounds} rounds at 19 and 99 Hz", file=sys.stderr, flush=True)
                rows = measure_unwind(workdir, ncpus, [19, 99], args.seconds, args.unwind_rounds)
                unwind = format_unwind(rows, measure_tables())
        except KeyboardInterrupt:
            print("\ninterrupted; stopping everything this bench started", file=sys.stderr)
            return 130
        except BenchError as err:
            print(f"overhead.py: {err}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
            children.close()
    print(format_report(results, rss, args, ncpus, busy, bpf_stats.error, quiet))
    if unwind:
        print("\n".join(["", *unwind]))
    if args.json:
        raw = {
            "ncpus": ncpus,
            "kernel": platform.release(),
            "node_busy_before": busy,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "conditions": [
                asdict(r)
                | {
                    "slowdowns": r.slowdowns,
                    "median_slowdown": r.median_slowdown,
                    "median_in_task_slowdown": r.median_in_task_slowdown,
                    "profiler_cpu_core_pct": r.cpu_core_pct(),
                    "bpf_us_per_sample": r.bpf_us_per_sample(),
                    "bpf_node_pct": r.bpf_node_pct(ncpus),
                }
                for r in results
            ],
            "rss": asdict(rss) if rss else None,
            "quiet": asdict(quiet) if quiet else None,
        }
        args.json.write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
