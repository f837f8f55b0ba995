"""The agent beside a real PyTorch job: its cost per sample, its memory with PyTorch's big libraries, and
whether its stacks agree with `perf record --call-graph dwarf` on the same run.

Run as root from the repository root:

    .venv/bin/python bench/pytorch_node.py [--torch-spec SPEC] [--frequencies 19,608] [--seconds 40]

PyTorch goes into a venv of its own under --cache (default /var/cache/fleetprof-bench/torch-venv), never
into the project's: `pip install SPEC` (default "torch": PyPI's default wheel, which pulls several GB of
nvidia-* CUDA wheels; `--torch-spec 'torch==2.13.0+cpu'` takes a CPU-only wheel where pip's find-links
offers one). An existing venv that imports torch is used as it is.

The workload (WORKLOAD below, run by that venv's python): a small CNN trained on synthetic 32x32 images
read through a DataLoader with 2 worker processes (each item normalised in the worker: CPU work there), and
in the same process an inference server thread answering a client thread's requests (batches of 8, no
grad) on a copy of the model. Nobody here wrote PyTorch: its libraries (libtorch_cpu.so alone has one of
the largest .eh_frame sections a node sees), its threads and its Python are what the agent meets on a node.

Per frequency (19 Hz, the default, and the 64-CPU node's rate on this node: 19 x 64 / CPUs): a collector
and a fresh agent start; the workload runs; after one drain interval (the agent describes the processes)
and once the agent's start-up work is done (unwind tables and symbol preloads queued: none; its unwind rows,
tabled files and symbol files unchanged for a drain interval; at most --settle-max seconds), a window of
--seconds is measured; then `perf record -F 99 -a --call-graph dwarf` records the next --seconds (the agent
profiles perf too: not in its window). Reported:
  * start-up: when the agent settled, and its CPU seconds until then (the steady state's figures below
    exclude it);
  * agent CPU as % of one core (all its threads, /proc/PID/task/*/schedstat) and µs per sample, split:
    BPF (the kernel's run-time accounting of the agent's programs: its sampler alone, and all of them),
    drain + resolve + encode (the agent's fleetprof_agent_drain_cpu_seconds_total), and the rest of its
    threads (shipping over gRPC, gRPC's own threads, process events, symbol loading), with gRPC core's
    named threads apart;
  * RSS, peak RSS (VmHWM: BCC's compile included), the table worker's RSS, unwind rows and files, and the
    kernel memory of the agent's BPF maps (fdinfo memlock);
  * of the workload's samples (its processes, from the collector), the share whose stack is whole (the root
    frame is a process or thread entry: _start, __libc_start_main, start_thread, clone...; or, where the
    agent merged the CPython frames in, the outermost Python frame of a script or thread: `<module>`,
    `Thread._bootstrap`, which take the interpreter's native frames' place), and the share with Python
    frames; where the rest begin;
  * the top functions by self samples from fleetprof and from perf on the workload's processes, side by
    side, and how many of perf's top 10 are in fleetprof's top 10.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent_memory import unwind_worker_rss
from common import (
    BenchError,
    BpfRunTimeStats,
    Children,
    Collector,
    FleetprofAgent,
    bpf_maps,
    http_get,
    proc_cpu_s,
    proc_status,
    read_usage,
)

from fleetprof.collector.render.tree import parse_folded

WORKLOAD = r"""
import os, queue, sys, threading, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Images(Dataset):
    def __len__(self):
        return 1 << 30
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 32, 32, generator=g)
        return (x - x.mean()) / (x.std() + 1e-6), i % 10

def net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))

def serve(model, requests, stop, served):
    with torch.no_grad():
        while not stop.is_set():
            try:
                x = requests.get(timeout=0.1)
            except queue.Empty:
                continue
            model(x).argmax(1)
            served[0] += 1

def client(requests, stop):
    while not stop.is_set():
        requests.put(torch.randn(8, 3, 32, 32))
        time.sleep(0.02)

def main():
    seconds = float(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, server_model = net(), net().eval()
    requests, stop, served = queue.Queue(maxsize=64), threading.Event(), [0]
    threads = [threading.Thread(target=serve, args=(server_model, requests, stop, served), name="infer"),
               threading.Thread(target=client, args=(requests, stop), name="client")]
    for t in threads:
        t.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    steps, deadline, stop_file, ready_file = 0, time.monotonic() + seconds, sys.argv[2], sys.argv[3]
    for x, y in DataLoader(Images(), batch_size=32, num_workers=2):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        steps += 1
        if steps == 1:
            open(ready_file, "w").close()
        if time.monotonic() > deadline or (steps % 16 == 0 and os.path.exists(stop_file)):
            break
    stop.set()
    for t in threads:
        t.join()
    print(steps, served[0], flush=True)

if __name__ == "__main__":
    main()
"""

ENTRY_FUNCTIONS = {"_start", "__libc_start_main", "__libc_start_call_main", "start_thread", "clone", "clone3",
                   "__clone", "__clone3"}  # fmt: skip
PYTHON_ROOTS = ("<module> (", "Thread._bootstrap (")  # a script's and a thread's outermost Python frame


def is_root(name: str) -> bool:
    """A stack that begins here is whole (module doc)."""
    if name in ENTRY_FUNCTIONS:
        return True
    return name.startswith(PYTHON_ROOTS) and PYTHON_FRAME.search(name) is not None


PYTHON_FRAME = re.compile(
    r"\(\S+\.py:\d+\)$"
)  # agent/python/codes.py names a Python frame "qualname (file.py:N)"
GRPC_THREADS = ("event_engine", "grpc_global_tim", "lifeguard", "default-executo", "resolver-execut")
MB = 1e6


def ensure_torch(cache: Path, spec: str) -> Path:
    """The bench venv's python, with torch installed (once)."""
    venv = cache / "torch-venv"
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    ):
        return python
    cache.mkdir(parents=True, exist_ok=True)
    print(f"installing {spec} into {venv} (once)", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", spec], check=True)
    return python


@dataclass
class Result:
    frequency: int
    window_s: float
    samples: int
    agent_pct: float
    bpf_sampler_us: float  # the perf_event programs, per sample
    bpf_all_us: float  # every program of the agent (sched_switch, syscalls, ...), per sample
    drain_us: float
    rest_us: float
    grpc_core_us: float
    all_in_us: float
    rss_mb: float
    peak_mb: float
    worker_mb: float
    unwind_rows: int
    unwind_files: int
    maps_mb: float
    workload_samples: int
    whole_native_pct: float
    python_pct: float
    top_fleetprof: list = field(default_factory=list)
    top_perf: list = field(default_factory=list)
    overlap: int = 0
    workload_out: str = ""
    stacks_lost: int = 0  # samples whose native stack the stack maps could not take (full, or no memory)
    python_stacks_lost: int = 0  # ... whose CPython stack the CPython stack maps could not take
    cut_roots: list = field(default_factory=list)  # (root frame, % of job samples) of the stacks not whole
    files_no_room: int = 0  # files left without a table: unwind_rows full
    drain_stages_us: dict = field(default_factory=dict)  # drain_us by stage (agent/main.py, drain_once)
    settled_s: float = 0.0  # from the agent's start until its start-up work was done (settle)
    startup_cpu_s: float = 0.0  # the agent's CPU seconds until then


STAGES = ("read", "resolve", "processes", "encode", "trim")  # fleetprof_agent_drain_stage_cpu_seconds


def thread_cpu_by_name(pid: int) -> dict[str, int]:
    out: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            out[comm] += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def fleetprof_stacks(collector: Collector, pids: list[int], since_s: float) -> dict:
    stacks: Counter = Counter()
    for pid in pids:
        q = urllib.parse.urlencode(
            {"query": f'{{pid="{pid}"}}', "since": f"{int(since_s)}s", "format": "folded"}
        )
        status, text = http_get(f"http://{collector.http}/api/v1/profile?{q}", timeout_s=120)
        if status != 200:
            raise BenchError(f"the collector answered {status} for pid {pid}: {text[:300]}")
        for stack, n in parse_folded(text).items():
            stacks[stack] += n
    return stacks


def perf_top(data: Path, pids: list[int], n: int = 10) -> list[tuple[str, float]]:
    done = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "sym", "-g", "none",
         "--pid", ",".join(map(str, pids)), "--percentage", "relative", "--percent-limit", "0.3"],
        capture_output=True, text=True,
    )  # fmt: skip
    top = []
    for line in done.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.+?)\s*$", line)
        if m:
            top.append((m.group(2), float(m.group(1))))
    return top[:n]


# The agent's gauges of start-up work: files whose unwind tables are being built or wait to be, processes
# whose symbol tables the preloader has yet to read; and what that work leaves behind, which stops growing
# once it is done. Large files are queued only once a walk meets them (agent/unwind/unwinder.py), and a
# file's symbols may be read by the drain itself, so the queues alone read 0 before the work has begun.
SETTLING = ("fleetprof_agent_unwind_files_queued", "fleetprof_agent_symbol_preloads_pending")
GROWING = (
    "fleetprof_agent_unwind_rows",
    "fleetprof_agent_unwind_files_tabled",
    "fleetprof_agent_symbol_files",
)


def settle(agent: FleetprofAgent, since: float, quiet_s: float, most_s: float) -> tuple[float, float]:
    """Wait until the agent has no start-up work left: SETTLING all 0 and GROWING unchanged for `quiet_s`
    (a drain interval), at most `most_s` from `since`. Returns the seconds from `since` to the last change
    seen, and the agent's CPU seconds since it started, read then."""
    last, changed, cpu = None, time.monotonic(), proc_cpu_s(agent.pid)
    while time.monotonic() - since < most_s:
        m = agent.metrics()
        now = tuple(m.get(g, 0) for g in GROWING)
        if now != last or any(m.get(g, 0) for g in SETTLING):
            last, changed, cpu = now, time.monotonic(), proc_cpu_s(agent.pid)
        elif time.monotonic() - changed >= quiet_s:
            return changed - since, cpu
        time.sleep(1)
    print(f"  (start-up work left after {most_s:.0f} s: measured anyway)", file=sys.stderr)
    return time.monotonic() - since, proc_cpu_s(agent.pid)


def one_run(
    python: Path, workload: Path, frequency: int, seconds: float, work: Path, settle_max_s: float
) -> Result:
    children = Children()
    interval = 10.0
    stop_file, ready_file = work / "stop-job", work / "job-ready"
    stop_file.unlink(missing_ok=True)
    ready_file.unlink(missing_ok=True)
    try:
        collector = Collector(children, work)
        collector.start()
        agent = FleetprofAgent(children, collector, frequency, interval, work)
        agent.start()
        started = time.monotonic()
        job = children.start(
            [str(python), str(workload), str(2 * seconds + settle_max_s + interval + 15), str(stop_file),
             str(ready_file)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(interval + 5)  # the agent describes the job and drains once
        # Then the job's first step (torch imported, the DataLoader's workers started), and the agent's
        # start-up work: the unwind tables of the job's libraries (libtorch_cpu.so's 2.5 M rows) and their
        # symbol tables. On a slow VM that outlasted the first drain, and the window charged it to the
        # steady state (bench/README.md).
        while not ready_file.exists() and time.monotonic() - started < settle_max_s:
            if job.poll() is not None:
                raise BenchError(f"the PyTorch job exited with {job.returncode} before its first step")
            time.sleep(0.5)
        settled_s, startup_cpu_s = settle(agent, started, interval, settle_max_s)
        pids = descendants(job.pid)
        m0, u0, t0, c0 = (
            agent.metrics(),
            read_usage(agent.pid),
            time.monotonic(),
            thread_cpu_by_name(agent.pid),
        )
        time.sleep(seconds)
        m1, u1, t1, c1 = (
            agent.metrics(),
            read_usage(agent.pid),
            time.monotonic(),
            thread_cpu_by_name(agent.pid),
        )
        # perf's window follows the agent's: the agent profiles every process on the node, perf too (its
        # libraries' symbols read, its stacks named), which is no cost of profiling the job.
        perf_data = work / f"perf-{frequency}.data"
        subprocess.run(["perf", "record", "-q", "-F", "99", "-a", "--call-graph", "dwarf", "-o",
                        str(perf_data), "--", "sleep", str(seconds)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        pids = sorted(set(pids) | set(descendants(job.pid)))
        stop_file.touch()
        out, _ = job.communicate(timeout=120)
        # the last window reaches the collector with the next drain
        drains = m1.get("fleetprof_agent_drains_total", 0)
        while agent.metrics().get("fleetprof_agent_drains_total", 0) < drains + 1:
            time.sleep(0.2)
        time.sleep(1)
        stacks = fleetprof_stacks(collector, pids, seconds + 2 * interval + 30)  # perf's window, and before
        gauges = agent.metrics()
        maps = bpf_maps(agent.pid)
        status = proc_status(agent.pid)
        worker = unwind_worker_rss(agent.pid)
    finally:
        children.close()
    wall = t1 - t0
    samples = int(m1["fleetprof_agent_samples_total"] - m0["fleetprof_agent_samples_total"]) or 1
    agent_ns = sum(u1.thread_ns.values()) - sum(u0.thread_ns.get(t, 0) for t in u1.thread_ns)
    drain_ns = (
        m1["fleetprof_agent_drain_cpu_seconds_total"] - m0["fleetprof_agent_drain_cpu_seconds_total"]
    ) * 1e9
    grpc_ns = sum(c1.get(n, 0) - c0.get(n, 0) for n in GRPC_THREADS)
    bpf_all = u1.bpf_ns - u0.bpf_ns
    total = sum(stacks.values()) or 1
    whole = sum(n for st, n in stacks.items() if st and is_root(st[0][0]))
    roots: Counter = Counter()  # where the stacks that are not whole begin
    for st, n in stacks.items():
        if st and not is_root(st[0][0]):
            roots[st[0][0]] += n
    py = sum(n for st, n in stacks.items() if any(PYTHON_FRAME.search(f[0]) for f in st))
    leaves: Counter = Counter()
    for st, n in stacks.items():
        if st:
            leaves[st[-1][0]] += n
    top_fp = [(name, 100 * n / total) for name, n in leaves.most_common(10)]
    top_perf = perf_top(perf_data, pids)
    ours = {name for name, _ in top_fp}
    return Result(
        frequency, wall, samples, 100 * agent_ns / 1e9 / wall,
        (u1.sampler_ns - u0.sampler_ns) / 1e3 / max(1, u1.sampler_runs - u0.sampler_runs),
        bpf_all / 1e3 / samples, drain_ns / 1e3 / samples, (agent_ns - drain_ns) / 1e3 / samples,
        grpc_ns / 1e3 / samples, (bpf_all + agent_ns) / 1e3 / samples,
        int(status["VmRSS"][0]) * 1024 / MB, int(status["VmHWM"][0]) * 1024 / MB, worker / MB,
        int(gauges.get("fleetprof_agent_unwind_rows", 0)),
        int(gauges.get("fleetprof_agent_unwind_files_tabled", 0)),
        sum(m.memlock for m in maps.values()) / MB, total, 100 * whole / total, 100 * py / total,
        top_fp, top_perf, sum(1 for name, _ in top_perf if name in ours), out.decode().strip(),
        int(gauges.get('fleetprof_agent_stack_outcomes_total{reason="stack_table_full"}', 0)),
        int(gauges.get('fleetprof_agent_stack_outcomes_total{reason="python_stack_table_full"}', 0)),
        [(name, 100 * n / total) for name, n in roots.most_common(5)],
        int(gauges.get("fleetprof_agent_unwind_files_no_room", 0)),
        {stage: (m1.get(key, 0) - m0.get(key, 0)) * 1e6 / samples for stage in STAGES
         if (key := f'fleetprof_agent_drain_stage_cpu_seconds_total{{stage="{stage}"}}') in m1},
        settled_s, startup_cpu_s,
    )  # fmt: skip


def report(r: Result, version: str, ncpus: int) -> None:
    load = os.getloadavg()[0]
    print(
        f"\n{r.frequency} Hz, torch {version}, {ncpus} CPUs, load {load:.1f}: {r.samples} samples in "
        f"{r.window_s:.0f} s; job (train steps, requests served): {r.workload_out}"
    )
    print(
        f"  start-up: the agent's tables built and symbols read {r.settled_s:.0f} s after it started, "
        f"{r.startup_cpu_s:.1f} s of its CPU until then (BCC's compile included); the window opened after"
    )
    print(
        f"  agent {r.agent_pct:.2f}% of one core; us per sample: BPF sampler {r.bpf_sampler_us:.1f}, all BPF "
        f"{r.bpf_all_us:.1f}, drain+resolve+encode {r.drain_us:.1f}, rest (gRPC, events, symbols) "
        f"{r.rest_us:.1f} (gRPC core threads {r.grpc_core_us:.1f}); all-in {r.all_in_us:.1f}"
    )
    if r.drain_stages_us:
        print(
            "  drain by stage, us per sample: "
            + ", ".join(f"{k} {v:.1f}" for k, v in r.drain_stages_us.items())
        )
    print(
        f"  samples since start whose stacks were lost (maps full or out of memory at once): native "
        f"{r.stacks_lost}, CPython {r.python_stacks_lost}"
    )
    print(
        f"  RSS {r.rss_mb:.0f} MB, peak {r.peak_mb:.0f} MB, table worker {r.worker_mb:.0f} MB; unwind "
        f"{r.unwind_rows:,} rows in {r.unwind_files} files; BPF maps {r.maps_mb:.1f} MB"
    )
    print(
        f"  job samples {r.workload_samples}: whole stacks {r.whole_native_pct:.1f}%, with Python "
        f"frames {r.python_pct:.1f}%; perf's top 10 in fleetprof's top 10: {r.overlap}"
    )
    roots = ", ".join(f"{name[:50]} {pct:.1f}%" for name, pct in r.cut_roots)
    print(f"  the rest begin at: {roots or '-'}; files left untabled for want of room: {r.files_no_room}")
    print("  | # | fleetprof (self %) | perf --call-graph dwarf (self %) |\n  |---|---|---|")
    for i in range(10):
        a = r.top_fleetprof[i] if i < len(r.top_fleetprof) else ("", 0.0)
        b = r.top_perf[i] if i < len(r.top_perf) else ("", 0.0)
        print(f"  | {i + 1} | {a[0][:60]} {a[1]:.1f} | {b[0][:60]} {b[1]:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-spec", default="torch", help="what pip installs into the bench venv")
    ap.add_argument("--cache", type=Path, default=Path("/var/cache/fleetprof-bench"))
    ncpus = os.cpu_count() or 1
    ap.add_argument("--frequencies", default=f"19,{19 * 64 // ncpus}", help="Hz, comma-separated")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured window per frequency")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--settle-max", type=float, default=300.0,
        help="seconds to wait at most for the agent's start-up work before the window opens",
    )  # fmt: skip
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (BPF, perf)", file=sys.stderr)
        return 2
    if shutil.which("perf") is None:
        raise BenchError("perf is needed (apt-get install linux-perf)")
    python = ensure_torch(args.cache, args.torch_spec)
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    workload = args.cache / "pytorch_workload.py"
    workload.write_text(WORKLOAD)
    work = Path("/tmp/fleetprof-bench-pytorch")
    work.mkdir(exist_ok=True)
    results = []
    with BpfRunTimeStats() as stats:
        if stats.error:
            print(f"(no BPF run-time accounting: {stats.error})", file=sys.stderr)
        for f in (int(x) for x in args.frequencies.split(",")):
            r = one_run(python, workload, f, args.seconds, work, args.settle_max)
            results.append(r)
            report(r, version, ncpus)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
