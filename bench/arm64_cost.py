"""The agent's cost per CPU sample on arm64, as a ratio to bcc's profile in the same emulated guest.

Boots the arm64 guest (scripts/arm64_guest.sh, built once and cached) with fleetprof's wheel and an aarch64
spin workload built with frame pointers, then inside (bench/arm64_guest_bench.py): the kernel's run-time
accounting of each tool's perf_event programs, profile-bpfcc's rounds before and after the agent's windows.
Only the ratio means anything: under TCG every instruction is emulated, so absolute µs are not arm64's.

usage: python bench/arm64_cost.py [--rounds 3] [--seconds 20] [--frequency 99] [--unwind fp|eh_frame]
(eh_frame, the agent's default, needs the arm64 port of the table unwinder; until then use fp.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Its figures in bench/README.md were taken on two CPUs, the guest's default: the same here, unless
# ARM64_GUEST_SMP says otherwise.
SMP = os.environ.get("ARM64_GUEST_SMP", "2")
REPO = Path(__file__).resolve().parent.parent


def build_inputs(dest: Path, cfg: dict) -> None:
    src = dest / ".src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "agent", "collector", "fleetprof"):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(src)], check=True
    )
    shutil.rmtree(src)
    subprocess.run(
        ["aarch64-linux-gnu-gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer",
         "-o", str(dest / "two_funcs_fp"), str(REPO / "tests" / "workloads" / "two_funcs.c")],
        check=True,
    )  # fmt: skip
    shutil.copy2(REPO / "bench" / "arm64_guest_bench.py", dest / "arm64_guest_bench.py")
    (dest / "config.json").write_text(json.dumps(cfg))
    (dest / "run.sh").write_text('exec /opt/fleetprof/bin/python3 arm64_guest_bench.py "$1"\n')


def median_ns(rounds: list[dict]) -> float:
    return statistics.median(r["ns_per_run"] for r in rounds if r.get("ns_per_run"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--frequency", type=int, default=99)
    ap.add_argument("--unwind", choices=["fp", "eh_frame"], default="fp")
    args = ap.parse_args()
    cfg = {
        "rounds": args.rounds, "seconds": args.seconds, "frequency": args.frequency,
        "agent_args": ["--unwind", args.unwind],
    }  # fmt: skip
    subprocess.run(["bash", str(REPO / "scripts" / "arm64_guest.sh"), "build"], check=True)
    with tempfile.TemporaryDirectory(prefix="fleetprof-arm64-bench-") as tmp:
        inputs, out = Path(tmp, "in"), Path(tmp, "out")
        inputs.mkdir()
        build_inputs(inputs, cfg)
        subprocess.run(
            ["bash", str(REPO / "scripts" / "arm64_guest.sh"), "run", str(inputs), str(out), "3000"],
            check=True,
            env={**os.environ, "ARM64_GUEST_SMP": SMP},
        )
        result_path = out / "bench.json"
        if not result_path.exists():
            print((out / "run.log").read_text()[-3000:], file=sys.stderr)
            return 1
        result = json.loads(result_path.read_text())
        boot_s = (out / "boot-seconds").read_text().strip()
    print(
        f"arm64 guest (qemu TCG, {SMP} vCPUs), {args.frequency} Hz, {args.rounds} rounds of "
        f"{args.seconds:g} s, --unwind={args.unwind}; guest ran {boot_s} s"
    )
    if result.get("error"):
        print(f"  failed: {result['error']}")
        return 1
    for name in ("profile", "agent"):
        rows = result[name]
        spread = [round(r["ns_per_run"]) for r in rows if r.get("ns_per_run")]
        print(
            f"  {name:8} ns per sample: median {median_ns(rows):,.0f} {spread}, "
            f"samples {[r['runs'] for r in rows]}"
            if spread
            else f"  {name}: no samples"
        )
    if result.get("agent_error"):
        print(f"  the agent did not run: {result['agent_error']}")
        return 1
    print(f"  agent / profile-bpfcc: {median_ns(result['agent']) / median_ns(result['profile']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
