"""Shared fixtures: a real collector in-process, a real agent (BPF) as a subprocess, compiled workloads.

`make test` runs the suite in three phases (Makefile), the first two side by side:
1. every test not marked `bpf` or `serial`, one pytest-xdist worker per CPU;
2. the tests that load BPF programs (marked `bpf`), two files at a time (FLEETPROF_TEST_PHASE=bpf with
   xdist, a file per worker). Each judges its samples against its own workload's clock (CPU time it
   measured of itself), finds its own samples by pid, and sizes node-wide tables for a busy node: the
   other file's and phase 1's files, threads and processes are on the node too;
3. the `serial` tests, alone: any that cannot share the machine (none at present).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetprof.agent.scope import CgroupScope, cgroup_scope
from fleetprof.collector.main import Collector, CollectorConfig
from fleetprof.collector.render.tree import parse_folded
from tests.support import worker_cgroup
from tests.support.browser import Chromium, Page

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = Path(__file__).parent / "workloads"


# Where the suite's CPU goes: with FLEETPROF_TEST_CPU_LOG=FILE each test appends "seconds<TAB>node id<TAB>wall
# seconds<TAB>phase<TAB>start (Unix time)<TAB>xdist worker", the CPU its worker spent on it plus what its
# waited-for subprocesses spent (module fixtures count in their first test). Wall durations mislead when the
# phases share two CPUs; CPU is what the 10-minute budget spends, and wall, per phase, with the start and the
# worker, says which files a phase's end waits for.
CPU_LOG = os.environ.get("FLEETPROF_TEST_CPU_LOG")
if CPU_LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        before, wall, start = sum(os.times()[:4]), time.monotonic(), time.time()
        yield
        phase = os.environ.get("FLEETPROF_TEST_PHASE", "main")
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(CPU_LOG, "a") as log:
            log.write(
                f"{sum(os.times()[:4]) - before:.2f}\t{item.nodeid}\t{time.monotonic() - wall:.2f}\t{phase}"
                f"\t{start:.1f}\t{worker}\n"
            )


# This process's own cgroup (tests/support/worker_cgroup.py): the agents start_agent starts profile it only.
_ENTERED: tuple[Path, Path] | None = None


def own_scope() -> CgroupScope | None:
    """This pytest process's cgroup as a sampler's scope (`--cgroup`): for samplers made in the test's own
    process, which then sample what this process starts only, not the busy node's other work (whose files'
    tables and symbols they would build and resolve too). None: node-wide."""
    return cgroup_scope(str(_ENTERED[0])) if _ENTERED is not None else None


def own_cgroup() -> Path | None:
    """This pytest process's cgroup (v2) directory, where the agents start_agent starts profile; None where
    there is none (their agents are node-wide)."""
    return _ENTERED[0] if _ENTERED is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that hold `slow` tests first, the longest first (`slow(seconds=N)`: its file's wall time in
    make test, roughly), the rest in their order: xdist hands files out in this order (make test runs each
    phase a file at a time), so the longest (the arm64 guest's: minutes) does not start late and set the
    phase's end (one run where it started two minutes in: phase 1 ended 35 s later)."""
    seconds: dict = {}
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            seconds[item.path] = max(seconds.get(item.path, 0), marker.kwargs.get("seconds", 0))
    # stable: the order within each kind kept
    items.sort(key=lambda item: (item.path not in seconds, -seconds.get(item.path, 0)))


def pytest_configure(config: pytest.Config) -> None:
    global _ENTERED
    _ENTERED = worker_cgroup.enter()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ENTERED is not None:
        worker_cgroup.leave(_ENTERED)


def shared_dir() -> Path | None:
    """A directory both phases of one `make test` share (it makes and removes it): what a parallel-phase
    test built for serial-phase tests of the same module. None when pytest runs on its own."""
    path = os.environ.get("FLEETPROF_TEST_SHARED")
    return Path(path) if path else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fleetprof(*args: str, user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the `fleetprof` command line (as `user` when given) and capture its text output."""
    cmd = [sys.executable, "-m", "fleetprof.cli", *args]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout)


def http_get(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> bytes:
    # A transport timeout, not a claim about speed: servers here answer in milliseconds, but under
    # `taskset -c 0` on a machine at load 14 a collector process went unanswered for 10 s.
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return r.read()


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether `url` answers with a success status (unreachable, refusing or failing: False)."""
    try:
        http_get(url, timeout=timeout)
        return True
    except OSError:
        return False


# wait_until's timeouts are hang guards, not claims about speed: they stop a test that would otherwise wait
# forever. A machine that is slower, busier or pinned to one CPU (`taskset -c 0 make test`) takes several
# times longer to get there, and a passing test never waits for its guard, so every guard is given this
# many times the time it names.
HANG_GUARD_SCALE = 3.0


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str | Callable[[], str], every: float = 0.2
) -> object:
    """`what` names what was awaited in the failure; a callable is asked then (the state that explains it)."""
    deadline = time.monotonic() + timeout * HANG_GUARD_SCALE
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout * HANG_GUARD_SCALE:g} s waiting for {said}")
        time.sleep(every)


@pytest.fixture(scope="session")
def workload_bin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Compile tests/workloads/NAME.c with frame pointers (cached per session); returns the binary."""
    out = tmp_path_factory.mktemp("workloads")
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            exe = out / name
            subprocess.run(
                ["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(exe), str(WORKLOADS / f"{name}.c")],
                check=True,
            )
            built[name] = exe
        return built[name]

    return build


@pytest.fixture(scope="session")
def no_fp_bin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Compile tests/workloads/NAME.c (g++ for NAME.cpp) with -O2 -fomit-frame-pointer, cached per session:
    code only call-frame information can walk."""
    out = tmp_path_factory.mktemp("no-fp")
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            source = next(WORKLOADS.glob(f"{name}.c*"))
            compiler = "g++" if source.suffix == ".cpp" else "gcc"
            exe = out / name
            subprocess.run(
                [compiler, "-O2", "-fomit-frame-pointer", "-g", "-o", str(exe), str(source)], check=True
            )
            built[name] = exe
        return built[name]

    return build


def maps_libc(pid: int) -> bool:
    """The process has mapped libc (its loader is done with it): describe it now, as the agent does."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "/libc.so" in f.read()
    except OSError:  # gone already: a wait on this times out, naming the pid
        return False


@dataclass
class RunningCollector:
    collector: Collector

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.collector.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.collector.grpc_port}"

    def folded(self, query: str, since: str = "10m", **params: str) -> dict:
        """Merged stacks for a selector, parsed back from the folded format the API serves; `params` such as
        type="wall" go with the query."""
        q = urllib.parse.urlencode({"query": query, "since": since, "format": "folded", **params})
        return parse_folded(http_get(f"{self.url}/api/v1/profile?{q}").decode())

    def json(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params)
        return json.loads(http_get(f"{self.url}{path}?{q}"))


def start_collector(**overrides: object) -> Collector:
    cfg = CollectorConfig(grpc="127.0.0.1:0", http=f"127.0.0.1:{free_port()}", **overrides)
    col = Collector(cfg)
    col.start()
    return col


@pytest.fixture
def collector() -> Iterator[RunningCollector]:
    col = start_collector()
    yield RunningCollector(col)
    col.stop()


@pytest.fixture(scope="module")
def module_collector() -> Iterator[RunningCollector]:
    col = start_collector()
    yield RunningCollector(col)
    col.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    """Headless Chromium (tests/support/browser.py), one per test module."""
    with Chromium() as b:
        yield b


@pytest.fixture
def page(browser: Chromium) -> Iterator[Page]:
    p = browser.new_page()
    try:
        yield p
    finally:
        p.close()


def require_bpf() -> None:
    """eBPF tests fail (not skip) where BPF cannot run: CI must never pass without them."""
    from fleetprof.agent.kernel import missing_prerequisite

    problem = missing_prerequisite()
    if problem:
        pytest.fail(f"eBPF tests cannot run: {problem} (run `make test`, which sets this machine up)")
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("FLEETPROF_TEST_PHASE") != "bpf":
        # Phase 1 runs many CPU-heavy tests beside each other: a BPF test there would be starved, and its
        # agent would profile them all.
        pytest.fail("this test loads BPF programs: mark it @pytest.mark.bpf, so it runs in the BPF phase")


@dataclass
class RunningAgent:
    proc: subprocess.Popen
    http_port: int
    frequency: int
    interval: float

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.http_port}/metrics").decode()

    def value(self, name: str) -> float:
        """The metric's value on /metrics, summed over its label sets; 0 if the agent does not export it."""
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in self.metrics().splitlines()
            if line.startswith((name + " ", name + "{"))
        )


AGENT_NICE = ("nice", "-n", "-10")  # nice execs the agent: proc.pid is the agent's


def start_agent(
    collector_target: str, frequency: int = 99, interval: float = 1.0, *extra: str, node_wide: bool = False
) -> RunningAgent:
    """An agent profiling this pytest process's cgroup (every process the tests start), or with
    `node_wide` every process of the node (for workloads moved into cgroups of their own)."""
    require_bpf()
    scope = () if node_wide or _ENTERED is None else ("--cgroup", str(_ENTERED[0]))
    port = free_port()
    log = open(os.environ.get("FLEETPROF_AGENT_LOG", os.devnull), "ab")  # lives with the process
    proc = subprocess.Popen(
        [
            # At nice -10, ahead of the workloads it profiles: under `taskset -c 0` on a machine at load 10
            # an agent at nice 0 took ~20 s a drain instead of 1 s, and its maps filled meanwhile (105,110
            # stacks lost as stack_table_full, counted by reason as designed): a Python workload read 1,758
            # samples of the 2,994 its CPU time gives. What the tests judge is the profile, not starvation.
            *AGENT_NICE,
            sys.executable,
            "-m",
            "fleetprof.cli",
            "agent",
            "--collector",
            collector_target,
            "--http",
            f"127.0.0.1:{port}",
            "--frequency",
            str(frequency),
            "--interval",
            str(interval),
            "--node",
            "test-node",
            *scope,
            *extra,
        ],
        stdout=log,
        stderr=subprocess.PIPE,
        cwd=REPO,
        # A machine whose profile sets $DEBUGINFOD_URLS (Ubuntu, Fedora) would send the agent to the
        # internet: the tests that want a debuginfod name their own on loopback.
        env={k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"},
    )
    agent = RunningAgent(proc, port, frequency, interval)

    wait_until_serving(proc, f"http://127.0.0.1:{port}/healthz", 90, "the agent")
    return agent


def wait_until_serving(proc: subprocess.Popen, url: str, timeout: float, what: str) -> None:
    """Wait until `url` answers; fail at once, with the tail of its stderr, if `proc` exits first."""

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"{what} exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
            )
        return answers(url, timeout=1)

    wait_until(up, timeout, f"{what} to serve {url}", every=0.1)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_agent(agent: RunningAgent) -> None:
    stop_process(agent.proc, 30)
    if agent.proc.stderr:
        agent.proc.stderr.close()


@pytest.fixture(scope="module")
def agent(module_collector: RunningCollector) -> Iterator[RunningAgent]:
    a = start_agent(module_collector.grpc_target, 99, 1.0, "--syscalls")
    yield a
    stop_agent(a)


def samples_of(stacks: dict) -> int:
    return sum(stacks.values())


def acked_batches(agent: RunningAgent) -> int:
    for line in agent.metrics().splitlines():
        if line.startswith("fleetprof_agent_batches_acked_total "):
            return int(float(line.split()[1]))
    return 0


def settled_profile(
    col: RunningCollector, query: str, agent: RunningAgent, timeout: float = 60.0, **params: str
) -> dict:
    """The profile for `query` (with `params`, e.g. type="wall") once the agent's windows up to now are in
    the collector: two more batches acknowledged than when called (the window being written now, and the
    one drained before it may still be in flight), then the same profile twice in a row. Waiting on the
    agent's own acks, not on a quiet spell, keeps a busy agent (building unwind tables, say) from being
    read too early."""
    first = acked_batches(agent)
    wait_until(lambda: acked_batches(agent) >= first + 2, timeout, "two more batches acknowledged")
    last: list = [None]

    def stable() -> dict | None:
        cur = col.folded(query, **params)
        prev, last[0] = last[0], cur
        return cur if cur and cur == prev else None

    # Polled at most every 2 s: once the two batches are acknowledged the collector has stored them, and
    # this only makes sure no stray write is still landing (at a 10 s interval, polling once an interval
    # cost each call 10 s).
    every = min(max(0.5, agent.interval), 2.0)
    return wait_until(stable, timeout, f"samples for {query} to settle", every=every)
