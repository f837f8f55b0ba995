"""The agent's memory: RSS, start-up peak, table worker, and the kernel memory of its BPF maps, here and as
it would be on a bigger node.

Run as root from the repository root:

    .venv/bin/python bench/agent_memory.py [--cpus 64] [--frequency 19] [--interval 10] [--json FILE]

Method: a collector and an agent at defaults (or the given frequency and interval) start; the spin workload
runs on every CPU for one interval, so the agent has sampled, described and unwound something; after the
next drain the bench reads the agent's VmRSS and VmHWM (peak over its life: BCC's compile included), the
RSS of its table worker (a child process that builds unwind tables and exits when idle), and every BPF map
the agent holds from /proc/PID/fdinfo: its type, entries and `memlock`, the kernel's own count of the bytes
the map holds (preallocated entries, buckets and per-CPU copies; for a map without preallocation, the
entries in use).

The projection to --cpus N is by the maps' real sizes: the agent sizes its count, stack and off-CPU maps
from the CPU count (agent/sampler.py SamplerConfig.table_sizes, offcpu_sizes, python_stacks_size), so each
such map's measured bytes are scaled by its entries at N CPUs over its entries here, and every per-CPU map's
by N over this node's possible CPUs. Preallocated maps hold what they will ever hold; a map without
preallocation is projected at its measured bytes (what it holds now) and, beside, at its full size.

Targets (issue 31): RSS + BPF map kernel memory at 64 CPUs <= 300 MB at defaults; start-up peak (VmHWM)
<= steady RSS + 50 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import (
    SPIN_SOURCE,
    BpfMap,
    Children,
    Collector,
    FleetprofAgent,
    bpf_maps,
    build,
    proc_status,
    run_workload,
)

from fleetprof.agent.sampler import SamplerConfig

MB = 1e6
# BPF map types (include/uapi/linux/bpf.h) whose values are per CPU.
PERCPU_TYPES = {5, 6, 10}  # BPF_MAP_TYPE_PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
BPF_F_NO_PREALLOC = 1
HASH_TYPES = {1, 5}  # BPF_MAP_TYPE_HASH, PERCPU_HASH: the only ones that may go without preallocation


def possible_cpus() -> int:
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def entries_at(config: SamplerConfig, ncpus: int) -> dict[str, int]:
    """The entries the sampler gives its CPU-sized maps on a node of `ncpus` CPUs (by map name)."""
    counts, stacks = config.table_sizes(ncpus)
    offcpu, tasks = config.offcpu_sizes(ncpus)
    py = config.python_stacks_size(stacks)
    sized = {"counts": counts, "stacks": stacks, "python_stacks": py, "offcpu": offcpu}
    out = {f"{name}{i}": n for name, n in sized.items() for i in (0, 1)}
    out["offcpu_starts"] = tasks
    return out


@dataclass(frozen=True)
class MapRow:
    name: str
    map_type: int
    entries: int
    preallocated: bool
    bytes_here: int
    entries_at_n: int
    bytes_at_n: int  # what it holds on the bigger node, at this node's use for maps without preallocation
    full_at_n: int  # ... and filled up


def project(maps: list[BpfMap], here: dict[str, int], there: dict[str, int], cpus: int) -> list[MapRow]:
    possible = possible_cpus()
    rows = []
    for m in maps:
        prealloc = not (m.map_type in HASH_TYPES and m.map_flags & BPF_F_NO_PREALLOC)
        # The sampler's CPU-sized maps are plain or LRU hashes (the syscall tracer's per-CPU counts0/1 share
        # a name with the sampler's counts0/1, and are sized by a constant).
        sized = m.map_type not in PERCPU_TYPES
        entries_n = there.get(m.name, m.max_entries) if sized else m.max_entries
        scale = entries_n / ((here.get(m.name, m.max_entries) if sized else m.max_entries) or 1)
        per_cpu = 0  # bytes of per-CPU values: one 8-byte-aligned value per possible CPU and entry
        if m.map_type in PERCPU_TYPES:
            per_cpu = min(m.memlock, -(-m.value_size // 8) * 8 * possible * max(m.max_entries, 1))
        fixed = m.memlock - per_cpu
        used = int(fixed * scale + per_cpu * scale * cpus / possible)
        full = used
        if not prealloc:  # holds what it stores: project it at what it holds here, and full
            entry = m.key_size + m.value_size + 56  # + the kernel's element header and free-list node
            used, full = m.memlock, entries_n * entry
        rows.append(MapRow(m.name, m.map_type, m.max_entries, prealloc, m.memlock, entries_n, used, full))
    return sorted(rows, key=lambda r: -r.bytes_at_n)


def unwind_worker_rss(agent_pid: int) -> int:
    """VmRSS in bytes of the agent's child processes (the unwind table worker), 0 when none runs."""
    total = 0
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            status = proc_status(int(child))
            if "VmRSS" in status:
                total += int(status["VmRSS"][0]) * 1024
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", type=int, default=64, help="node size to project the BPF maps to")
    ap.add_argument("--frequency", type=int, default=SamplerConfig.frequency_hz)
    ap.add_argument("--interval", type=float, default=SamplerConfig.interval_s)
    ap.add_argument("--json", type=Path, help="write the numbers here too")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (BPF)", file=sys.stderr)
        return 2
    work = Path("/tmp/fleetprof-bench-memory")
    work.mkdir(exist_ok=True)
    ncpus = os.cpu_count() or 1
    children = Children()
    try:
        collector = Collector(children, work)
        collector.start()
        spin = build(SPIN_SOURCE, work)
        agent = FleetprofAgent(children, collector, args.frequency, args.interval, work)
        agent.start()
        run_workload(children, spin, ncpus, args.interval)
        drains = agent.metrics().get("fleetprof_agent_drains_total", 0)
        while agent.metrics().get("fleetprof_agent_drains_total", 0) < drains + 1:
            time.sleep(0.2)
        status = proc_status(agent.pid)
        rss, peak = int(status["VmRSS"][0]) * 1024, int(status["VmHWM"][0]) * 1024
        worker = unwind_worker_rss(agent.pid)
        config = SamplerConfig(frequency_hz=args.frequency, interval_s=args.interval)
        rows = project(list(bpf_maps(agent.pid).values()), entries_at(config, ncpus),
                       entries_at(config, args.cpus), args.cpus)  # fmt: skip
    finally:
        children.close()
    here = sum(r.bytes_here for r in rows)
    there = sum(r.bytes_at_n for r in rows)
    full = sum(r.full_at_n for r in rows)
    # Stack maps by need, at N CPUs: what they hold here, scaled by the CPUs (as if each CPU ran stacks of
    # its own: pessimistic, the same code runs on many CPUs), at most full.
    linear = sum(r.bytes_at_n if r.preallocated else min(r.full_at_n, r.bytes_here * args.cpus // ncpus)
                 for r in rows)  # fmt: skip
    print(f"agent at {args.frequency} Hz, {args.interval:g} s drains, on {ncpus} CPUs")
    print(f"  RSS {rss / MB:.1f} MB, peak (VmHWM) {peak / MB:.1f} MB = steady + {(peak - rss) / MB:.1f} MB;"
          f" table worker {worker / MB:.1f} MB")  # fmt: skip
    print(f"  BPF maps: {here / MB:.1f} MB here; at {args.cpus} CPUs {there / MB:.1f} MB with the stack maps "
          f"holding what they hold here, {linear / MB:.1f} MB with them scaled by CPUs, "
          f"{full / MB:.1f} MB with every map full")  # fmt: skip
    print(f"  RSS + maps at {args.cpus} CPUs: {(rss + there) / MB:.1f} / {(rss + linear) / MB:.1f} / "
          f"{(rss + full) / MB:.1f} MB (target <= 300); the table worker adds {worker / MB:.1f} MB "
          f"while it builds")  # fmt: skip
    print(
        f"\n| map | type | entries here | prealloc | MB here | entries at {args.cpus} | MB at {args.cpus} |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        if r.bytes_at_n >= 0.5 * MB:
            print(f"| {r.name} | {r.map_type} | {r.entries:,} | {'yes' if r.preallocated else 'no'} | "
                  f"{r.bytes_here / MB:.1f} | {r.entries_at_n:,} | {r.bytes_at_n / MB:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"rss": rss, "peak": peak, "worker": worker,
                                         "maps": [asdict(r) for r in rows]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
