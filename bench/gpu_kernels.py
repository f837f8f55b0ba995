"""Kernel time and exact GPU gaps from our CUPTI library on a real GPU, against the job's own log and
torch.profiler (the check the "Real GPU II" session runs; bench/README.md has what it printed).

    .venv/bin/python bench/gpu_kernels.py [--backend torch|standin] [--steps 40] [--library PATH]
                                          [--cost-seconds 5 [--cost-rounds 3]] [--json OUT]

1. The job (bench/workloads/gpu_job.py: a 5-50 ms CPU-busy loader alternating with training steps) runs
   with CUDA_INJECTION64_PATH=<our library> and FLEETPROF_CUPTI_SAMPLE_EVERY=1; this script reads its ring
   through /proc/PID/mem while it runs (agent/gpu/cupti_ring.py) and interprets it (agent/gpu/activity.py):
   per-kernel counts and GPU time, and each logged loader phase against the GPU gap found around it.
2. The same deterministic steps run again, without our library, under torch.profiler (one CUPTI client per
   process: the two cannot share a run), and its per-kernel counts and CUDA time are set beside ours.
3. With --cost-seconds S: a launch-bound loop (x.add_ on 16 floats) for S seconds without the library,
   with it at the default sampling and at 1/1, --cost-rounds interleaved rounds; medians of launches per
   second and µs per launch.

Exit status: 0 done, 1 something failed (the library did not record, the job died), 2 no GPU or no torch
(one sentence says which). --backend standin runs steps 1 and 3 on the CUDA stand-ins (tests only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fleetprof.agent.gpu.activity import Gap, ProcessActivity
from fleetprof.agent.gpu.cupti_ring import CopyRecord, RingError, RingReader

REPO = Path(__file__).resolve().parent.parent

JOB = REPO / "bench" / "workloads" / "gpu_job.py"
DEFAULT_LIBRARY = REPO / ".venv" / "lib" / "fleetprof" / "libfleetprof_cupti.so"


class Unavailable(Exception):
    """No GPU or no torch here: exit 2 with this sentence."""


def torch_gpu() -> str:
    """The GPU's name, or Unavailable."""
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"torch is not installed here ({e}); this check needs PyTorch with CUDA") from e
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA GPU here; this check needs one")
    return torch.cuda.get_device_name(0)


def job_env(library: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETPROF_CUPTI", "CUDA_INJECTION"))}
    if library is not None:
        env["CUDA_INJECTION64_PATH"] = str(library)
    env.update(extra)
    return env


def read_while_running(proc: subprocess.Popen, timeout_s: float) -> tuple[ProcessActivity, list, dict]:
    """Poll the job's ring until it says "holding", then once more after a flush; release it."""
    activity = ProcessActivity()
    kernels, launches = [], []
    reader = None
    deadline = time.monotonic() + timeout_s
    holding = threading.Event()
    holding_at: list[int] = []

    def watch() -> None:  # the job says "holding" once its last step is done
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "holding":
                holding_at.append(time.monotonic_ns())
                holding.set()

    threading.Thread(target=watch, daemon=True).start()
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the job did not finish in {timeout_s:.0f} s")
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before its ring was read to the end")
        if reader is None:
            try:
                reader = RingReader.open(proc.pid)
            except RingError as e:
                if e.reason not in ("no_ring", "bad_header"):
                    raise
        if reader is not None:
            try:
                batch = reader.poll()
            except RingError as e:
                if e.reason != "bad_header":  # not initialised yet
                    raise
                batch = None
            if batch is not None:
                activity.add(batch)
                kernels.extend(batch.kernels())
                kernels.extend(batch.copies())
                launches.extend(batch.launch_records())
                if holding.is_set() and batch.header.flushed_ns > holding_at[0]:
                    header = batch.header
                    break
        time.sleep(0.05)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.wait(timeout=60)
    return activity, kernels, {"header": header, "lost": reader.stats.lost, "torn": reader.stats.torn}


def run_job(args, library: Path, env_extra: dict[str, str]) -> tuple[ProcessActivity, list, dict, list]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [sys.executable, str(JOB), "--backend", args.backend, "--steps", str(args.steps),
               "--log", str(log), "--hold"]  # fmt: skip
        env = job_env(library, FLEETPROF_CUPTI_SAMPLE_EVERY="1", **env_extra)
        with subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
            try:
                activity, kernels, info = read_while_running(proc, timeout_s=120 + args.steps)
            finally:
                if proc.poll() is None:
                    proc.kill()
        phases = [json.loads(line) for line in log.read_text().splitlines()]
    return activity, kernels, info, phases


def profiled_run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log, prof = Path(tmp) / "log.jsonl", Path(tmp) / "prof.json"
        cmd = [sys.executable, str(JOB), "--backend", "torch", "--steps", str(args.steps), "--log", str(log),
               "--profile", str(prof)]  # fmt: skip
        subprocess.run(cmd, env=job_env(None), check=True, timeout=300)
        return json.loads(prof.read_text())


def loop_rate(args, library: Path | None, every: str | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "loop.json"
        extra = {"FLEETPROF_CUPTI_SAMPLE_EVERY": every} if every else {}
        cmd = [sys.executable, str(JOB), "--backend", args.backend, "--loop", str(args.cost_seconds),
               "--log", str(log)]  # fmt: skip
        subprocess.run(cmd, env=job_env(library, **extra), check=True, timeout=120 + args.cost_seconds)
        return json.loads(log.read_text())["per_s"]


def demangler():
    try:
        from fleetprof.collector.render.cxa_demangle import load

        demangle = load()
    except (OSError, AttributeError):
        return lambda name: name

    def show(name: str) -> str:
        text = demangle(name.encode()) if name.startswith("_Z") else None
        return text.decode() if text else name

    return show


def gap_report(activity: ProcessActivity, phases: list[dict]) -> dict:
    loads = [p for p in phases if p["phase"] == "load"]
    trains = [p for p in phases if p["phase"] == "train"]
    t0, t1 = loads[0]["start"], trains[-1]["end"]
    gaps = activity.gaps(t0, t1)
    rows, found = [], 0
    for load in loads[1:]:  # the first load follows the warm-up step, whose end the log does not hold
        gap = next((g for g in gaps if g.start_ns <= load["start"] and g.end_ns >= load["end"]), None)
        length = load["end"] - load["start"]
        rows.append({"load_ms": length / 1e6, "gap_ms": gap.length_ns / 1e6 if gap else None,
                     "excess_us": (gap.length_ns - length) / 1e3 if gap else None})  # fmt: skip
        found += gap is not None

    def explained(g: Gap) -> bool:
        return any(g.start_ns <= p["start"] and g.end_ns >= p["end"] for p in loads)

    unexplained = [g for g in gaps if g.length_ns >= 1_000_000 and not explained(g)]
    stats = activity.gap_stats(t0, t1)
    return {
        "loads": len(rows),
        "found": found,
        "rows": rows,
        "gaps_in_window": stats.count,
        "idle_ms": stats.idle_ns / 1e6,
        "histogram": stats.histogram,
        "unexplained_gaps_over_1ms": [(g.start_ns, g.length_ns) for g in unexplained],
    }


# CUpti_ActivityMemcpyKind
COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
              9: "HtoH", 10: "PtoP"}  # fmt: skip


def row_name(record, show) -> str:
    """Kernels by their demangled names; copies as torch.profiler names them, without the memory kinds."""
    if isinstance(record, CopyRecord):
        return "Memset" if record.kind == "memset" else f"Memcpy {COPY_KINDS.get(record.copy_kind, '?')}"
    return show(record.name or f"[{record.name_hash:08x}]")


def kernel_table(records: list, phases: list[dict], show) -> dict[str, list[int]]:
    loads = [p for p in phases if p["phase"] == "load"]
    t0, t1 = loads[0]["start"], phases[-1]["end"]
    table: dict[str, list[int]] = {}
    for r in records:
        if t0 <= r.start_ns < t1:
            entry = table.setdefault(row_name(r, show), [0, 0])
            entry[0] += 1
            entry[1] += r.end_ns - r.start_ns
    return table


def print_kernels(ours: dict, theirs: dict | None) -> None:
    names = sorted(set(ours) | set(theirs or {}), key=lambda n: -(ours.get(n, [0, 0])[1]))
    head = f"\n{'kernel':70} {'ours n':>7} {'ours ms':>9}"
    print(head + (f" {'prof n':>7} {'prof ms':>9}" if theirs else ""))
    for name in names:
        o = ours.get(name, [0, 0])
        line = f"{name[:70]:70} {o[0]:7d} {o[1] / 1e6:9.3f}"
        if theirs is not None:
            t = theirs.get(name, [0, 0])
            line += f" {t[0]:7d} {t[1] / 1e6:9.3f}"
        print(line)
    total = [sum(v[0] for v in ours.values()), sum(v[1] for v in ours.values())]
    line = f"{'total':70} {total[0]:7d} {total[1] / 1e6:9.3f}"
    if theirs is not None:
        line += f" {sum(v[0] for v in theirs.values()):7d} {sum(v[1] for v in theirs.values()) / 1e6:9.3f}"
    print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("torch", "standin"), default="torch")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--library", type=Path, default=DEFAULT_LIBRARY)
    ap.add_argument("--cost-seconds", type=float, default=0.0)
    ap.add_argument("--cost-rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result: dict = {"backend": args.backend}
    try:
        if args.backend == "torch":
            result["gpu"] = torch_gpu()
            print(f"GPU: {result['gpu']}")
    except Unavailable as e:
        print(f"gpu_kernels: {e}", file=sys.stderr)
        return 2
    if not args.library.exists():
        print(f"gpu_kernels: no library at {args.library} (scripts/build_cupti.sh)", file=sys.stderr)
        return 1

    activity, kernels, info, phases = run_job(args, args.library, {})
    header = info["header"]
    result["ring"] = {"state": header.state, "message": header.state_message, "cupti": header.cupti_version,
                      "cupti_path": header.cupti_path, "counters": header.counters, "lost": info["lost"],
                      "torn": info["torn"]}  # fmt: skip
    print(f"library: {header.state} ({header.state_message})")
    print(f"CUPTI {header.cupti_version} at {header.cupti_path}")
    print(f"counters: {header.counters}; reader lost {info['lost']}, torn {info['torn']}")
    if header.state not in ("running", "stopped"):
        print("gpu_kernels: the library did not record", file=sys.stderr)
        return 1
    show = demangler()
    ours = kernel_table(kernels, phases, show)
    theirs = None
    if args.backend == "torch":
        prof = profiled_run(args)
        theirs = {}
        for name, (n, ns) in prof["kernels"].items():
            # "Memcpy HtoD (Pageable -> Device)" -> "Memcpy HtoD": our records carry the direction only.
            plain = name.split(" (")[0] if name.startswith(("Memcpy", "Memset")) else show(name)
            entry = theirs.setdefault(plain, [0, 0])
            entry[0] += n
            entry[1] += ns
    result["kernels"] = {"ours": ours, "torch_profiler": theirs}
    print_kernels(ours, theirs)

    gaps = gap_report(activity, phases)
    result["gaps"] = gaps
    print(f"\nloader phases: {gaps['loads']}, each inside one GPU gap: {gaps['found']}")
    excess = [r["excess_us"] for r in gaps["rows"] if r["excess_us"] is not None]
    if excess:
        print(f"gap minus loader phase: median {statistics.median(excess):.1f} us, max {max(excess):.1f} us")
    print(f"gaps in the window: {gaps['gaps_in_window']} ({gaps['idle_ms']:.1f} ms idle); by length "
          f"<10us,<100us,<1ms,<10ms,<100ms,<1s,more: {gaps['histogram']}")  # fmt: skip
    print(f"gaps >= 1 ms the log does not explain: {len(gaps['unexplained_gaps_over_1ms'])}")

    if args.cost_seconds:
        # Interleaved rounds (order rotated each round), medians: single runs vary by ±15% on a GPU VM.
        configs = {"plain": (None, None), "default": (args.library, None), "every_1": (args.library, "1")}
        runs: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for r in range(args.cost_rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(loop_rate(args, *configs[name]))
        rates = {name: statistics.median(v) for name, v in runs.items()}
        result["cost"] = {"median": rates, "runs": runs}
        each = f"{args.cost_rounds} x {args.cost_seconds:g} s"
        print(f"\nlaunch-bound loop ({each}): launches/s, added us per launch")
        for label, rate in rates.items():
            added = 1e6 / rate - 1e6 / rates["plain"]
            spread = (max(runs[label]) - min(runs[label])) / rate * 100
            print(f"  {label:8} {rate:12,.0f}/s  {added:+.3f} us  (spread {spread:.0f}%)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
