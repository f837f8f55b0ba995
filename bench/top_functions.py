"""What ranking by function costs next to ranking by line: `top_functions` on one profile both ways,
interleaved, medians.

A Python frame is named by its line ("f (a.py:7)"); by default /api/v1/top and /diff merge a function's
lines into one row (collector/render/tree.py PythonFunctions). The profile here is synthetic and as large as
a "now" query of a busy fleet (5,000 stacks of 24 frames, bench/collector.py), with a given share of Python
frames spread over the lines of a few hundred functions.

    .venv/bin/python bench/top_functions.py [--stacks 5000] [--depth 24] [--python-share 0.25] [--rounds 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetprof.collector.model.profile import FrameKey  # noqa: E402
from fleetprof.collector.render.tree import top_functions  # noqa: E402


def profile(stacks: int, depth: int, python_share: float, seed: int = 1) -> dict[tuple[FrameKey, ...], int]:
    rng = random.Random(seed)
    native = [FrameKey(f"fn_{i}", f"/usr/lib/lib{i % 40}.so", False) for i in range(3000)]
    # 300 functions over 50 lines each, in one file per 10 functions.
    python = [
        FrameKey(f"py_{i % 300} (m{i % 30}.py:{i % 50})", f"/srv/m{i % 30}.py", False) for i in range(3000)
    ]
    out: dict[tuple[FrameKey, ...], int] = {}
    while len(out) < stacks:
        stack = tuple(rng.choice(python if rng.random() < python_share else native) for _ in range(depth))
        out[stack] = rng.randint(1, 100)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stacks", type=int, default=5000)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--python-share", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    stacks = profile(args.stacks, args.depth, args.python_share)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for lines in (True, False):  # interleaved, so drift on a shared machine hits both alike
            t = time.perf_counter()
            top_functions(stacks, 20, "self", lines)
            times[lines].append(time.perf_counter() - t)
    by_line, by_function = statistics.median(times[True]), statistics.median(times[False])
    shape = f"{args.stacks} stacks x {args.depth} frames, {args.python_share:.0%} Python frames"
    print(f"{shape}, {args.rounds} rounds")
    print(f"by line      {by_line * 1e3:7.1f} ms (median)")
    print(f"by function  {by_function * 1e3:7.1f} ms (median), {by_function / by_line:.2f}x")


if __name__ == "__main__":
    main()
