"""What Python-aware stacks cost: fleetprof agent with --python vs --no-python, next to py-spy.

Run as root from the repository root (py-spy from PyPI in the venv: `.venv/bin/pip install py-spy`):

    .venv/bin/python bench/python.py [--pairs 3] [--seconds 5] [--frequencies 19,99]

Workload: bench/workloads/py_work.py, one CPython 3.12 process (pyenv) per CPU, each running
outer() -> middle() -> list comprehension (70%) and decoy() (30%) for S seconds; throughput is iterations
per wall second. Each condition is measured as interleaved A/B pairs (baseline without profiler, then
with; the order alternates) and the table quotes medians. The agent's BPF cost per sample is the kernel's
own accounting of its perf_event program (BPF_ENABLE_STATS, see bench/overhead.py): with --python minus
--no-python it is the walker's added cost per sample. py-spy (`record --native`, one per workload process,
as a user would attach it) is the anchor; both profiles are compared on the shares of the top Python
functions.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from common import BpfRunTimeStats, Children, Collector, FleetprofAgent, http_get, read_usage

WORKLOAD = Path(__file__).parent / "workloads" / "py_work.py"
PYSPY = Path(sys.executable).parent / "py-spy"
FUNCTIONS = ("outer", "middle", "decoy", "spin")


def python312() -> str:
    found = sorted(glob.glob("/root/.pyenv/versions/3.12.*/bin/python3.12"))
    return found[-1] if found else sys.executable


def run_workload(children: Children, ncpus: int, seconds: float, attach=None):
    procs = [
        children.start([python312(), str(WORKLOAD), str(seconds)], stdout=subprocess.PIPE)
        for _ in range(ncpus)
    ]
    spies = [attach(p.pid) for p in procs] if attach else []
    rate = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        n, wall_ns, _cpu_ns = map(int, out.split())
        rate += n / (wall_ns / 1e9)
    return rate, procs, spies


def shares(folded: dict[str, int]) -> dict[str, float]:
    total = sum(folded.values()) or 1
    return {
        fn: sum(n for st, n in folded.items() if any(f.startswith(f"{fn} (") for f in st.split(";"))) / total
        for fn in FUNCTIONS
    }


def parse_folded(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        st, _, n = line.rpartition(" ")
        if st and n.isdigit():
            out[st] = out.get(st, 0) + int(n)
    return out


def fetch_folded(collector: Collector, pids: list[int]) -> dict[str, int]:
    query = urllib.parse.urlencode(
        {"query": f'{{pid=~"{"|".join(map(str, pids))}"}}', "since": "30m", "format": "folded"}
    )
    _, text = http_get(f"http://{collector.http}/api/v1/profile?{query}", timeout_s=30)
    return parse_folded(text)


def measure(children, collector, workdir, ncpus, seconds, freq, kind):
    """One profiled run: (throughput, BPF ns per sample or None, shares of the top functions)."""
    if kind == "py-spy":
        outs: list[Path] = []

        def attach(pid: int):
            out = workdir / f"pyspy-{pid}.txt"
            outs.append(out)
            argv = [str(PYSPY), "record", "--native", "--rate", str(freq), "--format", "raw", "-o", str(out)]
            return children.start([*argv, "--pid", str(pid)])

        rate, _procs, spies = run_workload(children, ncpus, seconds, attach)
        for spy in spies:
            spy.wait(timeout=60)
        folded: dict[str, int] = {}
        for out in outs:
            for st, n in parse_folded(out.read_text() if out.exists() else "").items():
                folded[st] = folded.get(st, 0) + n
        return rate, None, shares(folded)
    flag = "--python" if kind == "python" else "--no-python"
    agent = FleetprofAgent(children, collector, freq, max(1.0, seconds / 2), workdir, extra_args=(flag,))
    agent.start()
    before = read_usage(agent.pid)
    rate, procs, _ = run_workload(children, ncpus, seconds)
    after = read_usage(agent.pid)
    agent.stop()  # its final drain ships the last window
    runs = after.sampler_runs - before.sampler_runs
    per_sample = (after.sampler_ns - before.sampler_ns) / runs if runs else None
    return rate, per_sample, shares(fetch_folded(collector, [p.pid for p in procs]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--frequencies", default="19,99")
    args = ap.parse_args()
    ncpus = os.cpu_count() or 1
    if not PYSPY.exists():
        print(f"py-spy not found at {PYSPY}: .venv/bin/pip install py-spy", file=sys.stderr)
        return 1
    children = Children()
    workdir = Path(tempfile.mkdtemp(prefix="fleetprof-pybench-"))
    collector = Collector(children, workdir)
    rows = []
    try:
        collector.start()
        with BpfRunTimeStats() as stats:
            if stats.error:
                print(f"(no BPF run-time stats: {stats.error})", file=sys.stderr)
            for freq in [int(f) for f in args.frequencies.split(",")]:
                for kind in ("python", "no-python", "py-spy"):
                    slow, cost, top = [], [], []
                    for i in range(args.pairs):
                        base = prof = 0.0
                        for profiled in (False, True) if i % 2 == 0 else (True, False):
                            if profiled:
                                prof, ns, sh = measure(
                                    children, collector, workdir, ncpus, args.seconds, freq, kind
                                )
                                if ns is not None:
                                    cost.append(ns / 1000)
                                top.append(sh)
                            else:
                                base, _, _ = run_workload(children, ncpus, args.seconds)
                        slow.append((1 - prof / base) * 100)
                        print(f"  {freq} Hz {kind}: pair {i + 1}: slowdown {slow[-1]:+.2f}%", file=sys.stderr)
                    med = {fn: statistics.median(s[fn] for s in top) * 100 for fn in FUNCTIONS}
                    rows.append((freq, kind, statistics.median(slow), min(slow), max(slow),
                                 statistics.median(cost) if cost else None, med))  # fmt: skip
    finally:
        children.close()
    print(f"\nCPython 3.12 workload on {ncpus} CPUs, {args.pairs} pairs of {args.seconds:g} s, medians\n")
    print("| profiler | Hz | slowdown % (median) | min / max % | BPF µs per sample | " + " | ".join(
        f"{fn} %" for fn in FUNCTIONS) + " |")  # fmt: skip
    print("|---|---:|---:|---:|---:|" + "---:|" * len(FUNCTIONS))
    for freq, kind, med, lo, hi, cost, sh in rows:
        name = {"python": "fleetprof --python", "no-python": "fleetprof --no-python"}.get(
            kind, "py-spy --native"
        )
        c = f"{cost:.1f}" if cost is not None else "–"
        print(f"| {name} | {freq} | {med:+.2f} | {lo:+.2f} / {hi:+.2f} | {c} | "
              + " | ".join(f"{sh[fn]:.1f}" for fn in FUNCTIONS) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
