"""The agent's encoder (agent/batch.py encode_window) on windows of new, deep stacks, against the encoder of
another revision, in one process.

    .venv/bin/python bench/encode.py [--baseline REV] [--rounds 5]   # seconds; no root, no BPF

Windows as a PyTorch node's drains hand them over (bench/README.md, "The drain on a PyTorch node"): 8,000
rows each of 15-40 frames, the outer ones drawn from 300 frames and the last five from 3,000, C++-sized
names of 40-300 characters, so almost every row is a stack new to the batch. The baseline's batch.py is
read from git (`git show REV:agent/batch.py`) and loaded beside the working tree's. Process CPU per row,
rounds alternating, medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent import batch as current
from fleetprof.agent.model import CgroupIdentity, Frame, ProcessInfo, ResolvedSample, Window

REPO = Path(__file__).resolve().parent.parent


def baseline(rev: str):
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:agent/batch.py"], check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "batch_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("batch_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def windows(n: int = 3, rows: int = 8000) -> list[Window]:
    rng = random.Random(1)
    mods = ["/venv/torch/lib/libtorch_cpu.so", "/usr/bin/python3.11", "/lib/libc.so.6", "[kernel]"]
    names = "abcdefghijklmnopqrstuvwxyz_:<>"
    frames = [
        Frame(
            f"at::native::{''.join(rng.choice(names) for _ in range(rng.randrange(40, 300)))}_{i}",
            rng.choice(mods),
        )
        for i in range(3000)
    ]
    proc = ProcessInfo(7, 1, "python3", "/usr/bin/python3.11", CgroupIdentity(path="/bench"), ())
    out = []
    for _ in range(n):
        samples = []
        for _ in range(rows):
            depth = rng.randrange(15, 41)
            stack = tuple(rng.choice(frames[:300]) for _ in range(depth - 5)) + tuple(
                rng.choice(frames) for _ in range(5)
            )
            samples.append(ResolvedSample(proc, 7, stack, depth - 2, 1))
        out.append(Window(0, 10**9, samples))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--baseline", default="b18a324", help="the revision to compare with (before issue 31's encode cut)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sides = {"baseline": baseline(args.baseline), "current": current}
    wins = windows()
    rows = sum(len(w.samples) for w in wins)
    identity = pb.AgentIdentity(node="bench", agent_id="bench")
    stacks = {name: len(mod.encode_window(wins[0], identity).stack_ids) for name, mod in sides.items()}
    assert len(set(stacks.values())) == 1, stacks  # the same batch's stacks either way
    us: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, mod in sides.items():
            t0 = time.process_time()
            for w in wins:
                mod.encode_window(w, identity)
            us[name].append((time.process_time() - t0) / rows * 1e6)
    base, cur = statistics.median(us["baseline"]), statistics.median(us["current"])
    print(f"{rows} rows, {stacks['current']} stacks in the first window's batch of {len(wins[0].samples)}")
    for name, median in (("baseline " + args.baseline, base), ("current", cur)):
        rounds = ", ".join(f"{x:.1f}" for x in us[name.split()[0]])
        print(f"{name}: {median:.2f} us per row (rounds {rounds})")
    print(f"current / baseline: {cur / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
