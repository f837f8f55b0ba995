"""What our CUPTI library costs a launch-bound CUDA loop, on the CUDA stand-ins (no GPU here).

    .venv/bin/python bench/cuda_launch_cost.py [--seconds 2] [--rounds 5] [--marker-uprobe] [--json OUT]

The loop (tests/cuda_standin/launcher.c `loop`): zero-length kernels through cudaLaunchKernel (the runtime,
which calls the driver's cuLaunchKernel: two CUPTI callbacks each), as fast as it goes; it counts its own
launches and seconds. Columns, run interleaved in every round (order rotated), medians reported:

  plain        no CUPTI client
  null tool    a CUPTI client that asks for the same callbacks and activity and does nothing with them
               (tests/cuda_standin/null_tool.c): what the stand-in CUPTI itself costs
  ours         our library at its defaults (1 in 8 sampled, cap 1,000/s per thread)
  ours 1/1     every launch sampled, no cap (a launch record and a marker call per launch)
  + marker uprobe (1/8, 1/1)   with --marker-uprobe (root, BCC): a uprobe on fleetprof_cupti_launch that
               takes the user stack, as the agent's will; what a sampled launch's trap costs

"our own cost" = ours - null tool: the library's work per launch, which does not depend on whose CUPTI runs
underneath. NVIDIA's CUPTI costs far more than the stand-in's (about 1.5 µs a launch measured on an H200,
bench/README.md), so read the µs columns, not the stand-in's throughput ratios, when judging a real job.

The agent's own CUDA uprobes beside no probes and this library: bench/cuda_launch.py. AGENT_COLUMN below
stays a hook for a column of this script's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.cuda_standin builds the stand-ins; it is not part of the package

from tests.cuda_standin import CudaStandins, build_standins  # noqa: E402

MARKER = "fleetprof_cupti_launch"
UPROBE_PROGRAM = r"""
#include <uapi/linux/ptrace.h>
BPF_STACK_TRACE(stacks, 16384);
BPF_HASH(hits, u32, u64, 1024);
int on_launch(struct pt_regs *ctx) {
    u32 key = stacks.get_stackid(ctx, BPF_F_USER_STACK) & 1023;
    u64 zero = 0, *n = hits.lookup_or_try_init(&key, &zero);
    if (n) __sync_fetch_and_add(n, 1);
    return 0;
}
"""


@dataclass
class Column:
    name: str
    env: dict[str, str]
    inject: str | None  # "ours", "null" or None
    around: Callable[[CudaStandins], contextlib.AbstractContextManager] | None = None
    rates: list[float] = field(default_factory=list)


@contextlib.contextmanager
def marker_uprobe(cuda: CudaStandins) -> Iterator[None]:
    from bcc import BPF

    bpf = BPF(text=UPROBE_PROGRAM.encode())
    try:
        bpf.attach_uprobe(name=bytes(cuda.library), sym=MARKER.encode(), fn_name=b"on_launch")
        yield
    finally:
        bpf.cleanup()


# The agent's uprobes, when the lead adds them: Column("ours + agent", {}, "ours", around=start_agent),
# where start_agent(cuda) is a context manager that starts `fleetprof agent` (or its CUDA probes), then
# stops it.
AGENT_COLUMN: Column | None = None

EXACT = {"FLEETPROF_CUPTI_SAMPLE_EVERY": "1", "FLEETPROF_CUPTI_SAMPLE_CAP": "0"}


def columns(with_uprobe: bool) -> list[Column]:
    cols = [
        Column("plain", {}, None),
        Column("null tool", {}, "null"),
        Column("ours", {}, "ours"),
        Column("ours 1/1", dict(EXACT), "ours"),
    ]
    if with_uprobe:
        cols += [
            Column("ours + marker uprobe", {}, "ours", around=marker_uprobe),
            Column("ours 1/1 + marker uprobe", dict(EXACT), "ours", around=marker_uprobe),
        ]
    if AGENT_COLUMN is not None:
        cols.append(AGENT_COLUMN)
    return cols


def run_loop(cuda: CudaStandins, col: Column, seconds: float) -> float:
    env = cuda.env(inject=col.inject is not None, **col.env)
    if col.inject == "null":
        env["CUDA_INJECTION64_PATH"] = str(cuda.null_tool)
    ctx = col.around(cuda) if col.around else contextlib.nullcontext()
    with ctx:
        argv = [str(cuda.launcher), "loop", str(seconds)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"{col.name}: the loop failed ({out.returncode}): {out.stderr[-2000:]}")
    loop = json.loads(out.stdout.splitlines()[-1])
    return loop["launches"] / loop["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--marker-uprobe", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cuda = build_standins(Path(tmp))
        cols = columns(args.marker_uprobe)
        for r in range(args.rounds):
            order = cols[r % len(cols) :] + cols[: r % len(cols)]
            for col in order:
                col.rates.append(run_loop(cuda, col, args.seconds))
            rates = ", ".join(f"{c.name} {c.rates[-1]:,.0f}/s" for c in cols)
            print(f"round {r + 1}/{args.rounds}: {rates}")
    plain = statistics.median(cols[0].rates)
    null = statistics.median(cols[1].rates)
    print(f"\n{'column':26} {'launches/s':>12} {'us/launch':>10} {'+us vs plain':>13} {'+us vs null':>12} "
          f"{'lost vs plain':>14} {'spread':>8}")  # fmt: skip
    result = {}
    for col in cols:
        rate = statistics.median(col.rates)
        us = 1e6 / rate
        spread = (max(col.rates) - min(col.rates)) / rate * 100
        row = {"rate": rate, "us": us, "added_us": us - 1e6 / plain, "own_us": us - 1e6 / null,
               "lost_pct": (1 - rate / plain) * 100, "spread_pct": spread, "rates": col.rates}  # fmt: skip
        result[col.name] = row
        print(f"{col.name:26} {rate:12,.0f} {us:10.3f} {row['added_us']:+13.3f} {row['own_us']:+12.3f} "
              f"{row['lost_pct']:13.1f}% {spread:7.1f}%")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
