"""The fleetprof command as a user runs it: flags, query commands, formats, and clear failures."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fleetprof.agent.kernel import missing_prerequisite
from fleetprof.collector.render.tree import parse_folded
from tests.conftest import REPO, RunningCollector, fleetprof, free_port
from tests.support.wire import make_batch, push


@pytest.mark.parametrize(
    "args, message",
    [
        (["agent", "--frequency", "0"], "must be greater than 0"),
        (["agent", "--frequency", "fast"], "expected a whole number"),
        (["agent", "--frequency", "5000"], "above the 1000 Hz limit"),
        (["agent", "--interval", "0.01"], "between 0.5 and 3600 seconds"),
        (["agent", "--collector", "nowhere"], "expected HOST:PORT"),
        (["agent", "--debuginfod-url", "ftp://mirror"], "expected http://HOST[:PORT][/PATH]"),
        (["agent", "--debuginfod-cache-size", "512K"], "must be at least 1M"),
        (["agent", "--debuginfod-cache-size", "lots"], "expected a size such as 512M or 2G"),
        (["agent", "--unsymbolized", "hex"], "invalid choice"),
        (["collector", "--retention", "5m"], "at least 15m"),
        (["top", "--limit", "-3"], "must be greater than 0"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    r = fleetprof(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_agent_names_a_bad_debuginfod_urls_variable() -> None:
    env = {**os.environ, "DEBUGINFOD_URLS": "https://debuginfod.debian.net ftp://mirror"}
    cmd = [sys.executable, "-m", "fleetprof.cli", "agent", "--http", f"127.0.0.1:{free_port()}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "fleetprof agent: $DEBUGINFOD_URLS: debuginfod server 'ftp://mirror': "
        "expected http://HOST[:PORT][/PATH] or https://..."
    )


def test_agent_names_a_debuginfod_cache_it_cannot_make() -> None:
    if os.geteuid() != 0:
        pytest.skip("this check runs as root (as CI does): the agent stops earlier without privileges")
    r = fleetprof(
        "agent",
        "--http",
        f"127.0.0.1:{free_port()}",
        "--debuginfod-url",
        "http://127.0.0.1:9",
        "--debuginfod-cache",
        "/proc/self/no/cache",
    )
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "fleetprof agent: cannot start: [Errno 2] the debuginfod cache /proc/self/no/cache: "
        "No such file or directory"
    )


def test_query_commands_say_when_the_collector_is_down() -> None:
    r = fleetprof("top", "--collector", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert "cannot reach the collector at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_selector_is_reported_from_the_collector(collector: RunningCollector) -> None:
    r = fleetprof("top", "--collector", collector.url, "--query", '{pod=~"("}')
    assert r.returncode == 1
    assert "the collector refused the query (400)" in r.stderr
    assert "regex" in r.stderr


def test_top_prints_the_hottest_functions_as_a_table(collector: RunningCollector) -> None:
    push(collector.grpc_target, [make_batch(count=30)])
    r = fleetprof("top", "--collector", collector.url, "--query", '{comm="worker"}', "--since", "5m")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert '{comm="worker"}' in lines[0] and "30 samples" in lines[0]
    assert lines[1].split() == ["SELF%", "SELF", "TOTAL%", "TOTAL", "FUNCTION"]
    assert lines[2].split()[:5] == ["100.0%", "30", "100.0%", "30", "work"]
    assert lines[3].split()[:5] == ["0.0%", "0", "100.0%", "30", "main"]


@pytest.mark.parametrize("ext", [".svg", ".folded", ".txt", ".json"])
def test_flame_writes_the_format_its_extension_names(
    ext: str, collector: RunningCollector, tmp_path: Path
) -> None:
    push(collector.grpc_target, [make_batch(count=11)])
    out = tmp_path / f"cpu{ext}"
    r = fleetprof("flame", "--collector", collector.url, "-o", str(out))
    assert r.returncode == 0, r.stderr
    body = out.read_text()
    if ext == ".svg":
        root = ET.fromstring(body)
        assert root.tag.endswith("svg")
        assert "work" in body and "<script" in body
    elif ext == ".json":
        import json

        assert json.loads(body)["total"] == 11
    else:
        stacks = parse_folded(body)
        assert [([f.function for f in k], v) for k, v in stacks.items()] == [(["main", "work"], 11)]


def test_flame_refuses_an_unknown_extension(collector: RunningCollector, tmp_path: Path) -> None:
    r = fleetprof("flame", "--collector", collector.url, "-o", str(tmp_path / "x.png"))
    assert r.returncode == 2
    assert "cannot tell the format" in r.stderr and ".svg" in r.stderr


def test_agent_without_privileges_says_what_is_missing_in_one_sentence() -> None:
    r = fleetprof("agent", "--http", f"127.0.0.1:{free_port()}", user="65534")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        "fleetprof agent: the agent must run as root (or with CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN) "
        "to load eBPF programs"
    ]


def test_missing_kernel_headers_are_named(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("this check runs as root (as CI does)")
    problem = missing_prerequisite(modules_root=str(tmp_path))
    assert problem is not None
    assert "kernel headers for" in problem and "scripts/setup.sh" in problem
    assert missing_prerequisite() is None, "this machine should be set up (make test runs scripts/setup.sh)"
