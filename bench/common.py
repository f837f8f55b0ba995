"""What the bench/ scripts share: process control, /metrics, /proc and BPF accounting, the spin workload.

The scripts run as files (`python bench/NAME.py`), which puts bench/ first on sys.path: they import this as
`common`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 90.0  # for a started process to answer (BPF compiles take a while)
SETTLE_S = 0.5  # after a profiler reports ready, before a timed window opens


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why."""


# -- processes a bench starts ---------------------------------------------------------------------
class Children:
    """Every process the bench starts, each in its own session; `close()` stops whatever is still running."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(
        self, argv: list[str], *, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) -> subprocess.Popen:
        self._procs = [p for p in self._procs if p.poll() is None]
        # A session of its own: the terminal's Ctrl-C reaches only us, and we stop children in order.
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, start_new_session=True)
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Signal `proc` and wait for it; SIGKILL its process group if it does not exit in time."""
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  (pid {proc.pid} ignored signal {sig} for {timeout_s:g} s; killing it)", file=sys.stderr)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for proc in reversed(self._procs):
            self.stop(proc, timeout_s=10.0)
        self._procs.clear()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_health(
    proc: subprocess.Popen,
    url: str,
    what: str,
    log: Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
    context: ssl.SSLContext | None = None,
) -> None:
    """Return once `url` answers 200; BenchError (with the tail of `log`) if `proc` exits or time runs out."""

    def tail() -> str:
        return f":\n{log_tail(log)}" if log is not None else ""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the {what} exited with {proc.returncode} while starting{tail()}")
        try:
            if http_get(url, timeout_s=1.0, context=context)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.1)
    raise BenchError(f"the {what} did not answer {url} within {timeout_s:g} s{tail()}")


# -- HTTP -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout_s: float = 5.0, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text exposition as {sample name with labels: value}. A minute to answer: on a node with
    a load of 10 per CPU (a shared CI machine) an agent's /metrics took over 5 s."""
    _, text = http_get(url, timeout_s=60.0)
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


# -- what a process uses --------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """One look at a process: run time per thread (ns, from schedstat), VmRSS and VmHWM (KiB), and the
    run time and run count of the BPF programs it holds (zero unless BpfRunTimeStats is on)."""

    thread_ns: dict[int, int]
    rss_kb: int
    hwm_kb: int
    bpf_ns: int = 0  # all its programs
    sampler_ns: int = 0  # its perf_event programs only: the CPU samplers
    sampler_runs: int = 0


def proc_status(pid: int) -> dict[str, list[str]]:
    """/proc/PID/status as {key: the words of its value}, e.g. "VmRSS": ["1234", "kB"]."""
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.split()
    return status


def read_usage(pid: int) -> Usage:
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread exited between listing and reading
    status = proc_status(pid)
    return Usage(threads, int(status["VmRSS"][0]), int(status["VmHWM"][0]), *bpf_run_time(pid))


def cpu_seconds(before: Usage, after: Usage) -> float:
    """Run time between two looks; a thread that started and ended in between is missed (none do here)."""
    return sum(ns - before.thread_ns.get(tid, 0) for tid, ns in after.thread_ns.items()) / 1e9


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the whole process so far (/proc/PID/stat, in clock ticks): it keeps the
    time of threads that have exited, which `read_usage` misses."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fds_of_kind(pid: int, kind: str) -> list[str]:
    """The process's file descriptors whose link reads `kind`, e.g. anon_inode:[perf_event]."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == kind:
                found.append(fd.name)
        except OSError:
            pass  # closed under us
    return found


def _fdinfos(pid: int, kind: str) -> list[dict[str, str]]:
    """/proc/PID/fdinfo of each of `pid`'s fds of `kind` (fds_of_kind), as "key: value" pairs; fds closed
    meanwhile are left out."""
    infos = []
    for fd in fds_of_kind(pid, kind):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        infos.append(dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line))
    return infos


BPF_PROG_TYPE_PERF_EVENT = "7"


@dataclass(frozen=True)
class BpfProgram:
    """One BPF program as /proc/PID/fdinfo shows it; run time and count stay 0 while the kernel's BPF
    stats are off (BpfRunTimeStats turns them on)."""

    prog_type: str | None
    run_time_ns: int
    run_cnt: int


def bpf_programs(pid: int) -> dict[str, BpfProgram]:
    """The BPF programs `pid` holds, by prog_id (a program held through two fds is counted once)."""
    progs = {}
    for info in _fdinfos(pid, "anon_inode:bpf-prog"):
        if "prog_id" in info and "run_time_ns" in info:
            progs[info["prog_id"]] = BpfProgram(
                info.get("prog_type"), int(info["run_time_ns"]), int(info["run_cnt"])
            )
    return progs


def bpf_run_time(pid: int) -> tuple[int, int, int]:
    """(ns of all programs, ns and runs of the perf_event programs) that `pid` holds, from /proc/PID/fdinfo.

    Samplers are counted apart: an agent also runs tracepoint programs (process events, syscalls) that
    fire far more often and cost far less a run, and would blur the cost per sample."""
    progs = bpf_programs(pid).values()
    sampler = [p for p in progs if p.prog_type == BPF_PROG_TYPE_PERF_EVENT]
    return (
        sum(p.run_time_ns for p in progs),
        sum(p.run_time_ns for p in sampler),
        sum(p.run_cnt for p in sampler),
    )


@dataclass(frozen=True)
class BpfMap:
    """One BPF map as /proc/PID/fdinfo shows it: memlock is the kernel's own count of the bytes it holds
    (htab_map_mem_usage and its peers: preallocated entries, per-CPU copies and buckets included)."""

    name: str
    map_type: int
    key_size: int
    value_size: int
    max_entries: int
    map_flags: int
    memlock: int


def bpf_maps(pid: int) -> dict[str, BpfMap]:
    """The BPF maps `pid` holds, by map_id (a map held through two fds is counted once). Names come from
    bpftool when it is there (fdinfo has none), else the map id."""
    maps = {}
    for info in _fdinfos(pid, "anon_inode:bpf-map"):
        if "map_id" in info:
            maps[info["map_id"]] = BpfMap(
                info["map_id"],
                int(info["map_type"]),
                int(info["key_size"]),
                int(info["value_size"]),
                int(info["max_entries"]),
                int(info["map_flags"], 16),
                int(info["memlock"]),
            )
    return {k: dataclasses.replace(m, name=_map_name(int(k)) or m.name) for k, m in maps.items()}


def _map_name(map_id: int) -> str:
    """The map's name (fdinfo has none): BPF_MAP_GET_FD_BY_ID, then BPF_OBJ_GET_INFO_BY_FD (struct
    bpf_map_info: name at byte 24, 16 bytes). "" when the kernel will not say."""
    nr = BpfRunTimeStats.SYSCALL.get(platform.machine())
    if nr is None:
        return ""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 4)(map_id, 0, 0, 0)
    fd = libc.syscall(nr, 14, attr, ctypes.sizeof(attr))  # BPF_MAP_GET_FD_BY_ID
    if fd < 0:
        return ""
    try:
        info = (ctypes.c_char * 96)()
        # struct { u32 bpf_fd; u32 info_len; u64 info; } (the get_info member of union bpf_attr)
        get = (ctypes.c_uint32 * 4)(fd, ctypes.sizeof(info), 0, 0)
        ctypes.c_uint64.from_buffer(get, 8).value = ctypes.addressof(info)
        if libc.syscall(nr, 15, get, ctypes.sizeof(get)) != 0:  # BPF_OBJ_GET_INFO_BY_FD
            return ""
        return info.raw[24:40].split(b"\0", 1)[0].decode("ascii", "replace")
    finally:
        os.close(fd)


class BpfRunTimeStats:
    """The kernel's run-time accounting of BPF programs, on while this is open (BPF_ENABLE_STATS).

    Like `sysctl kernel.bpf_stats_enabled=1` it covers every program on the machine (about 20 ns a run),
    but it is tied to a file descriptor, so it ends when this closes, or when the bench dies.
    """

    SYSCALL = {"x86_64": 321, "aarch64": 280}
    BPF_ENABLE_STATS = 32
    BPF_STATS_RUN_TIME = 0

    def __init__(self) -> None:
        self.fd = -1
        self.error = ""

    def __enter__(self) -> BpfRunTimeStats:
        nr = self.SYSCALL.get(platform.machine())
        if nr is None:
            self.error = f"no bpf(2) number known for {platform.machine()}"
            return self
        libc = ctypes.CDLL(None, use_errno=True)
        attr = (ctypes.c_uint32 * 2)(self.BPF_STATS_RUN_TIME, 0)
        fd = libc.syscall(nr, self.BPF_ENABLE_STATS, attr, ctypes.sizeof(attr))
        if fd < 0:
            self.error = f"BPF_ENABLE_STATS failed: {os.strerror(ctypes.get_errno())}"
        self.fd = fd
        return self

    def __exit__(self, *_: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


# -- tracers in A/B benches (bench/syscalls.py, bench/offcpu.py) ------------------------------------
class Tracer:
    """Started before a traced run, stopped after it. `pid` holds its BPF programs."""

    pid = os.getpid()

    def start(self) -> None: ...

    def stop(self) -> None: ...


class BccTool(Tracer):
    """A bcc tool (Debian's `*-bpfcc`), ready once it prints its "Tracing" banner, after attaching; stopped
    with SIGINT, as a user's Ctrl-C (it may print what it gathered on the way out)."""

    def __init__(self, tool: str, *args: str, start_timeout_s: float = 60.0, stop_timeout_s: float = 120.0):
        self.argv = [tool, *args]
        self._start_timeout_s, self._stop_timeout_s = start_timeout_s, stop_timeout_s
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # the banner must reach us before it exits
        self._proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.pid = self._proc.pid
        deadline = time.monotonic() + self._start_timeout_s
        assert self._proc.stdout is not None
        lines = []
        for line in self._proc.stdout:
            if line.startswith("Tracing"):
                return
            lines.append(line)
            if time.monotonic() > deadline:
                break
        self._proc.kill()
        last = lines[-1].strip() if lines else "no output"
        raise BenchError(f"{' '.join(self.argv)} did not start (exit {self._proc.wait()}: {last})")

    def stop(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.communicate(timeout=self._stop_timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# -- numbers --------------------------------------------------------------------------------------
def spread_pct(values: list[float]) -> float:
    """(max - min) / median, in %: how far apart repeated runs of one thing landed (the noise floor)."""
    return (max(values) - min(values)) / statistics.median(values) * 100


# -- workloads ------------------------------------------------------------------------------------
SPIN_SOURCE = Path(__file__).parent / "workloads" / "spin.c"  # CPU-bound, deterministic; `spin run S`


def build(source: Path, workdir: Path, *extra: str) -> Path:
    """Compile a C workload with frame pointers into workdir; the binary is named after the source."""
    if shutil.which("gcc") is None:
        raise BenchError("gcc is needed to build the workloads (apt-get install gcc)")
    binary = workdir / source.stem
    cmd = ["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(binary), str(source), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"building {source.name} failed: {' '.join(cmd)}\n{done.stderr}")
    return binary


@dataclass(frozen=True)
class Run:
    """One workload run: records/s of wall time, records per second of the workers' own CPU time, and
    the share of the node's CPU the workers got (below ~1.0 when something else ran)."""

    throughput: float
    per_cpu_second: float
    cpu_share: float


def run_workload(children: Children, binary: Path, ncpus: int, seconds: float) -> Run:
    """`ncpus` workers of the spin workload (`binary`, built from SPIN_SOURCE) for `seconds`."""
    workers = [
        children.start([str(binary), "run", str(seconds)], stdout=subprocess.PIPE) for _ in range(ncpus)
    ]
    records = wall_s = cpu_s = throughput = 0.0
    for w in workers:
        out, _ = w.communicate(timeout=seconds + 60)
        if w.returncode != 0:
            raise BenchError(f"a workload process failed (exit {w.returncode})")
        n, elapsed_ns, cpu_ns, _checksum = out.split()
        records += int(n)
        wall_s += int(elapsed_ns) / 1e9
        cpu_s += int(cpu_ns) / 1e9
        throughput += int(n) / (int(elapsed_ns) / 1e9)
    # The CPU time includes the sampler's BPF program: it runs in the interrupted worker's context, and
    # this kernel charges interrupt time to the task (no CONFIG_IRQ_TIME_ACCOUNTING).
    return Run(throughput, records / cpu_s, cpu_s / wall_s)


# -- fleetprof as child processes -----------------------------------------------------------------
class ChildProcess:
    """Something a bench runs as one child process: `proc` once started."""

    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


class Collector(ChildProcess):
    """`fleetprof collector` on free local ports, in-memory store; up for the whole bench."""

    def __init__(self, children: Children, workdir: Path):
        self._children = children
        self.grpc = f"127.0.0.1:{free_port()}"
        self.http = f"127.0.0.1:{free_port()}"
        self._log = workdir / "collector.log"

    def start(self) -> None:
        argv = [sys.executable, "-m", "fleetprof.cli", "collector", "--grpc", self.grpc, "--http", self.http]
        with open(self._log, "wb") as log:
            self.proc = self._children.start(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for_health(self.proc, f"http://{self.http}/healthz", "collector", self._log)


class FleetprofAgent(ChildProcess):
    """`fleetprof agent` shipping to `collector`; ready once BPF is attached and the first drain is done."""

    def __init__(
        self,
        children: Children,
        collector: Collector,
        frequency: int,
        interval_s: float,
        workdir: Path,
        warmup: Callable[[], None] | None = None,
        extra_args: tuple[str, ...] = (),  # more agent flags (bench/python.py: --python / --no-python)
    ):
        self._children = children
        self._warmup = warmup
        self._extra_args = extra_args
        self._collector = collector
        self.frequency = frequency
        self.interval_s = interval_s
        self._log = workdir / f"agent-{frequency}hz.log"
        self.metrics_url = ""

    def start(self) -> None:
        http = f"127.0.0.1:{free_port()}"
        self.metrics_url = f"http://{http}/metrics"
        # FLEETPROF_BENCH_AGENT_PROFILE=FILE: the agent's drains under cProfile (bench/agent_profiled.py)
        profile = os.environ.get("FLEETPROF_BENCH_AGENT_PROFILE")
        launch = (
            (str(Path(__file__).with_name("agent_profiled.py")), profile)
            if profile
            else ("-m", "fleetprof.cli", "agent")
        )
        argv = [
            sys.executable, *launch, "--collector", self._collector.grpc,
            "--http", http, "--frequency", str(self.frequency), "--interval", f"{self.interval_s:g}",
            "--node", "bench", *self._extra_args,
        ]  # fmt: skip
        with open(self._log, "ab") as log:
            self.proc = self._children.start(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for_health(self.proc, f"http://{http}/healthz", "agent", self._log)
        drains = 0.0
        if self._warmup is not None:
            # An always-on agent has long since loaded the symbols of the workload's files (its binary,
            # libc); a fresh one would load them inside the window. Show it the workload once first.
            self._warmup()
            drains = self.metrics().get("fleetprof_agent_drains_total", 0)
        deadline = time.monotonic() + 3 * self.interval_s + 30
        while self.metrics().get("fleetprof_agent_drains_total", 0) < drains + 1:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the agent made no first drain:\n{log_tail(self._log)}")
            time.sleep(0.1)
        time.sleep(SETTLE_S)

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_url)

    def stop(self) -> None:
        if self.proc is not None:
            self._children.stop(self.proc, signal.SIGTERM)
            if self.proc.returncode not in (0, -signal.SIGTERM):
                print(
                    f"  (agent exited with {self.proc.returncode}:\n{log_tail(self._log)})", file=sys.stderr
                )
