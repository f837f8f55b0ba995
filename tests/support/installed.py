"""Helpers for tests of fleetprof as users install it (a wheel in a venv, the container images): a collector
known only by its HTTP address, and a workload whose hot function must show up under its own pid."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetprof.collector.render.tree import parse_folded
from tests.conftest import REPO, http_get, samples_of, wait_until

# tests/workloads/two_funcs.c: fp_driver calls fp_hot_alpha for SHARE % of its CPU time, fp_cold_beta for
# the rest. HOT_SHARE leaves no doubt which function leads the profile.
HOT_FUNCTION = "fp_hot_alpha"
HOT_SHARE = 85
WORKLOAD = "two_funcs"
# What the Dockerfiles COPY: the wheel is built from these alone, as in the image.
BUILD_INPUTS = ("pyproject.toml", "README.md", "agent", "collector", "fleetprof")


def build_wheel(dest: Path) -> Path:
    """fleetprof's wheel, built from a copy of BUILD_INPUTS (so setuptools' build/ and egg-info never land
    in the working tree) into `dest`; returns its path."""
    src = dest / ".wheel-src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    built = subprocess.run(
        # The venv's own setuptools (the `test` extra pins one new enough): an isolated build would ask
        # PyPI for the build backend each time, a minute or two of round trips on a slow index.
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "-w", str(dest), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, f"pip wheel failed:\n{built.stderr[-3000:]}"
    shutil.rmtree(src)
    (wheel,) = dest.glob("fleetprof-*.whl")
    return wheel


@dataclass
class HttpCollector:
    """A collector running in another process or container, read through its HTTP API only."""

    url: str
    token: str | None = None  # the API token, when the collector runs with --api-token-file

    def _get(self, path: str) -> bytes:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return http_get(f"{self.url}{path}", headers=headers)

    def healthy(self) -> bool:
        try:
            return json.loads(http_get(f"{self.url}/healthz", timeout=2)).get("status") == "ok"
        except OSError:
            return False

    def folded(self, query: str, since: str = "10m") -> dict:
        q = urllib.parse.urlencode({"query": query, "since": since, "format": "folded"})
        return parse_folded(self._get(f"/api/v1/profile?{q}").decode())

    def json(self, path: str, **params: str) -> dict:
        return json.loads(self._get(f"{path}?{urllib.parse.urlencode(params)}"))


def package_data_files() -> set[str]:
    """Every file other than Python source under the three source folders, as paths inside a wheel (agent/
    installs as fleetprof/agent/, collector/ as fleetprof/collector/): the agent and collector read these at
    run time (BPF programs and headers, web assets) or ship them (stubs)."""
    files = set()
    for folder, installed_as in (
        ("agent", "fleetprof/agent"),
        ("collector", "fleetprof/collector"),
        ("fleetprof", "fleetprof"),
    ):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
                files.add(f"{installed_as}/{path.relative_to(REPO / folder).as_posix()}")
    return files


def profile_hot_workload(
    col: HttpCollector, workload: Path, timeout: float, alive: Callable[[], None] = lambda: None
) -> tuple[int, dict]:
    """Run the workload on this host until the collector shows its hot function under its pid.

    It runs for up to `timeout` seconds and is stopped as soon as the evidence is there, so the wait is one
    agent interval or so whatever the interval; `alive` raises if the agent or collector died meanwhile.
    Returns the pid and its folded stacks.
    """
    proc = subprocess.Popen([str(workload), str(timeout + 30), str(HOT_SHARE)], stdout=subprocess.DEVNULL)
    query = f'{{pid="{proc.pid}"}}'

    def hot_seen() -> dict | None:
        alive()
        if proc.poll() is not None:
            raise AssertionError(f"the workload exited early with {proc.returncode}")
        stacks = col.folded(query)
        hot = sum(n for st, n in stacks.items() if st and st[-1].function == HOT_FUNCTION)
        # More than one drain's worth, so the shares below mean something.
        return stacks if hot >= 20 else None

    try:
        stacks = wait_until(hot_seen, timeout, f"samples of {HOT_FUNCTION} under pid {proc.pid}", every=1.0)
    finally:
        proc.kill()
        proc.wait()
    return proc.pid, stacks


def assert_hot_function_leads(col: HttpCollector, pid: int, stacks: dict) -> None:
    """The workload's profile is its own: its hot function leads, under its callers, in its binary."""
    total = samples_of(stacks)
    hot = sum(n for st, n in stacks.items() if st and st[-1].function == HOT_FUNCTION)
    assert hot / total > 0.5, f"{HOT_FUNCTION} has {hot} of {total} samples of pid {pid}"
    heaviest = max((st for st in stacks if st and st[-1].function == HOT_FUNCTION), key=stacks.get)
    assert [f.function for f in heaviest][-3:] == ["main", "fp_driver", HOT_FUNCTION]
    top = col.json("/api/v1/top", query=f'{{pid="{pid}"}}', since="10m", limit="3")
    assert (top["functions"][0]["function"], top["functions"][0]["module"]) == (HOT_FUNCTION, WORKLOAD)
