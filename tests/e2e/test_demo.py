"""`fleetprof demo` (what `make demo` runs): both start, a first top is printed, Ctrl-C at the terminal
stops the agent (which sends its last window) and then the collector."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO, answers, http_get, require_bpf, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


def test_demo_profiles_this_machine_and_stops_cleanly_on_ctrl_c() -> None:
    require_bpf()
    # A session of its own, as a terminal's: Ctrl-C there signals the whole foreground process group.
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetprof.cli", "demo", "--warmup", "8", "--interval", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    lines: list[str] = []

    def read_output() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wait_until(lambda: answers("http://127.0.0.1:7471/healthz"), 60, "the demo collector")
        wait_until(lambda: answers("http://127.0.0.1:7472/healthz"), 90, "the demo agent")
        wait_until(_has_samples, 90, "the demo's first samples")
        # The first top comes after the warm-up, once the collector has samples (the demo retries each
        # second until then): wait for it, however long a busy machine makes that.
        wait_until(lambda: any("FUNCTION" in line for line in lines), 90, "the demo's first top")
        ui = http_get("http://127.0.0.1:7471/").decode()
        assert 'id="flamegraph"' in ui
    finally:
        burner.kill()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
    proc.wait(timeout=60)
    reader.join(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "UI http://127.0.0.1:7471/" in out
    assert "SELF%" in out and "FUNCTION" in out, out
    assert "fleetprof demo: stopped" in out
    assert "Traceback" not in out
    # The agent stopped first and its last window was acknowledged: the collector was still there.
    assert "unreachable" not in out, out
    (stopped,) = [line for line in out.splitlines() if "agent stopped:" in line]
    assert stopped.endswith(" 0 unacknowledged at exit"), stopped
    # Both children are gone: their ports are free again.
    for port in (7470, 7471, 7472):
        assert not answers(f"http://127.0.0.1:{port}/healthz")


def _has_samples() -> bool:
    top = json.loads(http_get("http://127.0.0.1:7471/api/v1/top?since=1m"))
    return top["total"] > 0
