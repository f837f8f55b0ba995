"""The per-pod GPU report's idle stacks (/api/v1/gpus with functions, `fleetprof gpus`): one grouped select
of the store for all pods (QueryService.gpu_report) against the selects per pod it replaced (the view's
select and the wall view's two halves, per pod), side by side in one run, medians.

    .venv/bin/python bench/gpu_report.py [--quick] [--pods 50,200] [--repeats 7]

The fleet: `pods` GPU pods of 4 processes each, whose samples are tagged idle or busy, with off-CPU time
of active and idle threads, beside 1,000 processes on no GPU; 6 windows of 10 s, 25 rows per label set
per window, stacks drawn from 5,000. Stores: in memory, DuckDB's hot tier, and DuckDB's database (after a
flush, with a clock past the hot tier). The report shows the default 50 pods. Both paths' answers are
checked equal. Times are this process's CPU time (all its threads): the machine is shared, and wall time
measures the other users' load as much as the query.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetprof.collector.ingest.decode import Decoder  # noqa: E402
from fleetprof.collector.model.gpu import PodGpuSummary  # noqa: E402
from fleetprof.collector.model.ids import ContentIds  # noqa: E402
from fleetprof.collector.model.profile import FrameKey  # noqa: E402
from fleetprof.collector.model.rows import ProfileRows  # noqa: E402
from fleetprof.collector.model.selector import Matcher, Selector  # noqa: E402
from fleetprof.collector.query.answers import Scope  # noqa: E402
from fleetprof.collector.query.service import QueryService  # noqa: E402
from fleetprof.collector.query.typed import TypedStore  # noqa: E402
from fleetprof.collector.store.durable import DurableStore, content_key  # noqa: E402
from fleetprof.collector.store.memory import MemoryStore  # noqa: E402

HZ, LIMIT = 19, 50


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Usage:
    """The GPU usage log's answer (GpuUsage's protocol) for the fleet: every GPU pod, in a fixed order. It
    is the report's input, not what is measured."""

    def __init__(self, pods: int) -> None:
        self._pods = [PodGpuSummary(f"ns-{p % 5}", f"train-{p}", {f"node-{p}/0"}, 60.0) for p in range(pods)]

    def pods(self, selector: Selector, start: float, end: float) -> list[PodGpuSummary]:
        return list(self._pods)


def label_sets(pods: int) -> list[tuple]:
    """Every label set the fleet's rows carry: per GPU pod process its idle and busy CPU samples and its
    idle off-CPU time (active threads and idle ones); the processes on no GPU."""
    out = []
    for p in range(pods):
        for proc in range(4):
            base = (("comm", "python3"), ("namespace", f"ns-{p % 5}"), ("node", f"node-{p}"),
                    ("pid", str(100 + proc)), ("pod", f"train-{p}"))  # fmt: skip
            out.append(tuple(sorted((*base, ("gpu_state", "idle")))))
            out.append(tuple(sorted((*base, ("gpu_state", "busy")))))
            out.append(tuple(sorted((*base, ("gpu_state", "idle"), ("__type__", "offcpu")))))
            out.append(
                tuple(sorted((*base, ("gpu_state", "idle"), ("__type__", "offcpu"), ("__thread__", "idle"))))
            )
    for q in range(1000):
        out.append((("comm", f"proc-{q % 40}"), ("namespace", f"ns-{q % 7}"), ("node", f"node-{q % 500}"),
                    ("pid", str(5000 + q)), ("pod", f"web-{q // 4}")))  # fmt: skip
    return out


def windows(ids: ContentIds, pods: int, now: float, rng: random.Random) -> list[ProfileRows]:
    frames = [FrameKey(f"func_{i}", "/opt/app/train") for i in range(3000)]
    stacks = []
    for _ in range(5000):
        st = tuple(rng.choice(frames) for _ in range(rng.randrange(8, 30)))
        stacks.append((ids.stack_id(st), st))
    sets = [(ids.labels_id(lb), lb) for lb in label_sets(pods)]
    per_set = 25  # rows per label set per window
    out = []
    for w in range(6):
        end = now - 50 + 10 * w
        rows = len(sets) * per_set
        picks = np.array([rng.randrange(len(stacks)) for _ in range(rows)], dtype=np.int64)
        distinct, where = np.unique(picks, return_inverse=True)
        counts = np.array([rng.randrange(1, 40) for _ in range(rows)], dtype=np.int64)
        # off-CPU rows are nanoseconds: a wait of 1 to 40 ms
        offcpu = np.array(["__type__" in dict(lb) for _, lb in sets])[np.arange(rows) // per_set]
        counts = np.where(offcpu, counts * 1_000_000, counts)
        out.append(
            ProfileRows(end - 10, end, HZ, sets, [stacks[s] for s in distinct.tolist()],
                        np.arange(rows, dtype=np.int64) // per_set, where.astype(np.int64), counts)
        )  # fmt: skip
    return out


def per_pod(store, usage: Usage, scope: Scope) -> dict:  # any ProfileStore
    """The path the grouped select replaced: per pod, the view's select and the wall view's two halves."""
    typed, wall = TypedStore(store, scope.kind, scope.threads), TypedStore(store, "wall", "active")
    out = {}
    for p in usage.pods(scope.selector, scope.start, scope.end)[:LIMIT]:
        idle = Selector((Matcher("namespace", "=", p.namespace), Matcher("pod", "=", p.pod),
                         Matcher("gpu_state", "=", "idle")))  # fmt: skip
        own = typed.select(idle, scope.start, scope.end).stacks
        running, waits = wall.select_apart(idle, scope.start, scope.end)
        merged = dict(running.stacks)
        for stack, ns in waits.stacks.items():
            merged[stack] = merged.get(stack, 0) + ns
        out[p.pod] = (own, merged)
    return out


def grouped(query: QueryService, scope: Scope) -> dict:
    return {r.pod: (r.idle_stacks, r.idle_wall_stacks) for r in query.gpu_report(scope, LIMIT, True)}


def median_ms(fn, repeats: int) -> tuple[float, object]:  # a callable of no arguments
    times, res = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        res = fn()
        times.append(time.process_time() - t0)
    return 1000 * statistics.median(times), res


def run(pods: int, repeats: int) -> list[dict]:
    rng = random.Random(11)
    now = 1_900_000_000.0
    tmp = Path(tempfile.mkdtemp(prefix="fleetprof-bench-gpus-"))
    ids = ContentIds(content_key(tmp))
    clock = Clock(now - 600)
    durable = DurableStore(tmp, decode=Decoder(ids).decode_payload, ids=ids, clock=clock, background=False)
    mem = MemoryStore(clock=clock)
    for rows in windows(ids, pods, now, rng):
        clock.t = rows.end
        durable.write(rows)
        mem.write(rows)
    durable.flush()
    usage = Usage(pods)
    scope = Scope(Selector(), now - 60, now)
    out = []
    try:
        for name, store, t in (("in memory", mem, now), ("DuckDB hot tier", durable, now),
                               ("DuckDB database", durable, now + 3600)):  # fmt: skip
            clock.t = t
            query = QueryService(store, usage)
            old_ms, old = median_ms(lambda s=store: per_pod(s, usage, scope), repeats)
            new_ms, new = median_ms(lambda q=query: grouped(q, scope), repeats)
            assert old == new, f"{name}: the grouped report differs from the per-pod selects"
            out.append({"store": name, "GPU pods": pods, "per pod CPU ms": old_ms, "grouped CPU ms": new_ms,
                        "ratio": old_ms / new_ms})  # fmt: skip
    finally:
        durable.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--pods", default="50,200", help="GPU pods in the fleet, one run each")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    rows = [r for pods in map(int, args.pods.split(",")) for r in run(pods, repeats)]
    print(f"## per-pod GPU report, idle stacks of {LIMIT} pods (cpu view), medians of {repeats}\n")
    print("| store | GPU pods | per pod CPU ms | grouped CPU ms | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['store']} | {r['GPU pods']} | {r['per pod CPU ms']:,.1f} | {r['grouped CPU ms']:,.1f} | "
              f"{r['ratio']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
