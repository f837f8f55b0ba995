"""Runs inside the arm64 guest (bench/arm64_cost.py boots it): the cost per sample of fleetprof's CPU
sampler against bcc's profile (profile-bpfcc) on the same emulated machine, from the kernel's own run-time
accounting of their perf_event programs (kernel.bpf_stats_enabled; tail calls count in the program that
made them). Emulation makes absolute figures meaningless; the ratio is what it is for.

Standard library only (the wheel is installed first). usage: python3 arm64_guest_bench.py OUT, with
config.json beside it: {"rounds", "seconds", "frequency", "agent_args"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = Path("/opt/fleetprof")
PERF_EVENT = "7"  # prog_type of a perf_event program in /proc/PID/fdinfo
AGENT_HTTP = "127.0.0.1:7472"


def perf_event_progs(pid: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over the perf_event programs `pid` holds (each program once)."""
    seen: dict[str, tuple[int, int]] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) != "anon_inode:bpf-prog":
                continue
            text = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
        except OSError:
            continue
        info = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if info.get("prog_type") == PERF_EVENT and "run_time_ns" in info:
            seen[info["prog_id"]] = (int(info["run_time_ns"]), int(info["run_cnt"]))
    return sum(v[0] for v in seen.values()), sum(v[1] for v in seen.values())


def window(proc: subprocess.Popen, seconds: float, log: Path) -> dict:
    """The programs' ns per run over `seconds`, from two readings once they run."""
    deadline = time.monotonic() + 600
    while perf_event_progs(proc.pid)[1] == 0:  # compiling (BCC takes ~20-90 s under emulation)
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.returncode is not None else "ran none in 600 s"
            raise RuntimeError(f"{proc.args[0]} {why}: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(1)
    t0, n0 = perf_event_progs(proc.pid)
    time.sleep(seconds)
    t1, n1 = perf_event_progs(proc.pid)
    runs = n1 - n0
    return {"runs": runs, "ns_per_run": (t1 - t0) / runs if runs else None}


def profile_round(cfg: dict, out: Path, i: int) -> dict:
    # -f: folded output at the end; the run lasts compile + the given seconds, read inside its sampling.
    log = out / f"profile-{i}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            ["profile-bpfcc", "-F", str(cfg["frequency"]), "-f", str(int(cfg["seconds"] * 3))],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        return window(proc, cfg["seconds"], log)
    finally:
        proc.kill()
        proc.wait()


def agent_windows(cfg: dict, out: Path) -> list[dict]:
    log_path = out / "bench-agent.log"
    log = open(log_path, "wb")  # lives with the process
    # No collector: its batches queue (bounded) and are retried; the sampler's work per sample is the same.
    proc = subprocess.Popen(
        [str(VENV / "bin" / "fleetprof"), "agent", "--collector", "127.0.0.1:7470", "--http", AGENT_HTTP,
         "--frequency", str(cfg["frequency"]), "--no-kubernetes", "--no-gpu", *cfg["agent_args"]],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while True:  # serving: its programs are attached and its tables (if any) built for the spinners
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://{AGENT_HTTP}/healthz", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the agent did not serve within 900 s") from None
                time.sleep(1)
        time.sleep(cfg["seconds"])  # let it describe the spinners first
        return [window(proc, cfg["seconds"], log_path) for _ in range(cfg["rounds"])]
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def main() -> int:
    out = Path(sys.argv[1])
    cfg = json.loads((HERE / "config.json").read_text())
    (wheel,) = HERE.glob("fleetprof-*.whl")
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True
    )
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1")
    # Two spinners keep both CPUs in user code with a known stack (main -> fp_driver -> fp_hot_alpha).
    spin = [
        subprocess.Popen([str(HERE / "two_funcs_fp"), "100000", "75"], stdout=subprocess.DEVNULL)
        for _ in range(2)
    ]
    result: dict = {"config": cfg, "profile": [], "agent": []}
    try:
        result["uname"] = " ".join(os.uname())
        # profile's rounds on both sides of the agent's, so a drift of the emulator's speed shows.
        half = (cfg["rounds"] + 1) // 2
        result["profile"] += [profile_round(cfg, out, i) for i in range(half)]
        try:
            result["agent"] = agent_windows(cfg, out)
        except RuntimeError as exc:
            result["agent_error"] = str(exc)
        result["profile"] += [profile_round(cfg, out, i) for i in range(half, cfg["rounds"])]
    except RuntimeError as exc:
        result["error"] = str(exc)
    finally:
        for p in spin:
            p.kill()
        (out / "bench.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
