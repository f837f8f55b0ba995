"""fleetprof as a wheel, installed the way the agent image installs it: into a venv of Debian's python3 with
--system-site-packages (BCC from python3-bpfcc), then run from a directory outside the source tree. The venv
gets both parts' extras (`agent`, `collector`), as a machine that runs both does; each image installs its own
alone (tests/deploy/test_images.py runs them, tests/deploy/test_dependencies.py checks what each part
imports)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    answers,
    free_port,
    http_get,
    require_bpf,
    shared_dir,
    stop_process,
    wait_until,
)
from tests.support.installed import (
    HOT_FUNCTION,
    WORKLOAD,
    HttpCollector,
    assert_hot_function_leads,
    build_wheel,
    package_data_files,
    profile_hot_workload,
)

pytestmark = pytest.mark.slow

SYSTEM_PYTHON = "/usr/bin/python3"  # what `python3` is in the image (Debian bookworm's)


@dataclass
class Installed:
    wheel: Path
    venv: Path
    elsewhere: Path  # a working directory outside the source tree
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, capture_output=True, text=True, cwd=self.elsewhere, env=self.env, timeout=timeout
        )

    def fleetprof(self, *args: str, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(
                [str(self.venv / "bin" / "fleetprof"), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.elsewhere,
                env=self.env,
            )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel and its venv, built once per `make test`: its parallel phase builds them (the tests here
    that read files), its serial phase reuses them (the ones that run the installed agent, which loads
    BPF). Run alone, a module builds its own."""
    shared = shared_dir()
    root = shared / "wheel" if shared else tmp_path_factory.mktemp("wheel")
    with open(root.parent / "wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two workers of the parallel phase: one builds, one waits
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed half-way
            root.mkdir()
            _build(root)
            (root / "built").touch()
    (wheel,) = (root / "dist").glob("fleetprof-*.whl")
    venv = root / "venv"
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # a working directory outside the source tree
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return Installed(wheel, venv, elsewhere, env)


def _build(root: Path) -> None:
    """The wheel from a copy of the build inputs, into root/dist; a venv of Debian's python3 with it
    installed, as the agent image makes, in root/venv."""
    (root / "dist").mkdir()
    wheel = build_wheel(root / "dist")

    if not Path(SYSTEM_PYTHON).exists():
        pytest.fail(f"{SYSTEM_PYTHON} is missing: Debian's python3 is what the agent image runs on")
    venv = root / "venv"
    made = subprocess.run(
        [SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], capture_output=True, text=True
    )
    assert made.returncode == 0, f"venv failed (needs Debian's python3-venv):\n{made.stderr}"
    # Dependencies from PyPI, through pip's cache (~/.cache/pip), so a rerun downloads nothing.
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
         f"{wheel}[agent,collector]"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert pip.returncode == 0, f"pip install of the wheel failed:\n{pip.stderr[-3000:]}"


def test_wheel_carries_every_file_the_code_reads_at_run_time(installed: Installed) -> None:
    expected = package_data_files()
    assert {
        "fleetprof/agent/bpf/cpu_sampler.c",
        "fleetprof/agent/bpf/process_event.h",
        "fleetprof/collector/web/index.html",
        "fleetprof/collector/web/app.flame.js",  # html.py and svg.py inline it: flame graphs need it too
        "fleetprof/collector/web/app.flame.css",
    } <= expected
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
    missing = expected - names
    assert not missing, f"the wheel lacks {sorted(missing)}: list them in pyproject.toml's package-data"
    # One import namespace: nothing but fleetprof (and its metadata) lands in site-packages.
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fleetprof"}, sorted(top)


def test_installed_package_is_imported_from_the_venv_with_debians_bcc(installed: Installed) -> None:
    out = installed.run(
        str(installed.venv / "bin" / "python"),
        "-c",
        "import fleetprof.agent.bpf as bpf, bcc, fleetprof.collector as collector, pathlib; "
        "print(pathlib.Path(bpf.__file__).parent); print(collector.__file__); print(bcc.__file__)",
    )
    assert out.returncode == 0, out.stderr
    bpf_dir, collector_file, bcc_file = (Path(line) for line in out.stdout.split())
    assert installed.venv in bpf_dir.parents and installed.venv in collector_file.parents, out.stdout
    assert REPO not in bpf_dir.parents
    assert bcc_file.is_relative_to("/usr/lib/python3/dist-packages"), bcc_file
    for header in ("process_event.h", "python_stack.h", "log2.h"):
        assert (bpf_dir / header).read_bytes() == (REPO / "agent" / "bpf" / header).read_bytes()


@dataclass
class Running:
    col: HttpCollector
    collector: subprocess.Popen
    agent: subprocess.Popen
    logs: Path

    def alive(self) -> None:
        for name, proc in (("collector", self.collector), ("agent", self.agent)):
            if proc.poll() is not None:
                log = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the installed {name} exited with {proc.returncode}:\n{log}")


@pytest.fixture(scope="module")
def running(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    require_bpf()
    logs = tmp_path_factory.mktemp("wheel-logs")
    grpc, http, agent_http = free_port(), free_port(), free_port()
    collector = installed.fleetprof(
        "collector", "--grpc", f"127.0.0.1:{grpc}", "--http", f"127.0.0.1:{http}", log=logs / "collector.log"
    )
    agent = None
    try:
        agent = installed.fleetprof(
            "agent", "--collector", f"127.0.0.1:{grpc}", "--http", f"127.0.0.1:{agent_http}",
            "--frequency", "99", "--interval", "1", "--node", "wheel-node",
            log=logs / "agent.log",
        )  # fmt: skip
        r = Running(HttpCollector(f"http://127.0.0.1:{http}"), collector, agent, logs)

        def up() -> bool:
            r.alive()
            return r.col.healthy() and answers(f"http://127.0.0.1:{agent_http}/healthz")

        wait_until(up, 120, "the installed collector and agent to serve /healthz")
        yield r
    finally:
        if agent is not None:
            stop_process(agent, 30)
        stop_process(collector, 30)


@pytest.mark.bpf
def test_installed_agent_profiles_a_workload_into_the_installed_collector(
    running: Running, installed: Installed, workload_bin
) -> None:
    pid, stacks = profile_hot_workload(running.col, workload_bin(WORKLOAD), timeout=120, alive=running.alive)
    assert_hot_function_leads(running.col, pid, stacks)
    # The installed command line reads it back too.
    top = installed.run("fleetprof", "top", "--collector", running.col.url, "--query", f'{{pid="{pid}"}}')
    assert top.returncode == 0, top.stderr
    assert HOT_FUNCTION in top.stdout.splitlines()[2], top.stdout


@pytest.mark.bpf  # shares the running pair with the test above
def test_installed_collector_serves_the_web_ui(running: Running) -> None:
    """Every web file, as the page asks for it at "/" (the index loads the rest by relative name)."""
    web = REPO / "collector" / "web"
    assert http_get(f"{running.col.url}/") == (web / "index.html").read_bytes()
    for path in sorted(p for p in web.iterdir() if p.name != "index.html"):
        assert http_get(f"{running.col.url}/{path.name}") == path.read_bytes(), path.name
    # The HTML and SVG flame graphs inline the installed app.flame.js.
    script = (web / "app.flame.js").read_text()
    for fmt in ("html", "svg"):
        body = http_get(f"{running.col.url}/api/v1/profile?format={fmt}&since=1m").decode()
        assert script in body, fmt
