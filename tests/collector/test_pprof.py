"""Our pprof output (format=pprof, `fleetprof flame -o x.pb.gz`) as the real `go tool pprof` reads it."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.pprof import _varint, to_pprof
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.profiles import FREQUENCY_HZ, PROFILE, push_profile, wide_rows

_ROW = re.compile(r"^\s*(\d+(?:\.\d+)?)(?:ms)?\s+\S+%\s+\S+%\s+(\d+(?:\.\d+)?)(?:ms)?\s+\S+%\s+(.+?)\s*$")


def go_binary() -> str:
    """`go` from Debian's golang-go; without it the test fails (never skips): CI must not pass without it."""
    go = shutil.which("go") or next((p for p in ("/usr/lib/go/bin/go",) if Path(p).exists()), None)
    if go is None:
        pytest.fail("`go tool pprof` is needed: run `scripts/setup.sh --test` (installs Debian's golang-go)")
    return go


def pprof(path: Path, *args: str) -> str:
    r = subprocess.run(
        [go_binary(), "tool", "pprof", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(path.parent), "PPROF_TMPDIR": str(path.parent)},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def pprof_top(path: Path, *args: str) -> dict[str, tuple[float, float]]:
    """function -> (flat ms, cum ms) from `go tool pprof -top -unit=ms`, every node shown."""
    out = pprof(path, "-top", "-unit=ms", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0", *args)
    rows = {}
    for line in out.splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(3)] = (float(m.group(1)), float(m.group(2)))
    assert rows, out
    return rows


@pytest.fixture(scope="module")
def profiled(module_collector: RunningCollector) -> RunningCollector:
    push_profile(module_collector.grpc_target, PROFILE)
    return module_collector


def fetch_pprof(col: RunningCollector, tmp_path: Path, **params: str) -> Path:
    q = urllib.parse.urlencode({"since": "10m", "format": "pprof", **params})
    out = tmp_path / "cpu.pb.gz"
    out.write_bytes(http_get(f"{col.url}/api/v1/profile?{q}"))
    return out


def test_go_tool_pprof_reads_flat_and_cum_cpu_time_per_function(
    profiled: RunningCollector, tmp_path: Path
) -> None:
    path = fetch_pprof(profiled, tmp_path)
    ms_per_sample = 1000 / FREQUENCY_HZ
    top = pprof_top(path)
    # hot_loop: 300 samples; cold_path runs in both processes (60 + 40); sys_read is a kernel leaf.
    assert top["hot_loop"] == (300 * ms_per_sample, 300 * ms_per_sample)
    assert top["sys_read"] == (40 * ms_per_sample, 40 * ms_per_sample)
    assert top["cold_path"] == (60 * ms_per_sample, 100 * ms_per_sample)
    assert top["run"] == (0, 360 * ms_per_sample)
    assert top["main"] == (0, 400 * ms_per_sample)
    assert top["accept_loop"] == (0, 40 * ms_per_sample)


def test_pprof_has_cpu_nanoseconds_period_from_frequency_and_sample_counts(
    profiled: RunningCollector, tmp_path: Path
) -> None:
    path = fetch_pprof(profiled, tmp_path, query='{pod="trainer-0"}')
    raw = pprof(path, "-raw")
    assert "PeriodType: cpu nanoseconds" in raw
    assert f"Period: {1_000_000_000 // FREQUENCY_HZ}" in raw
    assert "samples/count cpu/nanoseconds" in raw
    assert '{pod="trainer-0"}' in raw  # the selection is written as a comment
    counts = pprof(path, "-top", "-sample_index=samples", "-nodefraction=0")
    assert re.search(r"^\s*300\s+83\.33%.*hot_loop$", counts, re.M), counts
    assert "accept_loop" not in counts


def test_kernel_frames_are_filed_under_the_kernel(profiled: RunningCollector, tmp_path: Path) -> None:
    raw = pprof(fetch_pprof(profiled, tmp_path), "-raw")
    assert re.search(r"sys_read \[kernel\.kallsyms\]", raw), raw
    assert re.search(r"hot_loop /app/worker", raw), raw


def test_max_nodes_merges_the_tail_into_other_and_keeps_the_total(
    module_collector: RunningCollector, tmp_path: Path
) -> None:
    rows = wide_rows(6, 3, comm="wide-pprof")
    push_profile(module_collector.grpc_target, rows)
    total_ms = sum(r[5] for r in rows) * 1000 / FREQUENCY_HZ
    full = pprof_top(fetch_pprof(module_collector, tmp_path, query='{comm="wide-pprof"}'))
    cut = pprof_top(fetch_pprof(module_collector, tmp_path, query='{comm="wide-pprof"}', max_nodes="20"))
    assert len(full) == 18  # f{level}_{i}: six names per level, each under several parents
    assert len(cut) <= 21 and "other" in cut
    assert sum(flat for flat, _ in full.values()) == pytest.approx(total_ms)
    assert sum(flat for flat, _ in cut.values()) == pytest.approx(total_ms)


def test_unknown_frequency_writes_sample_counts_only(tmp_path: Path) -> None:
    path = tmp_path / "x.pb.gz"
    path.write_bytes(to_pprof({(FrameKey("a", "m"), FrameKey("b", "m")): 7, (): 2}, None))
    raw = pprof(path, "-raw")
    assert "samples/count" in raw and "nanoseconds" not in raw
    top = pprof(path, "-top", "-nodefraction=0")
    assert re.search(r"^\s*7\s+77\.78%.*\bb$", top, re.M), top
    assert re.search(r"^\s*2\s+22\.22%.*\[unknown\]$", top, re.M), top


def test_output_is_gzip_of_a_deterministic_message() -> None:
    stacks = {(FrameKey("a", "m"),): 3}
    body = to_pprof(stacks, 19)
    assert body == to_pprof(stacks, 19) and gzip.decompress(body)
    assert _varint(300) == b"\xac\x02" and _varint(-1) == b"\xff" * 9 + b"\x01"


def test_flame_cli_writes_pprof_for_pb_gz(profiled: RunningCollector, tmp_path: Path) -> None:
    out = tmp_path / "cli.pb.gz"
    r = fleetprof("flame", "--collector", profiled.url, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "(pprof," in r.stdout
    assert pprof_top(out)["hot_loop"][0] == 300 * 1000 / FREQUENCY_HZ
