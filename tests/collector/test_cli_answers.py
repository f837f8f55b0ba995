"""What the query commands answer, through the real `fleetprof` process against a real collector fed over
gRPC: Python functions ranked once (their lines on request), warnings about labels no series has, an empty
answer that says whether the selector or the range was empty, host processes grouped by comm, and the flag
forms people type (HOST:PORT, $FLEETPROF_COLLECTOR, "--since -5m")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
from collections.abc import Iterator

import pytest

from tests.conftest import REPO, RunningCollector, fleetprof, http_get, start_collector
from tests.support.profiles import Row, push_profile

PY = "/srv/hot.py"
PYTHON = "/usr/bin/python3.11"
# checksum_rows runs its lines 6 and 7 (40 samples: 31 + 9); parse_rows line 12 (20); a host sha256sum 25.
# The service is in a pod; sha256sum and a second host process (a shell) are not.
ROWS: list[Row] = [
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("<module> (hot.py:20)", PY), ("checksum_rows (hot.py:7)", PY)], 3, 31),
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("<module> (hot.py:20)", PY), ("checksum_rows (hot.py:6)", PY)], 3, 9),
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("<module> (hot.py:21)", PY), ("parse_rows (hot.py:12)", PY)], 3, 20),
    (400, "sha256sum", {}, [("main", "/usr/bin/sha256sum"), ("sha256_block", "/usr/bin/sha256sum")], 2, 25),
    (500, "bash", {}, [("main", "/usr/bin/bash"), ("readline", "/usr/bin/bash")], 2, 15),
]  # fmt: skip
TOTAL = 100


@pytest.fixture(scope="module")
def fed() -> Iterator[RunningCollector]:
    col = start_collector()
    try:
        running = RunningCollector(col)
        push_profile(running.grpc_target, ROWS)
        yield running
    finally:
        col.stop()


_TOP_ROW = re.compile(r"\s*(\S+)\s+(\S+)\s+(\S+)\s+(\S+)  (.*?)(?:  \[[^]]*\])?")


def top_rows(stdout: str) -> dict[str, tuple[str, ...]]:
    """`fleetprof top`'s table: function name (without its module) -> (self%, self, total%, total)."""
    rows = {}
    for line in stdout.splitlines()[2:]:
        match = _TOP_ROW.fullmatch(line)
        assert match, line
        rows[match[5]] = match.groups()[:4]
    return rows


def test_top_ranks_a_python_function_once_and_its_lines_with_lines(fed: RunningCollector) -> None:
    r = fleetprof("top", "--collector", fed.url, "--since", "10m")
    assert r.returncode == 0, r.stderr
    rows = top_rows(r.stdout)
    # 31 + 9 of 100 samples: one row, named without a line, first.
    assert rows["checksum_rows (hot.py)"] == ("40.0%", "40", "40.0%", "40")
    assert r.stdout.splitlines()[2].endswith("checksum_rows (hot.py)  [/srv/hot.py]")
    assert rows["<module> (hot.py)"] == ("0.0%", "0", "60.0%", "60")
    assert not any(":" in name for name in rows if "hot.py" in name)

    by_line = fleetprof("top", "--collector", fed.url, "--since", "10m", "--lines")
    assert by_line.returncode == 0, by_line.stderr
    lines = top_rows(by_line.stdout)
    assert lines["checksum_rows (hot.py:7)"] == ("31.0%", "31", "31.0%", "31")
    assert lines["checksum_rows (hot.py:6)"] == ("9.0%", "9", "9.0%", "9")
    assert "checksum_rows (hot.py)" not in lines


def test_the_api_lists_the_lines_a_function_row_holds(fed: RunningCollector) -> None:
    top = fed.json("/api/v1/top", since="10m")
    row = next(f for f in top["functions"] if f["function"] == "checksum_rows (hot.py)")
    assert (row["self"], row["lines"], row["module"]) == (40, [6, 7], PY)
    assert top["lines"] is False and top["warnings"] == [] and top["empty_reason"] is None
    apart = fed.json("/api/v1/top", since="10m", lines="1")
    assert {f["function"] for f in apart["functions"]} >= {
        "checksum_rows (hot.py:7)",
        "checksum_rows (hot.py:6)",
    }
    assert not any("lines" in f for f in apart["functions"])
    # The flame graph keeps lines.
    folded = fed.folded("{}")
    assert sorted(f.function for stack in folded for f in stack if "checksum" in f.function) == [
        "checksum_rows (hot.py:6)",
        "checksum_rows (hot.py:7)",
    ]
    with pytest.raises(urllib.error.HTTPError) as info:
        http_get(f"{fed.url}/api/v1/top?since=10m&lines=maybe")
    assert info.value.code == 400 and '"lines" must be 0 or 1' in json.loads(info.value.read())["error"]


def test_diff_ranks_functions_and_lines_on_request(fed: RunningCollector) -> None:
    args = ("diff", "--collector", fed.url, "--since", "10m", "--query", '{pod="api-0"}', "--query2", "{}")
    r = fleetprof(*args)
    assert r.returncode == 0, r.stderr
    # checksum_rows: 40 of api-0's 60 samples (66.67%) against 40 of all 100 (40.00%).
    row = next(
        line for line in r.stdout.splitlines() if line.endswith("checksum_rows (hot.py)  [/srv/hot.py]")
    )
    assert row.split()[:3] == ["66.67%", "40.00%", "-26.67"]
    by_line = fleetprof(*args, "--lines")
    assert by_line.returncode == 0, by_line.stderr
    row = next(line for line in by_line.stdout.splitlines() if "checksum_rows (hot.py:7)" in line)
    assert row.split()[:3] == ["51.67%", "31.00%", "-20.67"]
    assert "checksum_rows (hot.py)" not in by_line.stdout


def test_by_pod_groups_processes_outside_pods_by_comm(fed: RunningCollector) -> None:
    r = fleetprof("top", "--collector", fed.url, "--since", "10m", "--by", "pod")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[2:]]
    assert rows == [
        ["api-0", "60.0%", "0.6", "60"],
        ["comm:sha256sum", "25.0%", "0.2", "25"],
        ["comm:bash", "15.0%", "0.1", "15"],
    ]
    assert r.stderr == ""  # pod is a label of this range: nothing to warn about
    pods = fleetprof("pods", "--collector", fed.url, "--since", "10m")
    assert pods.returncode == 0, pods.stderr
    assert "comm:sha256sum" in pods.stdout and "comm:bash" in pods.stdout


def test_without_kubernetes_by_pod_groups_by_comm_and_says_why() -> None:
    """A node without pod metadata: every process is a host process. `--by pod` printed one row "-" at
    100% and nothing else; now each process name is a row, and stderr says why."""
    col = start_collector()
    try:
        running = RunningCollector(col)
        push_profile(running.grpc_target, [r for r in ROWS if not r[2]])  # sha256sum 25, bash 15
        r = fleetprof("top", "--collector", running.url, "--since", "10m", "--by", "pod")
        assert r.returncode == 0, r.stderr
        assert [line.split() for line in r.stdout.splitlines()[2:]] == [
            ["comm:sha256sum", "62.5%", "0.2", "25"],
            ["comm:bash", "37.5%", "0.1", "15"],
        ]
        assert r.stderr.splitlines() == [
            'fleetprof top: warning: no series in this range has the label "pod" (no Kubernetes metadata?):'
            " processes without a pod are grouped as comm:NAME; the labels in this range: comm, node, pid"
        ]
    finally:
        col.stop()


def test_a_label_no_series_has_is_named_with_the_labels_there_are(fed: RunningCollector) -> None:
    r = fleetprof("top", "--collector", fed.url, "--since", "10m", "--by", "nosuchlabel")
    assert r.returncode == 0, r.stderr
    (warning,) = r.stderr.splitlines()
    assert warning == (
        'fleetprof top: warning: no series in this range has the label "nosuchlabel"; the labels in this'
        " range: comm, namespace, node, pid, pod"
    )
    assert r.stdout.splitlines()[2].split() == ["-", "100.0%", "1.0", "100"]


def test_a_selector_that_matched_nothing_is_told_apart_from_an_empty_range(fed: RunningCollector) -> None:
    r = fleetprof("top", "--collector", fed.url, "--since", "10m", "--query", '{nosuch="x"}')
    assert r.returncode == 0, r.stderr
    assert "the selector matched nothing in this range" in r.stdout
    assert "is an agent running" not in r.stdout
    assert r.stderr.splitlines() == [
        'fleetprof top: warning: no series in this range has the label "nosuch"; the labels in this range:'
        " comm, namespace, node, pid, pod",
        'fleetprof top: warning: the selector {nosuch="x"} matched nothing in this range, which holds other'
        " data",
    ]
    # A known label with a value nobody has: no label warning, the selector still matched nothing.
    r = fleetprof("top", "--collector", fed.url, "--since", "10m", "--query", '{comm="nginx"}')
    assert "the selector matched nothing in this range" in r.stdout
    assert [ln.split(": warning: ")[1] for ln in r.stderr.splitlines()] == [
        'the selector {comm="nginx"} matched nothing in this range, which holds other data'
    ]
    # Nothing stored in the range at all: the old hint, and no warnings.
    empty = fleetprof(
        "top", "--collector", fed.url, "--from", "now-3h", "--until", "now-2h", "--query", '{nosuch="x"}'
    )
    assert empty.returncode == 0, empty.stderr
    assert "no samples in this range (is an agent running" in empty.stdout and empty.stderr == ""
    answer = fed.json("/api/v1/top", since="10m", query='{nosuch="x"}')
    assert answer["empty_reason"] == "no_match" and len(answer["warnings"]) == 2


def test_the_collector_is_given_as_a_url_host_port_or_by_environment(fed: RunningCollector) -> None:
    hostport = fed.url.removeprefix("http://")
    plain = fleetprof("top", "--collector", fed.url, "--since", "10m").stdout
    assert "checksum_rows" in plain
    r = fleetprof("top", "--collector", hostport, "--since", "10m")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == plain.splitlines()[1:]
    by_env = subprocess.run(
        [sys.executable, "-m", "fleetprof.cli", "top", "--since", "10m"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "FLEETPROF_COLLECTOR": hostport},
        timeout=60,
    )
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout.splitlines()[1:] == plain.splitlines()[1:]
    bad = fleetprof("top", "--collector", "ftp://x:1")
    assert bad.returncode == 2 and "expected http://HOST:PORT, https://HOST:PORT or HOST:PORT" in bad.stderr


def test_a_window_written_with_a_dash_reads_as_the_last_minutes(fed: RunningCollector) -> None:
    spaced = fleetprof("top", "--collector", fed.url, "--since", "-10m")
    glued = fleetprof("top", "--collector", fed.url, "--since=-10m")
    plain = fleetprof("top", "--collector", fed.url, "--since", "10m")
    for r in (spaced, glued, plain):
        assert r.returncode == 0, r.stderr
    assert spaced.stdout.splitlines()[1:] == glued.stdout.splitlines()[1:] == plain.stdout.splitlines()[1:]
    assert "100 samples" in spaced.stdout.splitlines()[0]
    since = fleetprof("top", "--collector", fed.url, "--from", "-10m", "--until", "-0s")
    assert since.returncode == 0, since.stderr
    assert "100 samples" in since.stdout.splitlines()[0]


def test_diff_without_a_second_side_names_the_flags_to_give() -> None:
    r = fleetprof("diff")
    assert r.returncode == 2
    assert "--query2 SELECTOR" in r.stderr and "--since2 DURATION" in r.stderr and "--from2" in r.stderr
    assert '"query2"' not in r.stderr and "Traceback" not in r.stderr


def test_the_collectors_refusals_name_flags_not_parameters(fed: RunningCollector) -> None:
    r = fleetprof("diff", "--collector", fed.url, "--since", "10m", "--from2", "yesterday")
    assert r.returncode == 1
    assert 'bad --from2: invalid time "yesterday"' in r.stderr


def test_help_shows_defaults_and_names_values() -> None:
    top = fleetprof("top", "--help").stdout
    for text in ("--limit N", "rows to print (default: 20)", "--from TIME", "--since DURATION", "--lines"):
        assert text in top, text
    assert "FROM_" not in top and "(default: None)" not in top
    assert "$FLEETPROF_COLLECTOR" in top and "http://127.0.0.1:7471" in " ".join(top.split())
    agent = fleetprof("agent", "--help").stdout
    assert "(default: 127.0.0.1:7470)" in " ".join(agent.split())
