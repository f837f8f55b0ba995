"""Stack maps preallocated against allocated by need: two samplers at once, on the same node and seconds,
one of each, with the same CPython processes walked; what each loses (stack_table_full,
python_stack_table_full).

    .venv/bin/python bench/stack_maps_by_need.py [--frequency 608] [--interval 10] [--windows 2] [--pytorch]

With --pytorch, bench/pytorch_node.py's job runs (its venv must exist: run pytorch_node.py once) and its
processes' CPython frames are walked by both samplers. Each sampler is the agent's own CpuSampler with the
stack maps' flags set by hand (0: preallocated, BPF_F_NO_PREALLOC: by need).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import bcc

from fleetprof.agent import sampler as S
from fleetprof.agent.process.table import read_process
from fleetprof.agent.python.unwinder import PythonStacks

CACHE = Path("/var/cache/fleetprof-bench")
KEYS = ("samples", "python_samples", "stack_table_full", "python_stack_table_full")


class _Flagged(bcc.BPF):
    """bcc.BPF with the stack maps' flags replaced (the sampler compiles through bcc.BPF)."""

    flags = 0

    def __init__(self, *args, cflags=(), **kwargs):
        cflags = [
            f"-DSTACKS_MAP_FLAGS={self.flags}" if c.startswith("-DSTACKS_MAP_FLAGS") else c for c in cflags
        ]
        super().__init__(*args, cflags=cflags, **kwargs)


def family(pid: int) -> list[int]:
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frequency", type=int, default=608)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--pytorch", action="store_true")
    args = ap.parse_args()
    job = None
    if args.pytorch:
        seconds = args.interval * args.windows + 30
        job = subprocess.Popen([str(CACHE / "torch-venv/bin/python"), str(CACHE / "pytorch_workload.py"),
                                str(seconds)], stdout=subprocess.DEVNULL)  # fmt: skip
    bcc.BPF = _Flagged  # what agent/kernel.py load_bcc returns
    samplers, walkers = {}, {}
    for label, flags in (("preallocated", 0), ("by need", S.BPF_F_NO_PREALLOC)):
        _Flagged.flags = flags
        samplers[label] = S.CpuSampler(S.SamplerConfig(frequency_hz=args.frequency, interval_s=args.interval))
        walkers[label] = PythonStacks()
        walkers[label].attach(samplers[label])
    try:
        if job is not None:
            time.sleep(8)  # torch imported, DataLoader workers started
            for pid in family(job.pid):
                try:
                    info = read_process(pid)
                except ProcessLookupError:
                    continue
                for walker in walkers.values():
                    walker.on_capture(info)
        for s in samplers.values():
            s.drain()
        totals = {label: dict.fromkeys(KEYS, 0) for label in samplers}
        for _ in range(args.windows):
            time.sleep(args.interval)
            for label, s in samplers.items():
                d = s.drain()
                for k in KEYS:
                    totals[label][k] += d.stats.get(k, 0)
        print(f"{args.frequency} Hz, {args.windows} x {args.interval:g} s, load {os.getloadavg()[0]:.1f}, "
              f"{'PyTorch job walked' if job else 'no job'}:")  # fmt: skip
        for label, t in totals.items():
            print(f"  {label}: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    finally:
        if job is not None:
            job.kill()
        for s in samplers.values():
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
