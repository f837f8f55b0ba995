"""Runs inside the arm64 guest (scripts/arm64_guest.sh): installs fleetprof from its wheel into the guest's
venv, then for each phase starts a collector and an agent beside it, runs the workloads and writes what the
collector answered about them to OUT as JSON. The host judges it (tests/e2e/test_arm64_guest.py).

Standard library only (it runs before the wheel is installed). usage: python3 arm64_guest_driver.py OUT
with config.json beside this file: {"phases": [{"name", "agent_args", "workloads"}], "frequency",
"interval", "seconds", "share", "getppid_calls"} (a phase's "workloads": the names of workloads() it runs).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = Path("/opt/fleetprof")
FLEETPROF = str(VENV / "bin" / "fleetprof")
GRPC, HTTP, AGENT_HTTP = "127.0.0.1:7470", "127.0.0.1:7471", "127.0.0.1:7472"
# Emulated arm64 runs Python and BCC's compiler 10-30x slower than the host: the agent's start (imports,
# two BPF programs compiled) takes minutes, not seconds.
AGENT_START_S = 600
COLLECTOR_START_S = 180
CUDART_LAUNCHES = 500
# The workloads run in a cgroup of their own and the agent profiles that one only (--cgroup), as the host's
# test agents do (tests/support/worker_cgroup.py). Node-wide, most of what the emulated agent sampled was
# itself and the collector: in one loaded run its three drains took 114 s of CPU resolving them (their
# stacks through libLLVM and libclang) and the table worker 61 s building tables for their files.
WORKLOADS_CGROUP = Path("/sys/fs/cgroup/fleetprof-workloads")


def log(*what: object) -> None:
    print(f"[{time.monotonic():8.1f}]", *what, flush=True)


def get(url: str, timeout: float = 10) -> bytes:
    """The body at `url`. A 503 is asked again (5 times, 5 s apart): the agent's HTTP server answers 503 to a
    request its handler did not finish within its budget, and under emulation, with the host loaded, its
    drains held the agent's CPU that long (a fresh-clone run beside two CPU burners)."""
    for attempt in range(6):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == 5:
                raise
        time.sleep(5)
    raise AssertionError("unreachable")


def in_workloads_cgroup() -> None:
    """preexec_fn of every workload: the child joins WORKLOADS_CGROUP before it runs."""
    (WORKLOADS_CGROUP / "cgroup.procs").write_text(str(os.getpid()))


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """A workload, started in WORKLOADS_CGROUP."""
    return subprocess.Popen(argv, preexec_fn=in_workloads_cgroup, **kwargs)


def answers(url: str) -> bool:
    try:
        get(url, timeout=5)
        return True
    except OSError:
        return False


def wait_serving(proc: subprocess.Popen, url: str, limit: float) -> str | None:
    """None once `url` answers; the reason otherwise (the process exited, or the time ran out)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        if answers(url):
            return None
        time.sleep(1)
    return f"did not serve {url} within {limit} s"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def acked_batches() -> int:
    for line in get(f"http://{AGENT_HTTP}/metrics", timeout=60).decode().splitlines():
        if line.startswith("fleetprof_agent_batches_acked_total "):
            return int(float(line.split()[1]))
    return 0


def folded(pid: int, kind: str = "cpu", timeout: float = 10) -> str:
    q = urllib.parse.urlencode(
        {"query": f'{{pid="{pid}"}}', "since": "30m", "format": "folded", "type": kind}
    )
    return get(f"http://{HTTP}/api/v1/profile?{q}", timeout=timeout).decode()


def agent_metrics(names: Sequence[str]) -> dict[str, float]:
    """Each metric's value, summed over its label sets (0 if the agent does not export it), from one read
    of /metrics: each read costs the emulated agent a rendering of all of them."""
    # A minute: on a loaded host the guest's agent took over 10 s to answer (its drains hold the CPU).
    totals = dict.fromkeys(names, 0.0)
    for line in get(f"http://{AGENT_HTTP}/metrics", timeout=60).decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def agent_metric(name: str) -> float:
    return agent_metrics([name])[name]


def hold_until_described(procs: dict[str, subprocess.Popen], phase: dict, interval: float) -> dict:
    """Wait until the agent has described the gated workloads in `procs` (they spin in their gate) and, with
    tables (eh_frame), built the tables of every file they map (meanwhile stopped), then let them go; the
    seconds it took and the gauges last read (short of `needed` if the hang guard ended it). Only the
    workloads run in the agent's cgroup, so the gauges count these alone.

    Until a file's table is built its frames are walked by frame pointer (docs/unwinding.md): under
    emulation beside a loaded host the tables of libc, the workloads and the vDSO took over a minute to
    build, and when the gate let the workloads go on "described" alone, half of two_funcs_nofp's samples
    were walked by frame pointer (354 of 784 whole; the agent's walks ended 3,232 times of 6,091 at a
    file without a table). A warm-up that ran the workloads briefly beforehand, so that their tables would
    be there, did not ensure it: a process that lives 0.3 s can be gone before a slow agent reads it."""
    t0 = time.monotonic()
    n = len(procs)
    need = {"fleetprof_agent_processes": n}
    done = []  # gauges that must read 0
    if "--unwind" not in phase["agent_args"]:  # tables (eh_frame): published for each process, all built
        need["fleetprof_agent_unwind_processes"] = n
        done.append("fleetprof_agent_unwind_files_queued")
    if "python" in procs:
        need["fleetprof_agent_python_processes_total"] = 1  # any outcome: it was looked at
    deadline = time.monotonic() + 600  # a hang guard, not a bar: each loop ends once the gauges say so
    while time.monotonic() < deadline:
        seen = agent_metrics([*need, *done])
        if all(seen[k] >= v for k, v in need.items()):
            break
        time.sleep(interval / 4)
    # Described: their spinning has done its part. Stopped while the tables are built, so that the agent's
    # table worker has the guest's CPUs (four spinning gates on two vCPUs made the wait 125 s in one run).
    for proc in procs.values():
        proc.send_signal(signal.SIGSTOP)
    while time.monotonic() < deadline and any(seen[k] for k in done):
        time.sleep(interval / 4)
        seen = agent_metrics([*need, *done])
    for proc in procs.values():
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return {"s": round(time.monotonic() - t0, 1), "gauges": seen, "needed": need, "zero": done}


def settled(pids: list[int], interval: float) -> dict[int, str]:
    """The folded profile of each pid once the agent's windows up to now are in the collector: two more
    batches acknowledged, then the same answers twice in a row (as tests/conftest.py settled_profile)."""
    first = acked_batches()
    # A hang guard, not a bar (the loop returns once the answers hold): on a host loaded to 35 on 2 cores the
    # guest's drains were slow enough that 30 intervals + 120 s ended before any workload's samples arrived.
    deadline = time.monotonic() + 30 * interval + 600
    while acked_batches() < first + 2 and time.monotonic() < deadline:
        time.sleep(interval / 2)
    last: dict[int, str] = {}
    while time.monotonic() < deadline:
        now = {pid: folded(pid) for pid in pids}
        if now == last and all(now.values()):
            return now
        last = now
        time.sleep(interval)
    return last


# Runs a Python script, then holds the process (its code objects alive) until stdin closes. The agent names
# Python frames by reading code objects from the live process at each drain, and under emulation a drain
# takes 5-20 s (measured): a Python workload that exits when done would be gone before its windows are
# resolved, and its frames unnamed. The driver closes stdin once the collector has the profiles. With GATE
# set it first spins in bursts (in gate_spin, as tests/workloads/gate.h) until a line arrives on stdin.
HOLD = """
import os, runpy, select, signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the script's own (py_story: an early stop)
def gate_spin():
    while True:  # 2 ms of spinning in 20 (gate.h says why)
        until = time.monotonic() + 0.002
        while time.monotonic() < until:
            sum(i * i for i in range(2000))
        if select.select([sys.stdin], [], [], 0.018)[0]:
            break
    sys.stdin.readline()
if os.environ.get("GATE"):
    gate_spin()
script, sys.argv = sys.argv[1], sys.argv[1:]
kept = runpy.run_path(script, run_name="__main__")
sys.stdout.flush()
sys.stdin.read()
"""

# The functions of each judged workload's measured part: what stop_when_sampled counts (the gate's samples
# are not the run's).
MEASURED = {
    "two_funcs_fp": ("fp_hot_alpha", "fp_cold_beta"),
    "two_funcs_nofp": ("fp_hot_alpha", "fp_cold_beta"),
    "python": ("outer (", "decoy ("),
    "vdso_clock": ("clock_burn",),
}


def measured_samples(pid: int, functions: tuple[str, ...]) -> int:
    """Samples of `pid` the collector has in any of `functions` (folded lines: "stack count"); -1 when the
    collector did not answer in time (asked again next round: beside two CPU burners and the rest of the
    suite, the emulated collector took over 10 s to answer one)."""
    try:
        text = folded(pid, timeout=60)
    except (OSError, urllib.error.URLError):  # TimeoutError is an OSError
        return -1
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if any(f in stack for f in functions) and count.isdigit():
            total += int(count)
    return total


def stop_when_sampled(runs: dict[str, subprocess.Popen], cfg: dict, interval: float) -> dict:
    """Size each judged workload's run by the samples the collector has of it: once it has
    cfg["samples"] in the measured functions, the workload gets SIGUSR1 and ends its measured part (gate.h,
    py_story.py); its own CPU time (cfg["seconds"]) is the cap. A run sized by its CPU seconds alone read
    166 and 155 samples of 8 s at 99 Hz in a fresh-clone run beside two CPU burners (the emulated timer
    fires late while qemu waits for the host), under the 200 the splits need. Returns, per workload, the
    samples counted when it was stopped (None: it ended by its cap first) and the seconds it took."""
    t0 = time.monotonic()
    waiting = {w: p for w, p in runs.items() if w in MEASURED}
    out: dict[str, dict] = {}
    deadline = time.monotonic() + 1800  # a hang guard, not a bar: each run ends by its cap before it
    while waiting and time.monotonic() < deadline:
        for w, proc in list(waiting.items()):
            ended = proc.poll() is not None
            if w == "python":  # HOLD: done once its JSON line is there (then it waits for stdin)
                ended = ended or bool(select.select([proc.stdout], [], [], 0)[0])
            if ended:
                out[w] = {"stopped_at": None, "s": round(time.monotonic() - t0, 1)}
                del waiting[w]
                continue
            n = measured_samples(proc.pid, MEASURED[w])
            if n >= cfg["samples"]:
                proc.send_signal(signal.SIGUSR1)
                out[w] = {"stopped_at": n, "s": round(time.monotonic() - t0, 1)}
                del waiting[w]
        # Each look is a profile query per workload, emulated CPU taken from the workloads and the agent:
        # a few seconds apart (the collector has new samples once a drain, 5-20 s under emulation, anyway).
        time.sleep(max(interval, 5.0))
    return out


# The workloads whose checks judge their samples: each is held back (GATE) until the agent has described it
# (and published its tables, and found its interpreter), so that no sample of the measured part is taken
# before. On a host loaded beyond its CPUs the emulated agent read new processes seconds late: 55 of
# two_funcs_fp's ~500 samples were named in one run, the rest taken before it knew the process.
GATED = ("two_funcs_fp", "two_funcs_nofp", "python", "vdso_clock")


def workloads(cfg: dict) -> dict[str, list[str]]:
    """Each workload's command line, running for the config's seconds of its CPU time at most."""
    s, share = str(cfg["seconds"]), str(cfg["share"])
    return {
        "two_funcs_fp": [str(HERE / "two_funcs_fp"), s, share],
        "two_funcs_nofp": [str(HERE / "two_funcs_nofp"), s, share],
        "python": ["/usr/bin/python3", "-c", HOLD, str(HERE / "py_story.py"), s, share],
        "getppid": [str(HERE / "getppid_n"), str(cfg["getppid_calls"]), "1"],
        # clock_gettime of a CPU-time clock: the arm64 vDSO makes the syscall itself (svc in the vDSO)
        "vdso_clock": [str(HERE / "vdso_clock"), "clock", "0", s],
    }


def launches_through_cudart(interval: float) -> tuple[dict, subprocess.Popen]:
    """cudart_real with NVIDIA's aarch64 libcudart: it dlopen()s it and spins (the agent finds it by its
    samples, with the library mapped, and attaches the probes), then, once the agent has a CUDA file
    probed, makes its 500 launches. It then lingers until its stdin closes (the caller closes it once the
    collector has the launches), as HOLD keeps the Python workload: in one run of ten, when it exited
    right after its launches, all 500 reached the collector under "[process gone before its mappings
    were read]". The likely cause, a capture that read its maps as it began to exit (empty) and replaced
    the one taken while it ran, is fixed in read_process and tested on the host
    (tests/agent/test_process_table.py); this test judges the arm64 walk, not that race."""
    t0 = time.monotonic()
    proc = spawn(
        [str(HERE / "cudart_real"), str(HERE / "libcudart.so.13"), str(CUDART_LAUNCHES)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "HOLD": "1", "SPIN": "1", "LINGER": "1"},
    )  # fmt: skip
    first = proc.stdout.readline().strip()
    deadline = time.monotonic() + 300  # a hang guard: the loop ends once a file is probed
    while agent_metric("fleetprof_agent_cuda_probed_files") < 1 and time.monotonic() < deadline:
        time.sleep(interval / 2)
    probed_s = round(time.monotonic() - t0, 1)
    proc.stdin.write("\n")
    proc.stdin.flush()
    stdout = proc.stdout.readline()  # its launches made (the line says how they ended)
    return {"pid": proc.pid, "rc": None, "stdout": stdout.strip(), "first": first,
            "probed_after_s": probed_s}, proc  # fmt: skip


def settled_launches(pid: int, interval: float) -> str:
    """The cuda_launch profile of `pid` once it answers the same twice in a row. Called after settled(),
    which waited for the windows up to then: a hang guard bounds it, short, so that a run whose probes
    never attached (nothing to wait for) costs minutes, not ten."""
    deadline = time.monotonic() + 10 * interval + 60
    last = ""
    while time.monotonic() < deadline:
        now = folded(pid, "cuda_launch")
        if now and now == last:
            return now
        last = now
        time.sleep(interval)
    return last


def start_collector(out: Path) -> subprocess.Popen:
    """The collector every phase's agent streams to (one: its start is ~7 s of emulated CPU)."""
    col_log = open(out / "collector.log", "wb")  # lives with the process
    return subprocess.Popen(
        [FLEETPROF, "collector", "--grpc", GRPC, "--http", HTTP], stdout=col_log, stderr=subprocess.STDOUT
    )


def start_agent(phase: dict, cfg: dict, out: Path) -> subprocess.Popen:
    agent_log = open(out / f"{phase['name']}-agent.log", "wb")  # lives with the process
    return subprocess.Popen(
        [FLEETPROF, "agent", "--collector", GRPC, "--http", AGENT_HTTP, "--node", "arm64-guest",
         "--frequency", str(cfg["frequency"]), "--interval", str(cfg["interval"]),
         "--no-kubernetes", "--no-gpu", "--cgroup", str(WORKLOADS_CGROUP), *phase["agent_args"]],
        stdout=agent_log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def run_phase(phase: dict, cfg: dict, out: Path, started: tuple[subprocess.Popen, float] | None) -> dict:
    """One phase, with its agent as started (and when) if `started`, else started here."""
    name = phase["name"]
    result: dict = {"name": name, "agent_args": phase["agent_args"]}
    agent, t0 = started or (None, time.monotonic())
    try:
        agent = agent or start_agent(phase, cfg, out)
        why = wait_serving(agent, f"http://{AGENT_HTTP}/healthz", AGENT_START_S)
        result["agent_start_s"] = round(time.monotonic() - t0, 1)
        result["agent_started"] = why is None
        if why:
            result["error"] = f"the agent {why}"
            return result
        log(name, "agent up after", result["agent_start_s"], "s")
        argvs = {w: argv for w, argv in workloads(cfg).items() if w in phase["workloads"]}
        gate_env = {**os.environ, "GATE": "1"}
        runs = {
            w: spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=gate_env)
            for w, argv in argvs.items()
            if w in GATED
        }
        result["described"] = hold_until_described(runs, phase, cfg["interval"])
        log(name, "workloads described:", result["described"])
        for w, argv in argvs.items():  # the rest after: the gauges counted the gated ones alone
            if w not in GATED:
                runs[w] = spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        result["sampled"] = stop_when_sampled(runs, cfg, cfg["interval"])
        log(name, "workloads sampled:", result["sampled"])
        held = []
        for wname, proc in runs.items():
            if wname == "python":  # its JSON line, then it waits (HOLD)
                stdout = proc.stdout.readline()
                held.append(proc)
            else:
                stdout, _ = proc.communicate(timeout=1800)
            result.setdefault("workloads", {})[wname] = {
                "pid": proc.pid, "rc": proc.returncode, "stdout": stdout.strip(),
            }  # fmt: skip
        if "cudart" in phase["workloads"]:
            result["workloads"]["cudart"], cudart_proc = launches_through_cudart(cfg["interval"])
            held.append(cudart_proc)
        log(name, "workloads done")
        pids = [w["pid"] for w in result["workloads"].values()]
        profiles = settled(pids, cfg["interval"])
        for w in result["workloads"].values():
            w["folded"] = profiles.get(w["pid"], "")
        cudart = result["workloads"].get("cudart")
        if cudart is not None:
            cudart["launches"] = settled_launches(cudart["pid"], cfg["interval"])
        by_pid = {w["pid"]: w for w in result["workloads"].values()}
        for proc in held:  # the Python workload and cudart: they exit once stdin closes
            proc.stdin.close()
            proc.wait(timeout=60)
            by_pid[proc.pid]["rc"] = proc.returncode
        getppid = result["workloads"].get("getppid")
        if getppid is not None:
            q = urllib.parse.urlencode(
                {"query": f'{{pid="{getppid["pid"]}"}}', "since": "30m", "by": "syscall"}
            )
            getppid["syscalls"] = json.loads(get(f"http://{HTTP}/api/v1/syscalls?{q}"))
        result["agent_metrics"] = get(f"http://{AGENT_HTTP}/metrics").decode()
        result["phase_s"] = round(time.monotonic() - t0, 1)
        return result
    finally:
        if agent is not None:
            stop(agent)


def dump_vdso(dest: Path) -> None:
    """This process's vDSO image (the kernel's, the same in every process) for the host to read."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            with open("/proc/self/mem", "rb") as mem:
                mem.seek(start)
                dest.write_bytes(mem.read(end - start))


def main() -> int:
    out = Path(sys.argv[1])
    dump_vdso(out / "vdso.so")
    cfg = json.loads((HERE / "config.json").read_text())
    WORKLOADS_CGROUP.mkdir(exist_ok=True)
    summary: dict = {"uname": os.uname().release + " " + os.uname().machine}
    (wheel,) = HERE.glob("fleetprof-*.whl")
    t0 = time.monotonic()
    pip = subprocess.run(
        # --no-compile: the modules the phases import are compiled once, as they are first imported (root
        # writes their .pyc); compiling every module of the wheel took ~16 s of emulated CPU.
        [str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
         "--no-compile", str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    summary["install_s"] = round(time.monotonic() - t0, 1)
    summary["install_rc"] = pip.returncode
    summary["install_output"] = (pip.stdout + pip.stderr)[-3000:]
    log("installed", wheel.name, "rc", pip.returncode, "in", summary["install_s"], "s")
    if pip.returncode == 0:
        t0 = time.monotonic()
        col = start_collector(out)
        # The first agent starts beside it: its start (BCC's compile, a minute or more of emulated CPU on
        # one vCPU) overlaps the collector's on the other; it reconnects until the collector serves.
        first = (start_agent(cfg["phases"][0], cfg, out), time.monotonic())
        why = wait_serving(col, f"http://{HTTP}/healthz", COLLECTOR_START_S)
        summary["collector_start_s"] = round(time.monotonic() - t0, 1)
        try:
            if why:
                summary["collector_error"] = f"the collector {why}"
                stop(first[0])
            else:
                log("collector up")
                for i, phase in enumerate(cfg["phases"]):
                    result = run_phase(phase, cfg, out, first if i == 0 else None)
                    (out / f"{phase['name']}.json").write_text(json.dumps(result))
                    log(phase["name"], "done:", result.get("error", "ok"))
        finally:
            stop(col)
    (out / "summary.json").write_text(json.dumps(summary))
    # The kernel's log: what the verifier or perf said (e.g. "perf: interrupt took too long").
    (out / "dmesg.txt").write_bytes(subprocess.run(["dmesg"], capture_output=True).stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
