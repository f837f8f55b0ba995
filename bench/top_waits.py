"""What ranking off-CPU time by where threads blocked costs next to ranking it by frame: on one profile,
`top_waits(blocked_where(...))` (collector/query/waits.py, the default of /api/v1/top for offcpu and wall)
against `top_functions` (rank=frame), interleaved, medians.

The profile is synthetic and as large as a "now" query of a busy fleet (5,000 stacks, bench/collector.py):
user frames as bench/top_functions.py draws them (a share of them Python), then one of the kernel tails
the agent records on this kernel (tests/collector/test_waits.py's captured stacks: read, futex, epoll_wait,
preempted, page fault, ...).

    .venv/bin/python bench/top_waits.py [--stacks 5000] [--depth 24] [--python-share 0.25] [--rounds 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.top_functions import profile as user_stacks  # noqa: E402
from fleetprof.collector.model.profile import FrameKey  # noqa: E402
from fleetprof.collector.query.waits import blocked_where  # noqa: E402
from fleetprof.collector.render.tree import top_functions  # noqa: E402
from fleetprof.collector.render.waits import top_waits  # noqa: E402
from tests.collector.test_waits import CASES, stack  # noqa: E402


def profile(stacks: int, depth: int, python_share: float, seed: int = 1) -> dict[tuple[FrameKey, ...], int]:
    rng = random.Random(seed)
    tails = {tuple(f for f in stack(text) if f.kernel) for _, text, _, _ in CASES}
    kernel = sorted(t for t in tails if t)
    libc = FrameKey("read", "libc.so.6")
    return {
        (*user, libc, *rng.choice(kernel)): n
        for user, n in user_stacks(stacks, depth - 12, python_share, seed).items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stacks", type=int, default=5000)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--python-share", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    stacks = profile(args.stacks, args.depth, args.python_share)
    times: dict[str, list[float]] = {"frame": [], "blocked": []}
    for _ in range(args.rounds):
        t = time.perf_counter()  # interleaved, so drift on a shared machine hits both alike
        top_functions(stacks, 20, "self")
        times["frame"].append(time.perf_counter() - t)
        t = time.perf_counter()
        top_waits(blocked_where(stacks), 20)
        times["blocked"].append(time.perf_counter() - t)
    frame, blocked = statistics.median(times["frame"]), statistics.median(times["blocked"])
    depth = sum(len(st) for st in stacks) / len(stacks)
    print(f"{len(stacks)} stacks of {depth:.0f} frames, {args.python_share:.0%} Python, {args.rounds} rounds")
    print(f"rank=frame    {frame * 1e3:7.1f} ms (median)")
    print(f"rank=blocked  {blocked * 1e3:7.1f} ms (median), {blocked / frame:.2f}x")


if __name__ == "__main__":
    main()
