"""What walking user stacks by call-frame information costs: the --unwind experiment of bench/overhead.py.

BPF µs per sample: the CPU sampler loaded in this process with --unwind=eh_frame and with fp, in turns, at
each frequency, while one process per CPU runs the spin workload built WITHOUT frame pointers (-O2
-fomit-frame-pointer: the case the table walk exists for; a frame-pointer walk of it stops after a frame
or two). Its tables (spin's and libc's) are built before the timed window, as an always-on agent has them.
The kernel's own accounting of the sampler's perf_event program (BPF_ENABLE_STATS) gives ns per run; a
table walk is a chain of tail calls, all of it inside the one run. Frames per sample are the drained user
stacks' mean depth, so the cost per frame can be read off too.

Table cost: building the table of the largest libraries here (libLLVM, libpython, libc) with
agent/unwind/table.py, median of 3: seconds of CPU, rows, and bytes in user space while built and in the
kernel once written (unwind_rows' words: 4 bytes a row, the page index, a row at each page's start).
"""

from __future__ import annotations

import glob
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import BPF_PROG_TYPE_PERF_EVENT, Children, bpf_programs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetprof.agent.process.table import ProcessTable  # noqa: E402
from fleetprof.agent.sampler import CpuSampler, SamplerConfig  # noqa: E402
from fleetprof.agent.symbols.elf import ElfFile  # noqa: E402
from fleetprof.agent.unwind.kernel_maps import paged  # noqa: E402
from fleetprof.agent.unwind.table import build_table  # noqa: E402
from fleetprof.agent.unwind.unwinder import Unwinder  # noqa: E402

LIBRARIES = ("libLLVM-*.so*", "libpython3*.so*", "libc.so.6")


@dataclass
class UnwindRow:
    hz: int
    mode: str
    us_per_sample: list[float]
    frames: list[float]


@dataclass
class TableCost:
    path: str
    seconds: float
    rows: int
    bytes: int
    kernel_bytes: int


def _sampler_run(binary: Path, ncpus: int, hz: int, mode: str, seconds: float) -> tuple[float, float]:
    """(µs per sample, mean user frames per sample) for one timed window."""
    sampler = CpuSampler(SamplerConfig(frequency_hz=hz, interval_s=seconds, unwind=mode, off_cpu=False))
    maps = sampler.unwind_maps()
    unwinder = Unwinder(maps) if maps is not None else None
    table = ProcessTable(on_capture=unwinder.describe if unwinder else None)
    children = Children()
    try:
        workers = [children.start([str(binary), "run", str(seconds + 3)]) for _ in range(ncpus)]
        time.sleep(0.3)  # mapped: described as the agent does at a process's first sample
        for w in workers:
            table.refresh(w.pid)
        if unwinder is not None:
            unwinder.build_pending()
        time.sleep(0.5)
        sampler.drain()
        before = _sampler_prog(os.getpid())
        time.sleep(seconds)
        after = _sampler_prog(os.getpid())
        drain = sampler.drain()
        ns, runs = after[0] - before[0], after[1] - before[1]
        pids = {w.pid for w in workers}
        depth = [
            len(drain.stacks.get(s.user_stack, ()))
            for s in drain.samples
            if s.tgid in pids
            for _ in range(s.count)
        ]
        for w in workers:
            w.wait(timeout=60)
    finally:
        children.close()
        if unwinder is not None:
            unwinder.stop()
        sampler.close()
    return (ns / runs / 1e3 if runs else float("nan")), (statistics.mean(depth) if depth else 0.0)


def _sampler_prog(pid: int) -> tuple[int, int]:
    progs = [p for p in bpf_programs(pid).values() if p.prog_type == BPF_PROG_TYPE_PERF_EVENT]
    return sum(p.run_time_ns for p in progs), sum(p.run_cnt for p in progs)


def measure_unwind(
    workdir: Path, ncpus: int, frequencies: list[int], seconds: float, rounds: int
) -> list[UnwindRow]:
    source = Path(__file__).parent / "workloads" / "spin.c"
    out = workdir / "nofp"
    out.mkdir(exist_ok=True)
    binary = out / "spin"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", str(binary), str(source)], check=True)
    rows = {(hz, mode): UnwindRow(hz, mode, [], []) for hz in frequencies for mode in ("fp", "eh_frame")}
    for r in range(rounds):
        for hz in frequencies:
            modes = ("fp", "eh_frame") if r % 2 == 0 else ("eh_frame", "fp")
            for mode in modes:
                print(f"  unwind {mode} at {hz} Hz, round {r + 1}/{rounds}", file=sys.stderr, flush=True)
                us, frames = _sampler_run(binary, ncpus, hz, mode, seconds)
                rows[(hz, mode)].us_per_sample.append(us)
                rows[(hz, mode)].frames.append(frames)
    return list(rows.values())


def measure_tables(repeats: int = 3) -> list[TableCost]:
    out = []
    for pattern in LIBRARIES:
        paths = sorted(glob.glob(f"/usr/lib/x86_64-linux-gnu/{pattern}"), key=os.path.getsize, reverse=True)
        if not paths:
            continue
        path = paths[0]
        spent, rows = [], 0
        for _ in range(repeats):
            t0 = time.process_time()
            with ElfFile(path) as elf:
                table = build_table(elf)
            spent.append(time.process_time() - t0)
            rows = len(table)
        _, rules = np.unique(table.rules, return_inverse=True)  # any ids will do for the size
        words = len(paged(table.pcs, rules.astype(np.uint32), 0))
        out.append(TableCost(path, statistics.median(spent), rows, table.nbytes, 4 * words))
    return out


def format_unwind(rows: list[UnwindRow], tables: list[TableCost]) -> list[str]:
    lines = [
        "## User stacks without frame pointers: --unwind=eh_frame against fp",
        "",
        "| Hz | unwind | BPF µs per sample (median) [min..max] | user frames per sample |",
        "|---:|---|---|---:|",
    ]
    by = {(r.hz, r.mode): r for r in rows}
    for r in rows:
        us = statistics.median(r.us_per_sample)
        lines.append(
            f"| {r.hz} | {r.mode} | {us:.2f} [{min(r.us_per_sample):.2f}..{max(r.us_per_sample):.2f}] "
            f"| {statistics.median(r.frames):.1f} |"
        )
    for hz in sorted({r.hz for r in rows}):
        if (hz, "fp") in by and (hz, "eh_frame") in by:
            more = statistics.median(by[(hz, "eh_frame")].us_per_sample) - statistics.median(
                by[(hz, "fp")].us_per_sample
            )
            lines.append(f"\nAt {hz} Hz the table walk adds {more:.2f} µs a sample (target: <= 10).")
    lines += [
        "",
        "| library | table build, s CPU (median of 3) | rows | user bytes | kernel bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in tables:
        lines.append(f"| {t.path} | {t.seconds:.2f} | {t.rows:,} | {t.bytes:,} | {t.kernel_bytes:,} |")
    return lines
