"""A real `fleetprof collector --data-dir` as a subprocess: started once /healthz answers, killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, wait_until_serving


def start_collector_process(data_dir: Path, grpc_port: int, http_port: int, *extra: str) -> subprocess.Popen:
    """The collector on these ports, once /healthz answers; its stderr is a pipe the caller closes."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetprof.cli",
            "collector",
            "--data-dir",
            str(data_dir),
            "--grpc",
            f"127.0.0.1:{grpc_port}",
            "--http",
            f"127.0.0.1:{http_port}",
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    wait_until_serving(proc, f"http://127.0.0.1:{http_port}/healthz", 60, "the collector")
    return proc


def kill9(proc: subprocess.Popen) -> None:
    """What a crash does: no shutdown, no final flush."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
