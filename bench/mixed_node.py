"""Garbage frames on a mixed node: how many samples carry a frame the agent could not stand behind.

Run as root from the repository root:

    .venv/bin/python bench/mixed_node.py [--seconds 300] [--frequency 19] [--interval 10] [--json F]

A collector and an agent (defaults otherwise) on free local ports, and beside them for `--seconds`:
  * py_work.py on CPython 3.12 (pyenv): CPU-bound Python, the steady case;
  * py_importer.py on Debian's CPython 3.11: writes, imports and reloads a module every 0.2 s and runs in
    it, so its code objects are born after the agent described the process;
  * py_async.py on CPython 3.13 (pyenv): asyncio tasks, generators, short-lived threads, clock reads;
  * a shell loop: `ls`, a short-lived `python3 -c` and `sleep`, over and over (processes that live ~0.1 s);
  * the collector and the agent themselves, and whatever else runs on the node (it is a shared VM: other
    people's tests count too, so the whole-node line moves between runs; the per-workload lines do not).

Then the node's CPU profile (and each workload's) is read back from the collector and every sample is
judged by its frames, root first:
  * unmapped: a frame "[unknown] ([unmapped]+0x...)": an address outside every executable mapping;
  * python cycle: a block of 1-16 Python frames with an unnamed one among them, repeated 3 times in a row
    (the same code addresses coming round: a walk through stale frames; named recursion is real);
  * unnamed python: a "[unknown python code]" or "[freed python code]" frame (share of samples of
    processes with Python frames: the target is < 2%);
  * vdso unnamed: "[unknown] ([vdso]+0x...)";
  * (not in the table, printed below: samples of processes gone before their mappings were read, and
    leaves in a mapping the agent never saw: both named so by the agent, no walk's doing);
  * unknown: any "[unknown] (...)" frame (stripped binaries included), by module.
The agent's own counters (unwind walk ends, Python frames it could not name, by reason) are printed too.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path

from common import Children, Collector, FleetprofAgent, http_get

HERE = Path(__file__).parent / "workloads"
PY_FRAME = re.compile(r" \([^()]*\.py:\d+\)$|^\[(unknown|freed) python code\]")
UNNAMED_PY = re.compile(r"^\[(unknown|freed) python code\]")
UNKNOWN = re.compile(r"^\[unknown\] \(([^+]*)\+0x")


def pyenv(version: str) -> str:
    found = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}"))
    return found[-1] if found else sys.executable


def has_python_cycle(python: list[str]) -> bool:
    """A block of 1-16 Python frames, one of them unnamed, three times in a row: the same code addresses
    coming round again (a walk through stale frames). Named blocks that repeat are real recursion (pytest's
    hook calls, a validator descending a schema): every level has a frame of its own."""
    n = len(python)
    for size in range(1, 17):
        for start in range(n - 3 * size + 1):
            a, b, c = (python[start + i * size : start + (i + 1) * size] for i in range(3))
            if a == b == c and any(UNNAMED_PY.match(f) for f in a):
                return True
    return False


def judge(folded: dict[str, int]) -> dict:
    """Counts of samples by what is wrong with their frames (a sample may count under several)."""
    out = Counter()
    unknown_by_module: Counter = Counter()
    examples: dict[str, Counter] = {k: Counter() for k in ("unmapped", "python_cycle", "unnamed_python")}
    for line, n in folded.items():
        frames = line.split(";")
        python = [f for f in frames if PY_FRAME.search(f)]
        out["samples"] += n
        if python:
            out["python_samples"] += n
        bad = {
            "unmapped": any(f.startswith("[unknown] ([unmapped]+") for f in frames),
            "python_cycle": bool(python) and has_python_cycle(python),
            "unnamed_python": any(UNNAMED_PY.match(f) for f in frames),
        }
        for k, v in bad.items():
            if v:
                out[k] += n
                examples[k][line] += n
        if any(f.startswith("[unknown] ([vdso]+") for f in frames):
            out["vdso_unnamed"] += n
        if frames and frames[0] == "[process gone before its mappings were read]":
            out["not_described"] += n
        if any(f.startswith("[unknown] ([unseen mapping]+") for f in frames):
            out["unseen_mapping"] += n
        modules = {m.group(1) for f in frames if (m := UNKNOWN.match(f))}
        if modules:
            out["unknown"] += n
        for m in modules:
            unknown_by_module[m] += n
    result = dict(out)
    result["unknown_by_module"] = dict(unknown_by_module.most_common(8))
    result["examples"] = {k: c.most_common(5) for k, c in examples.items()}
    return result


def folded(collector: Collector, query: str, since_s: float) -> dict[str, int]:
    q = urllib.parse.urlencode({"query": query, "since": f"{int(since_s)}s", "format": "folded"})
    status, body = http_get(f"http://{collector.http}/api/v1/profile?{q}", timeout_s=60)
    if status != 200:
        raise RuntimeError(f"profile query {query} answered {status}: {body[:200]}")
    out: dict[str, int] = {}
    for line in body.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            out[stack] = out.get(stack, 0) + int(count)
    return out


def line(name: str, j: dict) -> str:
    s, py = j.get("samples", 0), j.get("python_samples", 0)

    def pct(k: str, of: int) -> str:
        return f"{j.get(k, 0):>6} ({100 * j.get(k, 0) / of:5.2f}%)" if of else f"{j.get(k, 0):>6}  (  -  )"

    return (
        f"{name:<22} {s:>7} {py:>7} {pct('unmapped', s)} {pct('python_cycle', s)} "
        f"{pct('unnamed_python', py)} {pct('vdso_unnamed', s)} {pct('unknown', s)}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--frequency", type=int, default=19)
    ap.add_argument("--interval", type=float, default=10)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    children = Children()
    workdir = Path(tempfile.mkdtemp(prefix="fleetprof-mixed-"))
    try:
        collector = Collector(children, workdir)
        collector.start()
        agent = FleetprofAgent(children, collector, args.frequency, args.interval, workdir)
        agent.start()
        started = time.monotonic()
        secs = str(args.seconds)
        modules = workdir / "modules"
        modules.mkdir()
        loop = (
            "while :; do ls -la /usr/lib >/dev/null; "
            "/usr/bin/python3 -c 'sum(i * i for i in range(300000))'; sleep 0.1; done"
        )
        workloads = {
            "py_work (3.12)": children.start([pyenv("3.12"), str(HERE / "py_work.py"), secs]),
            "py_importer (3.11)": children.start(
                ["/usr/bin/python3.11", str(HERE / "py_importer.py"), secs, str(modules)]
            ),
            "py_async (3.13)": children.start([pyenv("3.13"), str(HERE / "py_async.py"), secs]),
        }
        shell = children.start(["sh", "-c", loop])
        print(f"mixed node: 3 Python workloads and a shell loop, {args.seconds:g} s", flush=True)
        for p in workloads.values():
            p.wait(timeout=args.seconds + 120)
        children.stop(shell)
        # Two more drains: the last windows of the run reach the collector.
        drains = agent.metrics().get("fleetprof_agent_drains_total", 0)
        deadline = time.monotonic() + 4 * args.interval + 30
        while time.monotonic() < deadline:
            if agent.metrics().get("fleetprof_agent_drains_total", 0) >= drains + 2:
                break
            time.sleep(0.5)
        since = time.monotonic() - started + 30
        node = folded(collector, "{}", since)
        results = {"node": judge(node)}
        results["agent"] = judge(folded(collector, f'{{pid="{agent.pid}"}}', since))
        for name, p in workloads.items():
            results[name] = judge(folded(collector, f'{{pid="{p.pid}"}}', since))
        results["shell loop children"] = judge(folded(collector, '{comm=~"ls|python3|sleep|sh"}', since))
        metrics = agent.metrics()
        agent.stop()
        counters = {
            k: v
            for k, v in metrics.items()
            if k.startswith(
                (
                    "fleetprof_agent_unwind_walks_total",
                    "fleetprof_agent_unwind_walk_ends_total",
                    "fleetprof_agent_unwind_fp_frames_total",
                    "fleetprof_agent_unwind_jit_fp_frames_total",
                    "fleetprof_agent_unwind_fallback_samples_total",
                    "fleetprof_agent_python_",
                )
            )
            or "stack_outcomes" in k
        }
        print()
        print(
            f"{'':<22} {'samples':>7} {'python':>7} {'unmapped':>15} {'python cycle':>15} "
            f"{'unnamed py (of py)':>15} {'vdso unnamed':>15} {'any unknown':>15}"
        )
        for name, j in results.items():
            print(line(name, j))
        print("\nunknown frames by module (node):", results["node"]["unknown_by_module"])
        gone, unseen = (results["node"].get(k, 0) for k in ("not_described", "unseen_mapping"))
        print(f"samples of processes gone before described {gone}, in unseen mappings {unseen}")
        print("\nagent counters:")
        for k, v in sorted(counters.items()):
            print(f"  {k} {v:g}")
        if args.json:
            dump = {"results": results, "counters": counters, "node_folded": node}
            Path(args.json).write_text(json.dumps(dump, indent=1))
    finally:
        children.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
