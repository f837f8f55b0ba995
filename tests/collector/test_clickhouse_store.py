"""The ClickHouse store answers every query as the DuckDB store does, on Debian's clickhouse-server 18.16
(the native protocol, a real server) and on chdb (ClickHouse 26.x in this process, today's engine).

One corpus of batches (a real agent's, captured over gRPC while it profiles a CPU-bound and a read-bound
workload with off-CPU and syscalls on, plus tests/support/wire.py batches with off-CPU rows of idle and active
threads, GPU-tagged samples, syscalls, names folded text escapes, an empty stack, and the GPU poller's batch)
goes through real gRPC ingest into a DuckDB collector and a ClickHouse collector. Every query type (profile
in each format that carries no timestamp, top, top by labels, series, diff, syscalls, GPU usage, labels,
off-CPU and wall with both thread choices, and Grafana's Connect methods) is then asked of both with one
clock, and the answers must be byte for byte equal. At the store level, rows 10 minutes to 4 days old (each
resolution: 10 s, 1 min, 10 min, and past retention) must answer the same at a clock days later. And a
ClickHouse that cannot be used stops the collector at start with one line that says why.
"""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2, types_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.peer import ANONYMOUS, Peer
from fleetprof.collector.ingest.service import IngestService, serve_ingest
from fleetprof.collector.main import Collector, CollectorConfig
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey, SyscallAgg
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.service import QueryService
from fleetprof.collector.serve.http import HttpApi
from fleetprof.collector.serve.pyroscope import Querier
from fleetprof.collector.store.clickhouse import (
    ClickHouseStartError,
    ClickHouseStore,
    open_clickhouse,
    parse_url,
)
from fleetprof.collector.store.clickhouse.connection import NativeConnection
from fleetprof.collector.store.clickhouse.schema import Layout, upgrade_ddl
from fleetprof.collector.store.durable import KEY_FILE
from fleetprof.httpserve import Request
from tests.conftest import REPO, free_port, start_agent, stop_agent, wait_until
from tests.support.chdb_connection import ChdbConnection
from tests.support.clickhouse_servers import ClickHouse, scratch
from tests.support.cpu_time import CPU_BOUND_TIMEOUT_S
from tests.support.gpu_batches import gpu_batch
from tests.support.stores import open_durable
from tests.support.wire import BatchBuilder, hist, push, with_syscalls

pytestmark = pytest.mark.clickhouse

MS = 1_000_000
_names = itertools.count(1)


# -- the corpus ----------------------------------------------------------------------------------------
class _Recorder(IngestService):
    """Acknowledges every batch and keeps its wire bytes: a real agent's batches, as they came."""

    def __init__(self) -> None:
        super().__init__(store=None, ids=ContentIds())  # type: ignore[arg-type]  # nothing is stored
        self.payloads: list[bytes] = []

    def ingest(self, batch: pb.Batch, payload: bytes | None = None, peer: Peer = ANONYMOUS) -> bool:
        self.payloads.append(payload or batch.SerializeToString())
        return True


@pytest.fixture(scope="module")
def agent_batches(workload_bin: Callable[[str], Path]) -> list[bytes]:
    """A real agent's batches (BPF, 99 Hz, 1 s windows, off-CPU and syscalls on) over ~5 s of a CPU-bound
    and a read-bound workload."""
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    serve_ingest(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    agent = start_agent(f"127.0.0.1:{port}", 99, 1.0)
    try:
        work = [
            subprocess.Popen([workload_bin("two_funcs"), "3", "70"], stdout=subprocess.DEVNULL),
            subprocess.Popen([workload_bin("read_zero"), "3"], stdout=subprocess.DEVNULL),
        ]
        for w in work:
            w.wait(timeout=CPU_BOUND_TIMEOUT_S)  # sized by CPU time: 3 s of it took over 60 s at load 17
        n = len(recorder.payloads)
        wait_until(lambda: len(recorder.payloads) >= n + 2, 30, "two more of the agent's windows")
    finally:
        stop_agent(agent)
        server.stop(grace=1).wait()
    return list(recorder.payloads)


def wire_batches(monkeypatch: pytest.MonkeyPatch) -> list[pb.Batch]:
    """Batches with what a short agent run may lack: idle and active off-CPU rows, GPU-tagged samples,
    syscalls with latency histograms, escaped names, an empty stack, two frequencies, a GPU section, CUDA
    launches, kernel time, calls and GPU activity."""
    out = []
    now = time.time_ns()
    for seq, (node, hz) in enumerate((("node-a", 49), ("node-b", 19), ("node-a", 49)), start=1):
        b = BatchBuilder(node=node, agent_id=f"wire-{node}", sequence=seq, end_ns=now - seq * 10**9 * 7,
                         window_s=5.0, frequency_hz=hz)  # fmt: skip
        trainer = b.process(
            1001, "trainer", {"namespace": "ml", "pod": f"trainer-{seq}", "container": "main"}
        )
        loader = b.process(1002, "loader", {"namespace": "ml", "pod": "trainer-0", "container": "data"})
        host = b.process(1, "systemd", exe="/usr/lib/systemd/systemd")
        deep = b.stack([(f"frame_{i}", "libdeep.so") for i in range(40)])
        odd = b.stack([("a;b", "m"), ("line\nbreak", "m"), ("tab\tand space", ""), ("ünïcødé 🔥", "m")])
        kern = b.stack([("main", "app"), ("read", "libc"), ("ksys_read", "[kernel]")], kernel_start=2)
        empty = b.stack([])
        b.sample(trainer, deep, 30 + seq, pb.GPU_STATE_BUSY)
        b.sample(trainer, kern, 9, pb.GPU_STATE_IDLE)
        b.sample(loader, odd, 4 * seq)
        b.sample(host, empty, 2)
        b.sample(host, kern, 1)
        b.offcpu(trainer, kern, 700 * MS * seq, pb.GPU_STATE_IDLE)
        b.offcpu(loader, odd, 300 * MS, idle=True)
        b.offcpu(loader, deep, 123 * MS + seq)
        # CUDA: launches (one GPU-tagged), kernel time, API calls and exact GPU activity
        gemm = b.stack([("main", "app"), ("step", "app"), ("ampere_sgemm_128x64_nn", "libcublasLt.so.12")])
        b.cuda_launch(trainer, gemm, 40 * seq, pb.GPU_STATE_IDLE)
        b.cuda_launch(trainer, odd, 3)
        b.gpu_kernel(trainer, gemm, 90 * MS + seq)
        b.gpu_kernel(host, b.stack([("void k<float>(float*)", "[cuda]")]), 7_000)
        b.cuda_call(trainer, "cudaStreamSynchronize", 10 * seq, 12 * MS, hist(b20=4, b23=6 * seq - 4))
        b.cuda_call(loader, "cudaMalloc", 2, 4_000, hist(b11=2))
        b.cuda_activity(
            trainer, 0, known_ns=4_000 * MS, gaps_ns=[5 * MS, 20_000 * seq, 300 * MS], uuid="GPU-x"
        )
        out.append(
            with_syscalls(
                b.build(),
                [("read", 50 * seq, 5, 5 * 2_000, hist(b10=3, b11=2)), ("futex", 7, 1, 90_000, hist(b16=1))],
            )  # fmt: skip
        )
    gpu = gpu_batch(monkeypatch)
    gpu.agent.agent_id = "wire-gpu"
    out.append(gpu)
    return out


@pytest.fixture(scope="module")
def corpus(agent_batches: list[bytes]) -> list[bytes]:
    with pytest.MonkeyPatch.context() as mp:
        wire = [b.SerializeToString() for b in wire_batches(mp)]
    return agent_batches + wire


# -- backends ------------------------------------------------------------------------------------------
def backend_connection(
    kind: str, server: ClickHouse, chdb: object
) -> tuple[NativeConnection | ChdbConnection, str]:
    database = f"fp{next(_names)}"
    if kind == "server":
        return NativeConnection(parse_url(f"{server.url}/{database}")), database
    return ChdbConnection(chdb), database


def clickhouse_store(kind: str, server: ClickHouse, chdb: object, **kwargs: object) -> ClickHouseStore:
    conn, database = backend_connection(kind, server, chdb)
    if kind == "server":
        return open_clickhouse(parse_url(f"{server.url}/{database}"), connection=conn, **kwargs)  # type: ignore[arg-type]
    return ClickHouseStore(conn, Layout(database, None), **kwargs)  # type: ignore[arg-type]


BACKENDS = ["server", "chdb"]


@pytest.fixture(scope="module", params=BACKENDS)
def pair(
    request: pytest.FixtureRequest,
    corpus: list[bytes],
    server: ClickHouse,
    chdb: object,
) -> Iterator[tuple[Collector, Collector]]:
    """A DuckDB collector and a ClickHouse collector, each fed the corpus through gRPC."""
    tmp = scratch(f"pair-{request.param}")
    ch_store = clickhouse_store(request.param, server, chdb, retention_s=7 * 86400.0)
    cols = []
    for store, data_dir in ((None, str(tmp / "duckdb")), (ch_store, None)):
        cfg = CollectorConfig(grpc="127.0.0.1:0", http=f"127.0.0.1:{free_port()}", data_dir=data_dir)
        col = Collector(cfg, store=store, ids=store.ids if store is not None else None)
        col.start()
        cols.append(col)
    try:
        for col in cols:
            target = f"127.0.0.1:{col.grpc_port}"
            for payload in corpus:
                batch = pb.Batch.FromString(payload)
                assert push(target, [batch]) == [batch.sequence]
        yield cols[0], cols[1]
    finally:
        for col in cols:
            col.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# -- the differential ----------------------------------------------------------------------------------
def _queries(start: float, end: float) -> list[tuple[str, dict[str, str]]]:
    mid = (start + end) / 2
    rng = {"from": repr(start), "until": repr(end)}
    first = {"from": repr(start), "until": repr(mid)}
    second = {"since": "", "from2": repr(mid), "until2": repr(end)}
    out: list[tuple[str, dict[str, str]]] = []
    # cpu counts every thread; offcpu and wall, each with its default and the other choice
    for kind, threads in (("cpu", ""), ("offcpu", ""), ("offcpu", "active"), ("wall", ""), ("wall", "all"),
                          ("cuda_launch", ""), ("gpu", "")):  # fmt: skip
        t = {"type": kind, **({"threads": threads} if threads else {})}
        out += [
            ("/api/v1/profile", {**rng, **t, "format": "json"}),
            ("/api/v1/profile", {**rng, **t, "format": "folded"}),
            ("/api/v1/profile", {**rng, **t, "format": "grafana"}),
            ("/api/v1/profile", {**rng, **t, "format": "json", "query": '{namespace="ml"}', "gpu": "idle"}),
            ("/api/v1/top", {**rng, **t, "limit": "50"}),
            (
                "/api/v1/top",
                {**rng, **t, "sort": "total", "rank": "frame", "query": '{comm=~"tr.*|two_funcs"}'},
            ),
            ("/api/v1/top", {**rng, **t, "by": "namespace,pod"}),
            ("/api/v1/series", {**rng, **t, "step": "10", "by": "comm"}),
            ("/api/v1/series", {**rng, **t, "step": "7.5", "by": "node", "query": '{node!="node-b"}'}),
            ("/api/v1/diff", {**first, **second, **t, "format": "json"}),
            ("/api/v1/diff", {**rng, **t, "query2": '{node="node-a"}', "format": "json"}),
            ("/api/v1/gpus", {**rng, **t}),
        ]
    out += [
        ("/api/v1/syscalls", {**rng, "by": "syscall"}),
        ("/api/v1/syscalls", {**rng, "by": "pod,syscall", "sort": "count"}),
        ("/api/v1/syscalls", {**rng, "by": "comm", "query": '{comm!="systemd"}'}),
        ("/api/v1/cuda", {**rng}),
        ("/api/v1/cuda", {**rng, "by": "call", "sort": "count"}),
        ("/api/v1/cuda", {**rng, "by": "comm,call", "query": '{namespace="ml"}'}),
        ("/api/v1/labels", rng),
        ("/api/v1/labels/comm/values", rng),
        ("/api/v1/labels/node/values", rng),
        ("/api/v1/profile", {**rng, "format": "svg"}),
        ("/api/v1/profile", {**rng, "format": "speedscope"}),
        ("/api/v1/profile?format=pprof", {**rng, "format": "pprof"}),
    ]
    return out


def _connect_calls(start: float, end: float) -> list[tuple[str, object]]:
    s, e = int(start * 1000), int(end * 1000)
    out: list[tuple[str, object]] = [
        ("ProfileTypes", querier_pb2.ProfileTypesRequest(start=s, end=e)),
        ("LabelNames", types_pb2.LabelNamesRequest(start=s, end=e)),
        ("LabelValues", types_pb2.LabelValuesRequest(name="comm", start=s, end=e)),
        ("Series", querier_pb2.SeriesRequest(matchers=["{}"], label_names=["comm", "node"], start=s, end=e)),
    ]
    for kind in (
        "process_cpu:cpu:nanoseconds:cpu:nanoseconds",
        "process_cpu:samples:count:cpu:nanoseconds",
        "process_offcpu:offcpu:nanoseconds:offcpu:nanoseconds",
        "wall:wall:nanoseconds:wall:nanoseconds",
        "cuda_launch:launches:count:launches:count",
        "gpu:gpu:nanoseconds:gpu:nanoseconds",
    ):
        sel = {"profile_typeID": kind, "start": s, "end": e}
        out += [
            ("SelectMergeStacktraces", querier_pb2.SelectMergeStacktracesRequest(label_selector="{}", **sel)),
            (
                "SelectSeries",
                querier_pb2.SelectSeriesRequest(
                    label_selector='{namespace="ml"}', step=10.0, group_by=["pod"], **sel
                ),
            ),
            ("SelectMergeProfile", querier_pb2.SelectMergeProfileRequest(label_selector="{}", **sel)),
        ]
    return out


def _answer(handler: Callable[[Request], object], req: Request) -> tuple[int, bytes]:
    resp = handler(req)
    return resp.status, resp.body  # type: ignore[attr-defined]


def _canonical(value: object) -> object:
    """A JSON answer with its lists of objects as sorted multisets: two stores return equal-ranked groups
    (ties) and the stacks of a profile in their own orders; everything else compares as it is."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        if items and all(isinstance(v, dict) for v in items):
            return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
        return items
    return value


def _pprof_view(body: bytes) -> object:
    """A pprof profile as what it says: sample types, period, time range, and value per stack of names
    (the order of samples, locations and strings is each store's dict order)."""
    prof = profile_pb2.Profile.FromString(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)
    names = {f.id: prof.string_table[f.name] for f in prof.function}
    locs = {loc.id: tuple(names[line.function_id] for line in loc.line) for loc in prof.location}
    stacks = sorted((tuple(locs[i] for i in s.location_id), tuple(s.value)) for s in prof.sample)
    types = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
    return types, prof.period, prof.time_nanos, prof.duration_nanos, stacks


def _same(path: str, a: tuple[int, bytes], b: tuple[int, bytes]) -> bool:
    if a == b:
        return True
    if a[0] != b[0]:
        return False
    if path.endswith("SelectMergeProfile") or path.endswith("format=pprof"):
        return _pprof_view(a[1]) == _pprof_view(b[1])
    try:
        return _canonical(json.loads(a[1])) == _canonical(json.loads(b[1]))
    except ValueError:
        return False


def _first_difference(a: bytes, b: bytes) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at byte {i}: DuckDB {a[max(0, i - 80) : i + 80]!r}, ClickHouse {b[max(0, i - 80) : i + 80]!r}"


def _corpus_range(corpus: list[bytes]) -> tuple[float, float]:
    batches = [pb.Batch.FromString(p) for p in corpus]
    return min(b.start_unix_ns for b in batches) / 1e9 - 30, max(b.end_unix_ns for b in batches) / 1e9 + 30


@pytest.mark.bpf  # the corpus holds a real agent's batches: the serial phase
def test_every_query_answers_as_duckdb_does(pair: tuple[Collector, Collector], corpus: list[bytes]) -> None:
    duck, ch = pair
    start, end = _corpus_range(corpus)
    now = end + 5
    apis = []
    for col in (duck, ch):
        query = QueryService(col.store, col.gpu_usage)
        api = HttpApi(query, CollectorRegistry(auto_describe=False), clock=lambda: now)
        routes = {**api.routes(), **api.prefixes()}
        apis.append((routes, Querier(query, clock=lambda: now).service()))
    # the corpus is all there: the same CPU samples and off-CPU time as the batches carried
    top = Request("/api/v1/top", {"from": repr(start), "until": repr(end)})
    totals = [json.loads(_answer(r["/api/v1/top"], top)[1])["total"] for r, _ in apis]
    assert totals[0] > 0
    checked = 0
    for path, params in _queries(start, end):
        bare = path.split("?")[0]
        route = bare if bare in apis[0][0] else "/api/v1/labels/"
        a, b = (_answer(r[route], Request(bare, dict(params))) for r, _ in apis)
        assert a[0] == 200, (path, params, a[1][:300])
        assert _same(path, a, b), (path, params, _first_difference(a[1], b[1]))
        checked += 1
    for method, req in _connect_calls(start, end):
        r = Request(f"/querier.v1.QuerierService/{method}", {}, {"content-type": "application/proto"}, "POST",
                    req.SerializeToString())  # type: ignore[attr-defined]  # fmt: skip
        a, b = (_answer(svc.handle, r) for _, svc in apis)
        assert a[0] == 200, (method, a[1][:300])
        assert _same(method, a, b), (method, _first_difference(a[1], b[1]))
        checked += 1
    assert checked >= 85


@pytest.mark.bpf  # the corpus holds a real agent's batches: the serial phase
def test_grafana_profile_stats_see_the_same_hours(pair: tuple[Collector, Collector]) -> None:
    """GetProfileStats: data ingested, the same oldest hour (its newest is "now", read per call)."""
    answers = []
    for col in pair:
        resp = (
            Querier(QueryService(col.store))
            .service()
            .handle(
                Request(
                    "/querier.v1.QuerierService/GetProfileStats",
                    {},
                    {"content-type": "application/proto"},
                    "POST",
                    types_pb2.GetProfileStatsRequest().SerializeToString(),
                )  # fmt: skip
            )
        )
        answers.append(types_pb2.GetProfileStatsResponse.FromString(resp.body))
    assert answers[0].data_ingested and answers[1].data_ingested
    assert answers[0].oldest_profile_time == answers[1].oldest_profile_time


@pytest.mark.bpf  # the corpus holds a real agent's batches: the serial phase
def test_resends_count_once_across_collectors(pair: tuple[Collector, Collector], corpus: list[bytes]) -> None:
    """The corpus again, to the ClickHouse collector and to a second one on the same database: every
    batch acknowledged as a duplicate, nothing counted twice."""
    _, ch = pair
    start, end = _corpus_range(corpus)
    before = ch.store.group(parse_selector("{}"), start, end, []).totals
    store = ch.store
    twin = ClickHouseStore(store._conn, store.layout, retention_s=store.retention_s, background=False)
    for target in (ch, twin):
        for payload in corpus:
            batch = pb.Batch.FromString(payload)
            rows = Decoder(twin.ids).decode_payload(payload)
            if target is twin:
                assert twin.write_logged(batch.agent.agent_id, batch.sequence, payload, rows) is False
            else:
                assert push(f"127.0.0.1:{ch.grpc_port}", [batch]) == [batch.sequence]
    assert ch.ingest.stats.duplicates >= len(corpus)
    assert twin.counters["duplicates_found_in_clickhouse"] == len(corpus)
    assert ch.store.group(parse_selector("{}"), start, end, []).totals == before


# -- a batch half landed: in `rows`, not in a rollup -------------------------------------------------------
def _open(kind: str, server: ClickHouse, chdb: object, database: str, **kwargs: object) -> ClickHouseStore:
    """A collector's store on `database` (made where missing), with a connection of its own."""
    if kind == "server":
        return open_clickhouse(parse_url(f"{server.url}/{database}"), **kwargs)  # type: ignore[arg-type]
    return ClickHouseStore(ChdbConnection(chdb), Layout(database, None), **kwargs)  # type: ignore[arg-type]


def _half_landed(
    kind: str,
    server: ClickHouse,
    chdb: object,
    database: str,
    opts: dict,
    make: Callable[[ContentIds], list[ProfileRows]],
) -> list[ProfileRows]:
    """Batches 0.. of agent-a, made by `make` with the database's content ids, stored while the 10 minute
    view is missing: in `rows` and rows_1m, not in rows_10m (what a timed-out quorum leaves)."""
    first = _open(kind, server, chdb, database, **opts)
    first._conn.query(f"DROP TABLE {database}.rows_10m_rollup")
    batches = make(first.ids)
    for seq, rows in enumerate(batches):
        assert first.write_logged("agent-a", seq, b"", rows) is True
    first.close()
    return batches


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_batch_in_rows_but_not_in_a_rollup_is_completed_once_when_resent(
    kind: str, server: ClickHouse, chdb: object
) -> None:
    """An insert can land in `rows` and not reach a rollup: a quorum that timed out after the part was
    written runs no view, and a view's table can refuse a second quorum insert after `rows` took it (the
    cluster test read one batch short through rows_10m that way). Here the 10 minute view is missing while
    two batches go in; the next collector to open the database makes it again, and the batches resent to it
    go into rows_10m alone (not into `rows` a second time). Then every resolution answers their exact
    samples and syscalls, and a further resend, to yet another collector, is a duplicate. A marker written
    before the rollups carried markers (`count` 0) counts as whole."""
    now = 1_900_000_000.0
    clock = Clock(now)
    database = f"fp{next(_names)}"
    opts = dict(clock=clock, background=False, retention_s=7 * 86400.0)
    stacks = [(FrameKey("main", "app"), FrameKey(f"f{i}", "app")) for i in range(2)]
    lb = (("comm", "w"), ("node", "n1"), ("pid", "7"))
    batches = _half_landed(kind, server, chdb, database, opts, lambda ids: [
        ProfileRows.from_rows(
            t - 10, t, 19, [(lb, stacks[0], 5 + i), (lb, stacks[1], 2)],
            [(lb, "read", SyscallAgg(4 + i, 2, 900, [0, 2]))], ids=ids,
        )
        for i, t in enumerate((now - 1500, now - 1490))
    ])  # fmt: skip
    samples, reads = sum(7 + i for i in range(2)), sum(4 + i for i in range(2))
    every = parse_selector("{}")
    coarse = (now - 7200, now)  # holds the batches' whole 10 minute bucket: read from rows_10m
    fine = (now - 1510, now - 1480)  # inside it: read from the 10 s rows
    second = _open(kind, server, chdb, database, **opts)  # makes the view again
    try:
        assert second.select(every, *fine).total == samples
        assert second.select(every, *coarse).total == 0  # what the half-landed batches left
        for seq, rows in enumerate(batches):
            assert second.write_logged("agent-a", seq, b"", rows) is True  # completed: stored now
        assert second.stats()["rollups_completed"] == 2
        assert second.counters["duplicates_found_in_clickhouse"] == 0
    finally:
        second.close()
    third = _open(kind, server, chdb, database, **opts)
    try:
        for seq, rows in enumerate(batches):
            assert third.write_logged("agent-a", seq, b"", rows) is False
        assert third.stats()["rollups_completed"] == 0
        for start, end in (coarse, fine):
            assert third.select(every, start, end).total == samples, (start, end)
            got = third.syscalls(every, start, end, ["syscall"])
            assert {k: (v.count, v.timed) for k, v in got.items()} == {("read",): (reads, 4)}, (start, end)
        # a batch whose marker in `rows` predates the rollups' markers: whole, whatever the rollups hold
        old = ProfileRows.from_rows(now - 1510, now - 1500, 19, [(lb, stacks[0], 1)], [], ids=third.ids)
        bucket = int((old.start + old.end) / 2 // 10 * 10)  # the writer's Pending.bucket
        marker = {c: np.zeros(1, np.int64) for c in ("lid", "sid", "count", "timed", "timed_ns")}
        marker.update(kind=np.array([4], np.uint8), bucket=np.array([bucket], np.int64),
                      freq=np.zeros(1, np.uint32), syscall=np.array([""], object), i=np.zeros(1, np.uint8),
                      batch=np.array([third.key_of("agent-old", 1)], np.int64),
                      node=np.array(["n1"], object))  # fmt: skip
        third._conn.insert(f"{database}.rows", marker)
        assert third.write_logged("agent-old", 1, b"", old) is False
        assert third.select(every, *coarse).total == samples
    finally:
        third.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_rollup_copy_that_appears_while_the_writer_completes_it_is_taken_back(
    kind: str, server: ClickHouse, chdb: object
) -> None:
    """A rollup's part of a batch whose quorum timed out becomes visible when a replica fetches it, and
    that can fall between the writer's read (the batch missing there) and its own insert of the batch's
    rollup rows (the cluster test's run once read rows_10m one batch over). The writer reads the markers
    again after and takes the copy too many back with a negated one. Here the copy appears at that very
    moment: the connection inserts the block once more just before the writer's insert into rows_10m."""
    now = 1_900_000_000.0
    database = f"fp{next(_names)}"
    opts = dict(clock=Clock(now), background=False, retention_s=7 * 86400.0)
    lb = (("comm", "w"), ("node", "n1"), ("pid", "7"))
    (rows,) = _half_landed(kind, server, chdb, database, opts, lambda ids: [
        ProfileRows.from_rows(
            now - 1510, now - 1500, 19, [(lb, (FrameKey("main", "app"), FrameKey("f", "app")), 9)],
            [(lb, "read", SyscallAgg(3, 1, 500, [1]))], ids=ids,
        )
    ])  # fmt: skip
    second = _open(kind, server, chdb, database, **opts)
    conn, insert = second._conn, second._conn.insert
    appeared = []

    def insert_and_appear(table: str, columns: dict, settings: dict | None = None) -> None:
        if table == f"{database}.rows_10m" and not appeared:
            appeared.append(table)
            insert(table, columns, settings)  # the part that waited for its quorum, visible now
        insert(table, columns, settings)

    conn.insert = insert_and_appear  # type: ignore[method-assign]
    try:
        assert second.write_logged("agent-a", 0, b"", rows) is True
        assert appeared and second.stats()["copies_taken_back"] == 1
        every = parse_selector("{}")
        for start, end in ((now - 7200, now), (now - 1510, now - 1490)):  # rows_10m's bucket; 10 s rows
            assert second.select(every, start, end).total == 9, (start, end)
            got = second.syscalls(every, start, end, ["syscall"])
            assert {k: (v.count, v.timed, v.timed_ns) for k, v in got.items()} == {("read",): (3, 1, 500)}
    finally:
        second.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_database_whose_views_left_the_markers_out_is_brought_up_to_date(
    kind: str, server: ClickHouse, chdb: object
) -> None:
    """Schema version 1 as first made: views named `_mv` that filtered the markers out, rollups without
    `node`. A collector that opens it adds the column, drops the old views and makes the ones that carry
    markers, once; a second open changes nothing."""
    database = f"fp{next(_names)}"
    store = _open(kind, server, chdb, database, background=False, retention_s=3600.0)
    conn = store._conn
    for name, width in (("rows_1m", 60), ("rows_10m", 600)):
        conn.query(f"DROP TABLE {database}.{name}_rollup")
        conn.query(f"ALTER TABLE {database}.{name} DROP COLUMN node")
        conn.query(
            f"CREATE MATERIALIZED VIEW {database}.{name}_mv TO {database}.{name} AS SELECT kind, "
            f"intDiv(bucket, {width}) * {width} AS bucket, lid, sid, freq, syscall, i, count, timed, "
            f"timed_ns FROM {database}.rows WHERE kind != 4"
        )
    store.close()

    def views() -> list[str]:
        again = _open(kind, server, chdb, database, background=False, retention_s=3600.0)
        try:
            assert upgrade_ddl(again._conn, again.layout) == []
            return sorted(
                r[0]
                for r in again._conn.query(
                    f"SELECT name FROM system.tables WHERE database = '{database}' "
                    "AND engine = 'MaterializedView'"
                )
            )
        finally:
            again.close()

    assert views() == ["rows_10m_rollup", "rows_1m_rollup"]
    assert views() == ["rows_10m_rollup", "rows_1m_rollup"]


# -- resolutions and retention, at a clock days later -----------------------------------------------------
class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _aged_windows(now: float, ids: ContentIds) -> list[ProfileRows]:
    """Windows 2 minutes to 6 days old (10 s rows, 1 and 10 minute rollups, and past retention), each
    with two label sets, three stacks and a syscall row."""
    out = []
    stacks = [(FrameKey("main", "app"), FrameKey(f"f{i}", "app", i == 2)) for i in range(3)]
    for k, age in enumerate((120, 1_000, 5 * 3600, 7 * 3600 + 25, 30 * 3600, 50 * 3600 + 7, 80 * 3600,
                             100 * 3600 + 333, 6 * 86400)):  # fmt: skip
        end = now - age
        for j in range(3):
            t = end - j * 10
            rows = []
            for n, node in enumerate(("n1", "n2")):
                lb = (("comm", f"c{(k + n) % 3}"), ("node", node), ("pid", str(100 + n)))
                rows += [(lb, stacks[(k + j + s) % 3], 1 + k + j * s + n) for s in range(2)]
            sys_lb = (("comm", "c0"), ("node", "n1"), ("pid", "100"))
            syscalls = [(sys_lb, "read", SyscallAgg(5 + k, 2, 300 * k, [0, k, 1]))]
            out.append(ProfileRows.from_rows(t - 10, t, 19 if k % 2 else 49, rows, syscalls, ids=ids))
    return out


def _normal(value: object) -> object:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, SyscallAgg):
        h = list(value.hist)
        while h and not h[-1]:
            h.pop()
        return (value.count, value.timed, value.timed_ns, h)
    return value


@pytest.mark.parametrize("kind", BACKENDS)
def test_rollups_and_retention_answer_as_duckdb_does(
    kind: str, server: ClickHouse, chdb: object, tmp_path: Path
) -> None:
    now = 1_900_000_000.0
    clock = Clock(now)
    retention = 5 * 86400.0
    ch = clickhouse_store(kind, server, chdb, clock=clock, background=False, retention_s=retention)
    # Both stores under the ClickHouse schema's key, so their selections name stacks by the same ids.
    (tmp_path / "duck").mkdir()
    (tmp_path / "duck" / KEY_FILE).write_bytes(ch.ids.key)
    duck = open_durable(tmp_path / "duck", clock=clock, background=False, retention_s=retention)
    try:
        for rows in _aged_windows(now, ch.ids):
            clock.t = rows.end + 1
            duck.write(rows)
            ch.write(rows)
        duck.flush()
        dropped = []
        for t in (now, now + 3600):  # the rollup and the drops as they would run, twice
            clock.t = t
            duck.maintain()
            dropped += ch._retention.drop(t, retention)
        assert any(table == "rows" for table, _ in dropped)  # the 10 s rows of days past 6 h are gone
        assert any(table == "rows_10m" for table, _ in dropped)  # and the 6-day-old day, past retention
        every = parse_selector("{}")
        one = parse_selector('{comm=~"c[01]", node="n1"}')
        ranges = [
            (t - 86400 * 7, t),
            (t - 86400, t),
            (t - 7 * 3600 - 95, t - 7 * 3600 + 5),  # cuts inside 1 min buckets
            (t - 30 * 3600 - 300, t - 29 * 3600),
            (t - 3 * 3600, t - 60),
            (t - 100 * 3600 - 900, t - 90 * 3600),  # cuts inside 10 min buckets
        ]
        for start, end in ranges:
            for sel in (every, one):
                for store in (duck, ch):
                    assert store.select(sel, start, end) is not None
                assert duck.select(sel, start, end) == ch.select(sel, start, end), (start, end, sel)
                assert duck.group(sel, start, end, ["comm", "node"]) == ch.group(
                    sel, start, end, ["comm", "node"]
                )
                for step in (10, 60, 600, 3600.0):
                    assert duck.series(sel, start, end, step, ["comm"]) == ch.series(
                        sel, start, end, step, ["comm"]
                    )
                assert _normal(duck.syscalls(sel, start, end, ["syscall", "comm"])) == _normal(
                    ch.syscalls(sel, start, end, ["syscall", "comm"])
                )
            assert duck.label_values("comm", start, end) == ch.label_values("comm", start, end)
        total = duck.select(every, t - 86400 * 7, t).total
        assert total > 0 and total == ch.select(every, t - 86400 * 7, t).total
    finally:
        duck.close()
        ch.close()


# -- bad configuration: one clear error at start ---------------------------------------------------------
def _collector_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetprof.cli", "collector", "--grpc", "127.0.0.1:0", "--http",
         f"127.0.0.1:{free_port()}", *args],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip


def test_a_server_that_is_down_stops_the_start_with_one_line() -> None:
    port = free_port()  # nothing listens there
    out = _collector_cli("--clickhouse", f"clickhouse://127.0.0.1:{port}/fleetprof")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "cannot reach ClickHouse" in lines[0] and str(port) in lines[0]


def test_data_dir_and_clickhouse_exclude_each_other(tmp_path: Path) -> None:
    out = _collector_cli("--data-dir", str(tmp_path), "--clickhouse", "clickhouse://127.0.0.1/x")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:9000/db", "expected clickhouse://"),
        ("clickhouse://127.0.0.1:9000/", "name the database"),
        ("clickhouse://127.0.0.1:9000/db?clustre=x", "unknown option 'clustre'"),
        ("clickhouse://127.0.0.1:99999/db", "out of range"),
        ("clickhouse://127.0.0.1/db?quorum=2", "quorum= needs cluster="),
        ("clickhouse://127.0.0.1/db?secure=1&ca=/nonexistent", "no such file"),
    ],
)
def test_bad_urls_are_named(url: str, message: str) -> None:
    with pytest.raises(ValueError, match="--clickhouse") as err:
        parse_url(url)
    assert message in str(err.value)


def test_a_read_only_user_and_a_newer_schema_are_refused(tmp_path: Path) -> None:
    s = ClickHouse(scratch("ro"), users={"reader": ("secret", True), "writer": ("pw", False)}).start()
    try:
        url = f"clickhouse://reader:secret@127.0.0.1:{s.tcp_port}/fleetprof"
        with pytest.raises(ClickHouseStartError, match="read-only"):
            open_clickhouse(parse_url(url), retention_s=3600)
        wrong = f"clickhouse://writer:nope@127.0.0.1:{s.tcp_port}/fleetprof"
        with pytest.raises(ClickHouseStartError, match="refused the login of user 'writer'"):
            open_clickhouse(parse_url(wrong), retention_s=3600)
        # a schema some later fleetprof made: this collector must not write into it
        conn = NativeConnection(parse_url(f"{s.url}/system"))
        conn.query("CREATE DATABASE future")
        conn.query(
            "CREATE VIEW future.fleetprof_schema AS SELECT toUInt32(2) AS version, 'ab' AS content_key"
        )
        password = tmp_path / "password"
        password.write_text("pw\n")
        out = _collector_cli("--clickhouse", f"clickhouse://writer@127.0.0.1:{s.tcp_port}/future",
                             "--clickhouse-password-file", str(password))  # fmt: skip
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert "schema version 2, newer than this collector's 1" in lines[0]
        conn.close()
    finally:
        s.remove()


def test_the_schema_is_made_once_and_its_key_shared(server: ClickHouse, tmp_path: Path) -> None:
    """Two collectors starting on an empty database at once end with one schema and one content-id key."""
    url = parse_url(f"{server.url}/fp_race")
    with futures.ThreadPoolExecutor(2) as pool:
        stores = list(pool.map(lambda _: open_clickhouse(url, retention_s=3600, background=False), range(2)))
    try:
        assert stores[0].schema == stores[1].schema
        again = open_clickhouse(url, retention_s=3600, background=False)  # idempotent: nothing to make
        assert again.schema == stores[0].schema
        again.close()
    finally:
        for st in stores:
            st.close()
