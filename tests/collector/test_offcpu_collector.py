"""Off-CPU time through the collector: the wire's off-CPU section is checked, stored beside the CPU samples
without mixing into them, and served as type=offcpu (nanoseconds) and type=wall (CPU samples x period plus
blocked time) by the API, pprof and Prometheus. The agent side is tested in tests/agent/test_offcpu_bpf.py."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.parse

import grpc
import pytest

from fleetprof._proto.pyroscope import profile_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.collector.test_pyroscope_api import OFFCPU, SAMPLES, WALL, merge, nodes
from tests.conftest import RunningCollector, fleetprof, http_get, start_collector
from tests.support.wire import BatchBuilder, push, stacks_of

HZ = 100
PERIOD_NS = 10_000_000
MS = 1_000_000


def batch(seq: int = 1) -> pb.Batch:
    """web-1: 30 CPU samples in main;serve and 2 s blocked in main;serve;read (1.5 s while its GPU idled),
    0.5 s in main;wait. 0.3 s of CPU is 30 samples x 10 ms."""
    b = BatchBuilder(node="node-a", sequence=seq, frequency_hz=HZ)
    web = b.process(10, "python3", {"namespace": "shop", "pod": "web-1"})
    serve = b.stack([("main", "app"), ("serve", "app")])
    read = b.stack([("main", "app"), ("serve", "app"), ("read", "libc.so.6")])
    wait = b.stack([("main", "app"), ("wait", "app")])
    b.sample(web, serve, 30)
    b.offcpu(web, read, 500 * MS)
    b.offcpu(web, read, 1500 * MS, gpu=pb.GPU_STATE_IDLE)
    b.offcpu(web, wait, 500 * MS)
    return b.build()


@pytest.fixture(scope="module")
def fed(module_collector: RunningCollector) -> RunningCollector:
    assert push(module_collector.grpc_target, [batch()]) == [1]
    return module_collector


def profile(col: RunningCollector, **params: str) -> dict:
    return col.json("/api/v1/profile", **{"since": "10m", **params})


def flat(node: dict, path: tuple = ()) -> dict[tuple[str, ...], int]:
    """(path of names) -> self value of a JSON profile's tree."""
    here = (*path, node["name"]) if path or node["name"] != "all" else ()
    out = {here: node["self"]} if node["self"] else {}
    for child in node["children"]:
        out.update(flat(child, here))
    return out


def test_cpu_profiles_leave_off_cpu_time_out(fed: RunningCollector) -> None:
    body = profile(fed)
    assert (body["type"], body["unit"], body["total"]) == ("cpu", "samples", 30)
    assert flat(body["root"]) == {("main", "serve"): 30}
    assert merge(fed, kind=SAMPLES).flamegraph.total == 30  # Grafana's too
    assert fed.json("/api/v1/top", since="10m")["total"] == 30


def test_off_cpu_profiles_count_blocked_nanoseconds(fed: RunningCollector) -> None:
    body = profile(fed, type="offcpu")
    assert (body["type"], body["unit"], body["total"]) == ("offcpu", "nanoseconds", 2500 * MS)
    assert flat(body["root"]) == {("main", "serve", "read"): 2000 * MS, ("main", "wait"): 500 * MS}
    idle = profile(fed, type="offcpu", gpu="idle")
    assert flat(idle["root"]) == {("main", "serve", "read"): 1500 * MS}
    top = fed.json("/api/v1/top", since="10m", type="offcpu", by="pod")
    assert top["groups"][0]["labels"] == {"pod": "web-1"} and top["groups"][0]["seconds"] == 2.5


def test_wall_profiles_add_cpu_time_and_blocked_time(fed: RunningCollector) -> None:
    body = profile(fed, type="wall")
    assert body["total"] == 30 * PERIOD_NS + 2500 * MS
    assert flat(body["root"]) == {
        ("main", "serve"): 30 * PERIOD_NS,
        ("main", "serve", "read"): 2000 * MS,
        ("main", "wait"): 500 * MS,
    }
    series = fed.json("/api/v1/series", since="10m", type="wall")
    assert sum(n for _, n in series["series"][0]["points"]) == body["total"]


def test_folded_and_pprof_carry_nanoseconds(fed: RunningCollector) -> None:
    q = urllib.parse.urlencode({"since": "10m", "type": "offcpu", "format": "folded"})
    folded = http_get(f"{fed.url}/api/v1/profile?{q}").decode()
    assert f"main;serve;read {2000 * MS}" in folded.splitlines()
    q = urllib.parse.urlencode({"since": "10m", "type": "wall", "format": "pprof"})
    prof = profile_pb2.Profile.FromString(gzip.decompress(http_get(f"{fed.url}/api/v1/profile?{q}")))
    types = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
    assert types == [("wall", "nanoseconds")]
    assert sum(s.value[0] for s in prof.sample) == 30 * PERIOD_NS + 2500 * MS


def test_prometheus_gets_off_cpu_seconds_per_pod(fed: RunningCollector) -> None:
    text = http_get(f"{fed.url}/metrics").decode()
    off = [
        ln
        for ln in text.splitlines()
        if ln.startswith("fleetprof_offcpu_seconds_total{") and 'pod="web-1"' in ln
    ]
    cpu = [
        ln
        for ln in text.splitlines()
        if ln.startswith("fleetprof_cpu_seconds_total{") and 'pod="web-1"' in ln
    ]
    assert len(off) == 1 and float(off[0].rsplit(" ", 1)[1]) == pytest.approx(2.5)
    assert len(cpu) == 1 and float(cpu[0].rsplit(" ", 1)[1]) == pytest.approx(0.3)


def test_the_type_label_is_the_collectors(fed: RunningCollector) -> None:
    assert "__type__" not in fed.json("/api/v1/labels")["labels"]
    with pytest.raises(urllib.error.HTTPError) as info:
        profile(fed, type="heap")
    assert info.value.code == 400 and "type" in json.loads(info.value.read())["error"]


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda b: b.offcpu_columns.blocked_ns.append(5), "offcpu_columns have"),
        (lambda b: b.offcpu_columns.blocked_ns.__setitem__(0, 0), "has blocked_ns 0"),
        (lambda b: b.offcpu_columns.process.__setitem__(0, 9), "off-CPU row 0 refers to process 9"),
        (lambda b: b.offcpu_columns.stack.__setitem__(1, 99), "off-CPU row 1 refers to stack 99"),
        (lambda b: b.offcpu_columns.gpu.__setitem__(2, 7), "off-CPU row 2 has an unknown GPU state 7"),
        (lambda b: b.offcpu_columns.blocked_ns.__setitem__(0, 1 << 60), "has blocked_ns"),
        (lambda b: b.offcpu_columns.idle.extend([True, False]), "2 idle flags"),
    ],
)
def test_bad_off_cpu_rows_are_refused_by_name(mutate, expected: str, collector: RunningCollector) -> None:
    bad = batch()
    mutate(bad)
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [bad])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in info.value.details()


def test_the_durable_store_keeps_off_cpu_time_apart_across_a_restart(tmp_path) -> None:
    col = RunningCollector(start_collector(data_dir=str(tmp_path)))
    try:
        assert push(col.grpc_target, [batch()]) == [1]
    finally:
        col.collector.stop()
    col = RunningCollector(start_collector(data_dir=str(tmp_path)))
    try:
        for since in ("10m", "3h"):  # the hot tier, then DuckDB
            assert profile(col, since=since)["total"] == 30
            assert profile(col, since=since, type="offcpu")["total"] == 2500 * MS
            assert profile(col, since=since, type="wall")["total"] == 30 * PERIOD_NS + 2500 * MS
    finally:
        col.collector.stop()


def test_the_cli_reads_off_cpu_and_wall_time(fed: RunningCollector, tmp_path) -> None:
    top = fleetprof("top", "--collector", fed.url, "--since", "10m", "--type", "offcpu")
    assert top.returncode == 0, top.stderr
    assert "2.5s of offcpu time" in top.stdout
    # By default, where each thread blocked in its own code and why: serve called libc's read. These stacks
    # have no kernel frames, so the reason is unknown (tests/collector/test_waits.py reads real ones).
    (row,) = [line for line in top.stdout.splitlines() if line.rstrip().endswith("serve  [app]")]
    assert row.split()[:3] == ["80.0%", "2.0s", "unknown"], top.stdout
    by_frame = fleetprof("top", "--collector", fed.url, "--since", "10m", "--type", "offcpu", "--by-frame")
    assert by_frame.returncode == 0, by_frame.stderr
    (row,) = [line for line in by_frame.stdout.splitlines() if line.rstrip().endswith("read  [libc.so.6]")]
    assert "80.0%" in row and "2.0s" in row
    out = tmp_path / "wall.folded"
    flame = fleetprof("flame", "--collector", fed.url, "--since", "10m", "--type", "wall", "-o", str(out))
    assert flame.returncode == 0, flame.stderr
    assert f"main;serve {30 * PERIOD_NS}" in out.read_text().splitlines()
    pods = fleetprof("top", "--collector", fed.url, "--since", "10m", "--type", "wall", "--by", "pod")
    assert pods.returncode == 0, pods.stderr
    assert "2.8s of wall time" in pods.stdout and "WALL_S" in pods.stdout
    q = urllib.parse.urlencode({"since": "10m", "type": "offcpu", "format": "svg"})
    svg = http_get(f"{fed.url}/api/v1/profile?{q}").decode()
    assert "Off-CPU flame graph" in svg and f"{2000 * MS} ns" in svg


def test_grafana_gets_off_cpu_and_wall_flame_graphs(fed: RunningCollector) -> None:
    off = merge(fed, kind=OFFCPU).flamegraph
    assert off.total == 2500 * MS
    assert nodes(off)[("total", "main", "serve", "read")] == (2000 * MS, 2000 * MS)
    wall = merge(fed, kind=WALL).flamegraph
    assert wall.total == 30 * PERIOD_NS + 2500 * MS
    assert nodes(wall)[("total", "main", "serve")] == (30 * PERIOD_NS + 2000 * MS, 30 * PERIOD_NS)
    idle = merge(fed, '{gpu_state="idle"}', kind=OFFCPU).flamegraph
    assert idle.total == 1500 * MS


def test_grafana_lists_the_types_each_series_has(fed: RunningCollector) -> None:
    from fleetprof._proto.pyroscope import querier_pb2
    from tests.collector.test_pyroscope_api import CPU, call, now_ms

    req = querier_pb2.SeriesRequest(
        label_names=["pod", "__profile_type__"], start=now_ms() - 600_000, end=now_ms() + 60_000
    )
    res = call(fed, "Series", req, querier_pb2.SeriesResponse)
    got = {tuple((p.name, p.value) for p in s.labels) for s in res.labels_set}
    assert got == {(("__profile_type__", t), ("pod", "web-1")) for t in (CPU, SAMPLES, OFFCPU, WALL)}


def test_an_agent_window_with_off_cpu_rows_is_encoded_and_stored(collector: RunningCollector) -> None:
    """The agent's encoder (agent/batch.py) puts a window's off-CPU rows in the off-CPU section, sharing the
    stack and process tables with the samples; threads of a process with the same stack are summed."""
    import time

    from fleetprof.agent.batch import encode_window
    from fleetprof.agent.model import CgroupIdentity, Frame, ProcessInfo, ResolvedSample, Window

    proc = ProcessInfo(77, 500, "loader", "/usr/bin/loader", CgroupIdentity("/"), ())
    main, load = Frame("main", "loader"), Frame("load_shard", "loader")
    read = Frame("ksys_read", "[kernel]", True)
    end = time.time_ns()
    window = Window(
        end - 10**10,
        end,
        [ResolvedSample(proc, 77, (main, load), 2, 12)],
        offcpu=[
            ResolvedSample(proc, 78, (main, load, read), 2, 700 * MS),
            ResolvedSample(proc, 79, (main, load, read), 2, 300 * MS),
        ],
        frequency_hz=HZ,
    )
    batch = encode_window(window, pb.AgentIdentity(node="n1", agent_id="enc"))
    batch.sequence = 1
    assert list(batch.offcpu_columns.blocked_ns) == [1000 * MS]
    assert not batch.offcpu_columns.idle  # no idle thread: the column is left out
    assert len(stacks_of(batch)) == 2 and len(batch.processes) == 1
    assert push(collector.grpc_target, [batch]) == [1]
    off = profile(collector, type="offcpu", query='{comm="loader"}')
    assert flat(off["root"]) == {("main", "load_shard", "ksys_read"): 1000 * MS}
    assert profile(collector, query='{comm="loader"}')["total"] == 12


def test_idle_threads_waits_stay_out_of_wall_views_unless_asked_for(collector: RunningCollector) -> None:
    """A pool thread's wait (the agent marks its row idle) counts in off-CPU views and in wall views with
    threads=all, not in default wall views: 0.3 s of CPU and 1 s of a working thread's wait against 40 s of
    a sleeping pool's."""
    b = BatchBuilder(node="node-i", sequence=1, frequency_hz=HZ)
    job = b.process(20, "trainer", {"namespace": "ml", "pod": "job-1"})
    step = b.stack([("main", "app"), ("step", "app")])
    sync = b.stack([("main", "app"), ("step", "app"), ("sync", "libcuda")])
    pool = b.stack([("worker_loop", "libgomp"), ("futex_wait", "libc.so.6")])
    b.sample(job, step, 30)
    b.offcpu(job, sync, 1000 * MS)
    b.offcpu(job, pool, 40_000 * MS, idle=True)
    assert push(collector.grpc_target, [b.build()]) == [1]
    q = '{pod="job-1"}'
    off = profile(collector, query=q, type="offcpu")
    assert off["total"] == 41_000 * MS
    assert profile(collector, query=q, type="offcpu", threads="active")["total"] == 1000 * MS
    wall = profile(collector, query=q, type="wall")
    assert flat(wall["root"]) == {("main", "step"): 30 * PERIOD_NS, ("main", "step", "sync"): 1000 * MS}
    everything = profile(collector, query=q, type="wall", threads="all")
    assert everything["total"] == 30 * PERIOD_NS + 41_000 * MS
    assert merge(collector, q, kind=WALL).flamegraph.total == 30 * PERIOD_NS + 1000 * MS  # Grafana's wall
    groups = collector.json("/api/v1/top", since="10m", type="wall", by="pod", query=q)["groups"]
    assert groups[0]["seconds"] == 1.3
    labels = collector.json("/api/v1/labels")["labels"]
    assert "__thread__" not in labels and "__type__" not in labels
    with pytest.raises(urllib.error.HTTPError) as info:
        profile(collector, query=q, type="wall", threads="sleeping")
    assert info.value.code == 400 and "threads" in json.loads(info.value.read())["error"]
    top = fleetprof(
        "top", "--collector", collector.url, "--since", "10m", "--type", "wall", "--threads", "all"
    )
    assert top.returncode == 0, top.stderr
    # The pool's 40 s wait ranks under its own frame (libc's futex_wait is the C runtime); the CPU samples
    # run. These stacks carry no kernel frames, so the wait's reason is unknown.
    rows = [line.split() for line in top.stdout.splitlines()[2:]]
    assert [(r[2], r[3]) for r in rows] == [
        ("unknown", "worker_loop"),
        ("unknown", "sync"),
        ("running", "step"),
    ]
    by_frame = fleetprof(
        "top",
        "--collector",
        collector.url,
        "--since",
        "10m",
        "--type",
        "wall",
        "--threads",
        "all",
        "--by-frame",
    )
    assert by_frame.returncode == 0, by_frame.stderr
    assert "futex_wait" in by_frame.stdout


def test_top_ranks_off_cpu_and_wall_by_where_threads_blocked_unless_asked_by_frame(
    fed: RunningCollector,
) -> None:
    off = fed.json("/api/v1/top", since="10m", type="offcpu")
    assert off["rank"] == "blocked" and off["total"] == 2500 * MS
    assert [(f["function"], f["reason"], f["value"]) for f in off["functions"]] == [
        ("serve", "unknown", 2000 * MS),
        ("wait", "unknown", 500 * MS),
    ]
    wall = fed.json("/api/v1/top", since="10m", type="wall")
    assert wall["rank"] == "blocked" and wall["total"] == 30 * PERIOD_NS + 2500 * MS
    assert ("serve", "running", 30 * PERIOD_NS) in [
        (f["function"], f["reason"], f["value"]) for f in wall["functions"]
    ]
    by_frame = fed.json("/api/v1/top", since="10m", type="offcpu", rank="frame")
    assert by_frame["rank"] == "frame" and by_frame["functions"][0]["function"] == "read"
    assert fed.json("/api/v1/top", since="10m")["rank"] == "frame"  # CPU samples rank by frame
    for params, word in (({"rank": "blocked"}, "rank"), ({"type": "offcpu", "sort": "total"}, "sort")):
        with pytest.raises(urllib.error.HTTPError) as info:
            fed.json("/api/v1/top", since="10m", **params)
        assert info.value.code == 400 and word in json.loads(info.value.read())["error"]
