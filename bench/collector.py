"""Collector benchmark: ingest throughput per core through real gRPC (in-memory vs --data-dir), query latency
for a 500-node fleet ("now" from the hot tier, 24 h from DuckDB), and the DuckDB-vs-SQLite choice.

    .venv/bin/python bench/collector.py [--quick] [--seconds 20] [--nodes 500]

Ingest: a collector subprocess per store; simulated agents (threads here, one gRPC stream each) push
realistic batches (thousands of distinct stacks ~24 frames deep, hundreds of processes, 64 CPUs × 19 Hz ×
10 s = 12,160 samples, in sample columns) as fast as it acknowledges. Each agent first sends each of its
batches once (the collector learns its stacks, as in an agent's first minute), then the measured run sends
batches in which a share of the stacks is new (`--new-stacks`, runs at 0% and 5% by default). Rates are
per collector CPU-second (from /proc), so the sender sharing the machine does not distort them. Queries: a
store in this process, pre-loaded directly.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import duckdb
import grpc
import numpy as np
from common import free_port, proc_cpu_s, proc_status, scrape, wait_for_health

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from fleetprof._proto.pyroscope import querier_pb2  # noqa: E402
from fleetprof._proto.v1 import ingest_pb2 as pb  # noqa: E402
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc  # noqa: E402
from fleetprof.agent.batch import frame_digest, process_wire_id, stack_wire_id  # noqa: E402
from fleetprof.collector.ingest.decode import Decoder  # noqa: E402
from fleetprof.collector.model.ids import ContentIds, labels_json  # noqa: E402
from fleetprof.collector.model.profile import FrameKey  # noqa: E402
from fleetprof.collector.model.rows import ProfileRows, Selection  # noqa: E402
from fleetprof.collector.model.selector import Selector  # noqa: E402
from fleetprof.collector.query.selector import parse_selector  # noqa: E402
from fleetprof.collector.query.service import QueryService  # noqa: E402
from fleetprof.collector.render.names import Demangler  # noqa: E402
from fleetprof.collector.render.tree import top_functions  # noqa: E402
from fleetprof.collector.serve.http import HttpApi  # noqa: E402
from fleetprof.collector.serve.pyroscope import Querier  # noqa: E402
from fleetprof.collector.store.base import ProfileStore  # noqa: E402
from fleetprof.collector.store.durable import DurableStore, content_key  # noqa: E402
from fleetprof.collector.store.memory import MemoryStore  # noqa: E402
from fleetprof.httpserve import Request  # noqa: E402
from tests.support.clickhouse_servers import ClickHouse, scratch  # noqa: E402
from tests.support.wire import pack  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CPUS, HZ, WINDOW = 64, 19, 10
SAMPLES_PER_BATCH = CPUS * HZ * WINDOW


# -- realistic batches -------------------------------------------------------------------------------
def make_templates(
    n: int, stacks: int, procs: int, seed: int = 1, packed: bool = True, frame_ids: bool = True
) -> list[pb.Batch]:
    """Batches as an agent on a busy 64-CPU node sends them: a string table, `stacks` distinct stacks drawn
    from a shared pool (the same binaries everywhere) in packed columns (or, with `packed=False`, as Stack
    messages, as agents sent them before; with the frames' content ids unless `frame_ids=False`), `procs`
    processes in pods, 12,160 samples in sample columns,
    the agent's wire ids of stacks and processes packed (Batch.stack_ids, Batch.process_ids)."""
    rng = random.Random(seed)
    funcs = [f"func_{i}" for i in range(4000)]
    mods = ["/usr/bin/python3.11", "/usr/lib/libc.so.6", "/opt/app/train", "[kernel]", "/usr/lib/libcuda.so"]
    pool = [
        ([rng.randrange(len(funcs)) for _ in range(rng.randrange(8, 40))], rng.randrange(len(mods)))
        for _ in range(stacks * 4)
    ]
    out = []
    for b in range(n):
        strings: list[str] = [""]
        ids = {"": 0}

        def s(x: str, strings: list[str] = strings, ids: dict[str, int] = ids) -> int:
            if x not in ids:
                ids[x] = len(strings)
                strings.append(x)
            return ids[x]

        batch = pb.Batch(frequency_hz=HZ)
        for fr, m in rng.sample(pool, stacks):
            names, modules = [funcs[f] for f in fr], [mods[m]] * len(fr)
            batch.stacks.append(
                pb.Stack(
                    functions=[s(f) for f in names],
                    modules=[s(x) for x in modules],
                    kernel_start=len(fr) - 3,
                )
            )
            batch.stack_ids.append(stack_wire_id(names, modules, len(fr) - 3))
        for p in range(procs):
            labels = [("namespace", f"ns-{p % 7}"), ("pod", f"pod-{b}-{p // 4}"), ("container", f"c{p % 4}")]
            batch.processes.append(
                pb.Process(
                    pid=1000 + p,
                    comm=s(f"proc-{p % 40}"),
                    labels=[pb.Label(name=s(k), value=s(v)) for k, v in labels],
                )
            )
            batch.process_ids.append(process_wire_id(1000 + p, 0, f"proc-{p % 40}", "", labels))
        left = SAMPLES_PER_BATCH
        cols = batch.sample_columns
        for i in range(stacks):
            c = max(1, left // (stacks - i)) if i < stacks - 1 else left
            cols.process.append(rng.randrange(procs))
            cols.stack.append(i)
            cols.count.append(c)
            left -= c
            if left <= 0:
                break
        batch.strings.extend(strings)
        if packed:
            pack(batch, frame_ids)
        out.append(batch)
    return out


def churned(template: pb.Batch, rng: random.Random, churn: float) -> pb.Batch:
    """A copy of `template` in which a `churn` share of the stacks are new (new code paths, new processes'
    stacks): each gets a new wire id and a first frame of a random function, in either form of stacks."""
    b = pb.Batch()
    b.CopyFrom(template)
    n = len(b.stack_ids)
    picked = rng.sample(range(n), int(churn * n))
    if not b.HasField("stack_columns"):
        for i in picked:
            b.stack_ids[i] = rng.getrandbits(63) | 1
            b.stacks[i].functions[0] = rng.randrange(1, len(b.strings))
        return b
    fc, sc = b.frame_columns, b.stack_columns
    width = np.dtype(f"<u{fc.index_bytes}")
    functions, modules = np.frombuffer(fc.functions, width), np.frombuffer(fc.modules, width)
    frames = np.frombuffer(sc.frames, f"<u{sc.index_bytes}").copy()
    lengths = np.frombuffer(sc.lengths, "<u2")
    starts = np.cumsum(lengths, dtype=np.int64) - lengths
    new_functions, new_modules, new_ids = [], [], []
    for i in picked:
        b.stack_ids[i] = rng.getrandbits(63) | 1
        if lengths[i]:
            # a frame table entry of its own: a random function in the module of the frame it replaces
            new_functions.append(rng.randrange(1, len(b.strings)))
            new_modules.append(modules[frames[starts[i]]])
            new_ids.append(frame_digest(b.strings[new_functions[-1]], b.strings[new_modules[-1]]))
            frames[starts[i]] = len(functions) + len(new_functions) - 1
    assert len(functions) + len(new_functions) <= 1 << (8 * sc.index_bytes)
    fc.functions += np.asarray(new_functions, width).tobytes()
    fc.modules += np.asarray(new_modules, width).tobytes()
    if fc.ids:
        fc.ids += b"".join(new_ids)
    sc.frames = frames.tobytes()
    return b


# -- ingest through gRPC -----------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Secured:
    """TLS with client certificates and an ingest token, as the chart's TLS variant runs: the collector's
    flags and each simulated agent's channel and metadata. Certificates are made here (`cryptography`)."""

    TOKEN = "bench-ingest-token-5f1e0c"

    def __init__(self, directory: Path):
        from tests.support.certs import Ca

        self.ca = Ca(directory, "bench")
        self.server, self.client = self.ca.server(), self.ca.client()
        self.token_file = directory / "ingest-token"
        self.token_file.write_text(self.TOKEN + "\n")

    def flags(self) -> list[str]:
        return [
            "--tls-cert", str(self.server.cert), "--tls-key", str(self.server.key),
            "--tls-client-ca", str(self.ca.cert), "--auth-token-file", str(self.token_file),
            "--node-binding", "none",  # one client certificate for every simulated node
        ]  # fmt: skip

    def channel(self, target: str, options: list) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            self.ca.cert.read_bytes(), self.client.key.read_bytes(), self.client.cert.read_bytes()
        )
        return grpc.secure_channel(target, creds, options=options)

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca.cert))


def run_ingest(
    label: str,
    data_dir: Path | None,
    templates: list[pb.Batch],
    agents: int,
    seconds: float,
    new_stacks: float,
    secured: Secured | None = None,
    clickhouse: ClickHouse | None = None,
    collectors: int = 1,
) -> dict:
    """Ingest through `collectors` collector processes (agents spread over them), each on the in-memory
    store, `data_dir` (DuckDB), or `clickhouse` (a database of its own on that server, shared by them)."""
    scheme, context = ("https", secured.context()) if secured else ("http", None)
    metadata = (("authorization", f"Bearer {Secured.TOKEN}"),) if secured else ()
    database = f"bench{time.monotonic_ns()}"
    procs, grpc_ports, metrics_urls = [], [], []
    for c in range(collectors):
        grpc_port, http_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "fleetprof.cli", "collector", "--grpc", f"127.0.0.1:{grpc_port}"]
        cmd += ["--http", f"127.0.0.1:{http_port}"]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir / str(c))]
        if clickhouse is not None:
            cmd += ["--clickhouse", f"{clickhouse.url}/{database}"]
        if secured is not None:
            cmd += secured.flags()
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        grpc_ports.append(grpc_port)
        metrics_urls.append(f"http://127.0.0.1:{http_port}/metrics")
        # one at a time: the first makes the ClickHouse schema the others find
        wait_for_health(procs[-1], f"{scheme}://127.0.0.1:{http_port}/healthz", "collector", timeout_s=60,
                        context=context)  # fmt: skip
    metrics_url = metrics_urls[0]
    try:
        latencies: list[float] = []
        acked = [0]
        stop = threading.Event()
        lock = threading.Lock()

        warm = threading.Barrier(agents + 1)
        go = threading.Event()

        def agent(a: int) -> None:
            rng = random.Random(a)
            target = f"127.0.0.1:{grpc_ports[a % collectors]}"
            options = [("grpc.max_send_message_length", 64 << 20)]
            channel = secured.channel(target, options) if secured else grpc.insecure_channel(target, options)
            with channel as ch:
                stub = pb_grpc.IngestStub(ch)
                seq = 0

                def push(template: pb.Batch, churn: float) -> float:
                    nonlocal seq
                    seq += 1
                    b = churned(template, rng, churn)
                    now = time.time_ns()
                    b.agent.node, b.agent.agent_id, b.sequence = f"node-{a}", f"agent-{a}", seq
                    b.start_unix_ns, b.end_unix_ns = now - WINDOW * 10**9, now
                    t0 = time.perf_counter()
                    list(stub.Push(iter([b]), metadata=metadata, timeout=60))
                    return time.perf_counter() - t0

                for t in templates:  # the collector meets this agent's stacks once, as in its first minute
                    push(t, 0.0)
                warm.wait()
                go.wait()
                while not stop.is_set():
                    took = push(templates[rng.randrange(len(templates))], new_stacks)
                    with lock:
                        latencies.append(took)
                        acked[0] += 1

        threads = [threading.Thread(target=agent, args=(a,), daemon=True) for a in range(agents)]
        for t in threads:
            t.start()
        warm.wait()
        if data_dir is not None:
            # The first flush writes every definition the warm-up taught the collector (all stacks and
            # label sets of the fleet: a once-per-start cost); measure the steady state after it.
            flushes = scrape(metrics_url)["fleetprof_store_flushes"]
            deadline = time.time() + 60
            while scrape(metrics_url)["fleetprof_store_flushes"] <= flushes and time.time() < deadline:
                time.sleep(0.2)
        go.set()
        cpu0 = sum(proc_cpu_s(p.pid) for p in procs)
        ch_cpu0 = proc_cpu_s(clickhouse.proc.pid) if clickhouse else 0.0
        t0 = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        cpu = sum(proc_cpu_s(p.pid) for p in procs) - cpu0
        ch_cpu = proc_cpu_s(clickhouse.proc.pid) - ch_cpu0 if clickhouse else 0.0
        rss = max(int(proc_status(p.pid)["VmRSS"][0]) for p in procs) / 1024
        batches = acked[0]
        samples = batches * SAMPLES_PER_BATCH
        time.sleep(12 if data_dir else 0)  # one flush: the WAL's batches are in the database
        disk = dir_bytes(data_dir) if data_dir else 0
        stored = samples
        if clickhouse is not None:
            time.sleep(5)  # background merges of the run's parts
            disk = clickhouse.disk_bytes(database)
            stored = (len(templates) * agents + batches) * SAMPLES_PER_BATCH  # the warm-up is on disk too
        per_core = samples / cpu if cpu else 0.0
        return {
            "store": label,
            "collectors": collectors,
            "batches/s": batches / wall,
            "samples/s": samples / wall,
            "collector CPU %": 100 * cpu / wall,
            "samples/s per core": per_core,
            "batches/s per core": batches / cpu if cpu else 0.0,
            "nodes per core (64 CPU, 19 Hz)": per_core / (CPUS * HZ),
            "ack latency p50 ms": 1000 * statistics.median(latencies) if latencies else 0,
            "ack latency p95 ms": 1000 * np.percentile(latencies, 95) if latencies else 0,
            "RSS MB": rss,
            "disk bytes/sample": disk / stored if stored and (data_dir or clickhouse) else 0,
            "ClickHouse CPU µs/sample": 1e6 * ch_cpu / samples if clickhouse and samples else 0,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


# -- queries over a 500-node fleet -------------------------------------------------------------------
def select_and_top(store: ProfileStore, selector: Selector, start: float, end: float) -> Selection:
    """What /api/v1/top and `fleetprof top` do: select, then rank the functions."""
    res = store.select(selector, start, end)
    top_functions(res.stacks, 20)
    return res


def timings(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    """Seconds of each of `repeats` calls of fn, and the last call's result."""
    out, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        out.append(time.perf_counter() - t0)
    return out, res


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def node_labels(node: int, ids: ContentIds) -> list[tuple[int, tuple]]:
    """The (label set id, label set) of a node's 50 processes."""
    out = []
    for pid in range(50):
        lb = (
            ("comm", f"proc-{pid % 40}"),
            ("namespace", f"ns-{pid % 7}"),
            ("node", f"node-{node}"),
            ("pid", str(1000 + pid)),
            ("pod", f"pod-{node}-{pid // 4}"),
        )
        out.append((ids.labels_id(lb), lb))
    return out


def fleet_window(
    nodes: int,
    rows_per_node: int,
    stacks: list,
    labels: list[list],
    start: float,
    end: float,
    rng: random.Random,
) -> list[ProfileRows]:
    """One 10 s window of the whole fleet: one ProfileRows per node, as ingest makes them."""
    out = []
    for n in range(nodes):
        picks = [rng.randrange(len(stacks)) for _ in range(rows_per_node)]
        distinct = sorted(set(picks))
        where = {s: i for i, s in enumerate(distinct)}
        out.append(
            ProfileRows(
                start,
                end,
                HZ,
                labels[n],
                [stacks[s] for s in distinct],
                np.arange(rows_per_node, dtype=np.int64) % 50,
                np.array([where[s] for s in picks], dtype=np.int64),
                np.array([rng.randrange(1, 40) for _ in range(rows_per_node)], dtype=np.int64),
            )
        )
    return out


def preload_day(store: DurableStore, nodes: int, rows_per_node: int, stacks: list, now: float) -> int:
    """24 h for the fleet straight into DuckDB as rollup leaves it: 10 min rows older than 6 h, 1 min rows
    before that. Rows are generated inside DuckDB; definitions via the store's own insert path."""
    con = store._db.con
    sets = [entry for n in range(nodes) for entry in node_labels(n, store.ids)]
    lids = [lid for lid, _ in sets]
    labels = [labels_json(lb) for _, lb in sets]
    con.execute("INSERT INTO label_sets SELECT unnest($1::BIGINT[]), unnest($2::VARCHAR[])", [lids, labels])
    con.register("lids", {"i": np.arange(len(lids), dtype=np.int64), "lid": np.array(lids, dtype=np.int64)})
    con.register(
        "sids",
        {
            "j": np.arange(len(stacks), dtype=np.int64),
            "sid": np.array([s for s, _ in stacks], dtype=np.int64),
        },
    )
    day_start = int(now - 86400) // 600 * 600
    six_h = int(now - 6 * 3600) // 600 * 600
    total = 0
    for res, lo, hi in ((600, day_start, six_h), (60, six_h, int(now - 3600) // 60 * 60)):
        nb = (hi - lo) // res
        per_bucket = nodes * rows_per_node
        con.execute(
            f"INSERT INTO samples SELECT {res}, {lo} + (r // {per_bucket}) * {res}, l.lid, s.sid, {HZ}, "
            f"1 + hash(r) % 40 * {res // 10} FROM range({nb * per_bucket}) t(r) "
            f"JOIN lids l ON l.i = (r % {per_bucket}) // {rows_per_node} * 50 // {rows_per_node} "
            f"JOIN sids s ON s.j = hash(r * 7) % {len(stacks)}"
        )
        total += nb * per_bucket
    return total


def run_queries(nodes: int, rows_per_node: int, repeats: int, with_clickhouse: bool = True) -> list[dict]:
    rng = random.Random(7)
    tmp = Path(tempfile.mkdtemp(prefix="fleetprof-bench-q-"))
    ids = ContentIds(content_key(tmp))  # the store's, as collector/main.py makes them
    frames = [FrameKey(f"func_{i}", "/opt/app/train") for i in range(3000)]
    stacks = []
    for _ in range(5000):
        st = tuple(rng.choice(frames) for _ in range(rng.randrange(8, 30)))
        stacks.append((ids.stack_id(st), st))
    now = 1_900_000_000.0
    clock = Clock(now - 600)
    store = DurableStore(tmp, decode=Decoder(ids).decode_payload, ids=ids, clock=clock, background=False)
    mem = MemoryStore(clock=clock)
    labels = [node_labels(n, store.ids) for n in range(nodes)]
    for w in range(6):  # the last 60 s, written the way ingest writes (hot tier + pending chunk)
        t = now - 50 + 10 * w
        clock.t = t
        for rows in fleet_window(nodes, rows_per_node, stacks, labels, t - 10, t, rng):
            store.write(rows)
            mem.write(rows)
    store.flush()
    t0 = time.perf_counter()
    loaded = preload_day(store, nodes, rows_per_node, stacks, now)
    load_s = time.perf_counter() - t0
    clock.t = now
    out = []
    every, one_ns = parse_selector("{}"), parse_selector('{namespace="ns-3"}')
    cases = [
        ("in-memory store (baseline)", mem, "top, last 60 s, {}", every, 60),
        ("durable: hot tier", store, "top, last 60 s, {}", every, 60),
        ("durable: hot tier", store, 'top, last 60 s, {namespace="ns-3"}', one_ns, 60),
        ("durable: DuckDB (cold path)", store, "top, last 15 min, {}", every, 900),
        ("durable: DuckDB (cold path)", store, "top, last 24 h, {}", every, 86400),
        ("durable: DuckDB (cold path)", store, 'top, last 24 h, {namespace="ns-3"}', one_ns, 86400),
    ]
    for name, st, what, sel, span in cases:
        times, res = timings(partial(select_and_top, st, sel, now - span, now), repeats)
        out.append(
            {
                "store": name,
                "query": what,
                "p50 ms": 1000 * statistics.median(times),
                "p95 ms": 1000 * float(np.percentile(times, 95)),
                "samples": res.total,
            }
        )
    out += grafana_cases(store, clock, now, repeats)
    print(
        f"(pre-loaded {loaded / 1e6:.1f} M rolled-up rows for 24 h × {nodes} nodes in {load_s:.1f} s; "
        f"DuckDB file {store._db.size_bytes() / 1e6:.0f} MB)"
    )
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if with_clickhouse:
        from fleetprof.collector.store.clickhouse.connection import ClickHouseError

        try:
            out += clickhouse_queries(nodes, rows_per_node, repeats, stacks, labels, now, cases)
        except ClickHouseError as err:  # e.g. the day's insert timing out on a loaded VM
            print(f"(the ClickHouse rows are left out: {err})")
    return out


def clickhouse_queries(
    nodes: int, rows_per_node: int, repeats: int, stacks: list, labels: list, now: float, cases: list
) -> list[dict]:
    """The same fleet and queries on the ClickHouse store (a server on loopback, the store in this
    process): the last minute written through the store's writer, the day generated in numpy."""
    from fleetprof.collector.store.clickhouse import open_clickhouse, parse_url
    from fleetprof.collector.store.clickhouse.writer import Pending

    server = ClickHouse(scratch("bench-q-clickhouse")).start()
    try:
        clock = Clock(now)
        store = open_clickhouse(parse_url(f"{server.url}/bench"), retention_s=7 * 86400, clock=clock)
        rng = random.Random(7)
        waiting = []
        for w in range(6):
            t = now - 50 + 10 * w
            for n, rows in enumerate(fleet_window(nodes, rows_per_node, stacks, labels, t - 10, t, rng)):
                p = Pending(store.key_of(f"bench-{n}", w), rows, f"node-{n}", f"bench-{n}", w)
                store._writer.submit(p)
                waiting.append(p)
        for p in waiting:
            p.done.wait(600)
            assert p.error is None, p.error
        t0 = time.perf_counter()
        loaded = preload_day_clickhouse(store, nodes, rows_per_node, stacks, labels, now)
        load_s = time.perf_counter() - t0
        out = []
        for _, _, what, sel, span in cases[:1] + cases[2:]:
            times, res = timings(partial(select_and_top, store, sel, now - span, now), repeats)
            out.append(
                {
                    "store": "ClickHouse 18.16 (every query)",
                    "query": what,
                    "p50 ms": 1000 * statistics.median(times),
                    "p95 ms": 1000 * float(np.percentile(times, 95)),
                    "samples": res.total,
                }
            )
        print(
            f"(ClickHouse: pre-loaded {loaded / 1e6:.1f} M rows in {load_s:.1f} s; "
            f"{server.disk_bytes('bench') / 1e6:.0f} MB on disk)"
        )
        store.close()
        return out
    finally:
        server.remove()


def preload_day_clickhouse(
    store: object, nodes: int, rows_per_node: int, stacks: list, labels: list, now: float
) -> int:
    """The rows preload_day gives DuckDB, in the tables ClickHouse reads them from at this age: the 10 min
    rows older than 6 h in rows_1m (the 1 min table answers 6 h to 3 d back), the 1 min rows in rows.
    The older rows go into rows_10m as well, as the materialized views put every row there (the rows
    inserted into `rows` reach rows_1m and rows_10m through them)."""
    conn, layout = store._conn, store.layout  # type: ignore[attr-defined]
    sets = [entry for per_node in labels[:nodes] for entry in per_node]
    conn.insert(
        layout.table("label_sets"),
        {
            "day": np.full(len(sets), int(now // 86400), np.uint32),
            "id": np.array([lid for lid, _ in sets], np.int64),
            "labels": np.array([labels_json(lb) for _, lb in sets], dtype=object),
        },
    )
    lids = np.array([lid for lid, _ in sets], np.int64)
    sids = np.array([s for s, _ in stacks], np.int64)
    day_start = int(now - 86400) // 600 * 600
    six_h = int(now - 6 * 3600) // 600 * 600
    per_bucket = nodes * rows_per_node
    gen = np.random.default_rng(11)
    total = 0
    for table, res, lo, hi in (
        ("rows_1m", 600, day_start, six_h),
        ("rows", 60, six_h, int(now - 3600) // 60 * 60),
    ):
        for b0 in range(lo, hi, res * 20):  # 20 buckets (2 M rows) per insert
            buckets = np.arange(b0, min(b0 + 20 * res, hi), res, dtype=np.int64)
            n = len(buckets) * per_bucket
            r = np.arange(n, dtype=np.int64)
            cols = {
                "kind": np.ones(n, np.uint8),
                "bucket": np.repeat(buckets, per_bucket),
                "lid": lids[(r % per_bucket) // rows_per_node * 50 // rows_per_node],
                "sid": sids[gen.integers(0, len(sids), n)],
                "freq": np.full(n, HZ, np.uint32),
                "count": (1 + gen.integers(0, 40, n) * (res // 10)).astype(np.int64),
            }
            conn.insert(layout.table(table), cols)
            if table == "rows_1m":
                conn.insert(layout.table("rows_10m"), cols)
            total += n
    return total


def grafana_cases(store: ProfileStore, clock: Clock, now: float, repeats: int) -> list[dict]:
    """Grafana's flame graph call (SelectMergeStacktraces through the Connect handler: decode, select,
    flamebearer at Pyroscope's 8,192 nodes, encode) against the UI's /api/v1/profile JSON (2,048 nodes),
    in process, on the same store: the HTTP transport is the same for both."""
    query = QueryService(store)
    demangler = Demangler()  # names as the collector shows them
    api = HttpApi(query, CollectorRegistry(auto_describe=False), demangler.display_name, clock=clock)
    connect = Querier(query, demangler.display_name, clock=clock).service()
    out = []
    for span, label in ((60, "now (60 s)"), (86400, "24 h")):
        body = querier_pb2.SelectMergeStacktracesRequest(
            profile_typeID="process_cpu:cpu:nanoseconds:cpu:nanoseconds",
            label_selector="{}",
            start=int((now - span) * 1000),
            end=int(now * 1000),
        ).SerializeToString()
        rpc = Request(
            connect.prefix + "SelectMergeStacktraces",
            {},
            {"content-type": "application/proto"},
            "POST",
            body,
        )
        rest = Request("/api/v1/profile", {"from": str(now - span), "until": str(now)})
        for name, call in (
            ("Grafana: SelectMergeStacktraces (proto)", partial(connect.handle, rpc)),
            ("UI: /api/v1/profile (json)", partial(api.profile, rest)),
        ):
            times, res = timings(call, repeats)
            assert res.status == 200, res.body[:200]
            out.append(
                {
                    "store": name,
                    "query": f"flame graph, {label}, {{}}",
                    "p50 ms": 1000 * statistics.median(times),
                    "p95 ms": 1000 * float(np.percentile(times, 95)),
                    "samples": f"{len(res.body):,} bytes",
                }
            )
    demangler.close()
    return out


# -- engine choice -----------------------------------------------------------------------------------
TOP_QUERY = "SELECT sid, sum(count) FROM s WHERE lid % 3 = 0 GROUP BY sid"


def engine_row(engine: str, rows: int, insert_s: float, path: Path, top_s: list[float]) -> dict:
    """One line of the engines table: insert rate, file bytes per row, median `top` time."""
    return {
        "engine": engine,
        "insert rows/s": rows / insert_s,
        "bytes/row": path.stat().st_size / rows,
        "top query ms": 1000 * statistics.median(top_s),
    }


def run_engines(rows: int) -> list[dict]:
    """The cold tier's insert and query pattern on DuckDB (numpy columns) and SQLite (executemany)."""
    rng = random.Random(3)
    chunk = 50_000
    cols = {
        "bucket": np.repeat(np.arange(rows // chunk + 1, dtype=np.int64) * 10, chunk)[:rows],
        "lid": np.array([rng.randrange(5000) for _ in range(rows)], dtype=np.int64),
        "sid": np.array([rng.randrange(50000) for _ in range(rows)], dtype=np.int64),
        "count": np.array([rng.randrange(1, 40) for _ in range(rows)], dtype=np.int64),
    }
    tmp = Path(tempfile.mkdtemp(prefix="fleetprof-bench-e-"))
    out = []
    con = duckdb.connect(str(tmp / "x.duckdb"))
    con.execute("CREATE TABLE s (bucket BIGINT, lid BIGINT, sid BIGINT, count BIGINT)")
    t0 = time.perf_counter()
    for i in range(0, rows, chunk):
        con.register("c", {k: v[i : i + chunk] for k, v in cols.items()})
        con.execute("INSERT INTO s SELECT * FROM c")
    ins = time.perf_counter() - t0
    con.execute("CHECKPOINT")
    q, _ = timings(lambda: con.execute(TOP_QUERY).fetchall(), 5)
    out.append(engine_row("DuckDB (numpy columns)", rows, ins, tmp / "x.duckdb", q))
    con.close()
    sq = sqlite3.connect(tmp / "x.sqlite")
    sq.execute("PRAGMA journal_mode=WAL")
    sq.execute("CREATE TABLE s (bucket INTEGER, lid INTEGER, sid INTEGER, count INTEGER)")
    sq.execute("CREATE INDEX s_bucket ON s (bucket)")
    tuples = list(zip(*(cols[k].tolist() for k in ("bucket", "lid", "sid", "count")), strict=True))
    t0 = time.perf_counter()
    for i in range(0, rows, chunk):
        with sq:
            sq.executemany("INSERT INTO s VALUES (?, ?, ?, ?)", tuples[i : i + chunk])
    ins = time.perf_counter() - t0
    q, _ = timings(lambda: sq.execute(TOP_QUERY).fetchall(), 3)
    out.append(engine_row("SQLite (executemany, WAL)", rows, ins, tmp / "x.sqlite", q))
    sq.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = [(lambda v: f"{v:,.1f}" if isinstance(v, float) else str(v)) for _ in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f(r[k]) for f, k in zip(fmt, keys, strict=True)) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer repeats")
    ap.add_argument("--seconds", type=float, default=20.0, help="ingest run length per store")
    ap.add_argument("--agents", type=int, default=8, help="concurrent simulated agents (gRPC streams)")
    ap.add_argument(
        "--new-stacks",
        default="0,0.05",
        help="shares of each batch's stacks the collector has not seen, one ingest run per store each",
    )
    ap.add_argument(
        "--parts",
        default="engines,ingest,queries",
        help="which parts to run, comma-separated (engines, ingest, queries)",
    )
    ap.add_argument(
        "--stores",
        default="memory,tls,durable,clickhouse,two",
        help="ingest rows to run: memory, tls, durable, clickhouse, two (two collectors on ClickHouse)",
    )
    ap.add_argument(
        "--no-clickhouse",
        dest="clickhouse",
        action="store_false",
        help="leave out the ClickHouse rows (they start Debian's clickhouse-server on loopback)",
    )
    ap.add_argument("--nodes", type=int, default=500, help="fleet size for the query benchmark")
    ap.add_argument("--rows-per-node", type=int, default=200, help="(label set, stack) rows per node-bucket")
    ap.add_argument("--stacks", type=int, default=3000, help="distinct stacks per batch")
    ap.add_argument("--processes", type=int, default=300, help="processes per batch")
    ap.add_argument(
        "--stack-form",
        choices=("packed", "no-frame-ids", "messages"),
        default="packed",
        help="how the agents send stacks: packed columns with frame ids (as agents do), without them, or "
        "as Stack messages (as agents did before)",
    )
    args = ap.parse_args()
    seconds = 10.0 if args.quick else args.seconds
    repeats = 5 if args.quick else 11
    engine_rows = 500_000 if args.quick else 2_000_000
    parts = set(args.parts.split(","))
    if unknown := parts - {"engines", "ingest", "queries"}:
        ap.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    if "engines" in parts:
        print(f"## engines (the cold tier's insert + top pattern, {engine_rows:,} rows)\n")
        print(table(run_engines(engine_rows)))
    if "ingest" in parts:
        run_ingest_part(args, seconds)
    if "queries" in parts:
        print(
            f"\n## queries, {args.nodes}-node fleet ({args.rows_per_node} rows per node per bucket; "
            f"medians of {repeats})\n"
        )
        print(table(run_queries(args.nodes, args.rows_per_node, repeats, args.clickhouse)))
    return 0


def run_ingest_part(args: argparse.Namespace, seconds: float) -> None:
    print(
        f"\n## ingest through gRPC ({args.agents} agents, batches of {SAMPLES_PER_BATCH:,} samples, "
        f"{args.stacks:,} stacks with wire ids, {args.processes} processes; "
        f"{seconds:.0f} s per store)\n"
    )
    templates = make_templates(
        6,
        args.stacks,
        args.processes,
        packed=args.stack_form != "messages",
        frame_ids=args.stack_form == "packed",
    )
    print(f"(batch wire size {templates[0].ByteSize() / 1024:.0f} KiB)")
    rows = []
    server = None
    if args.clickhouse and (_want(args, "clickhouse") or _want(args, "two")):
        server = ClickHouse(scratch("bench-clickhouse")).start()
    try:
        _ingest_rows(args, seconds, templates, rows, server)
    finally:
        if server is not None:
            server.remove()
    print(table(rows))


def _want(args: argparse.Namespace, store: str) -> bool:
    return store in args.stores.split(",")


def _ingest_rows(
    args: argparse.Namespace,
    seconds: float,
    templates: list[pb.Batch],
    rows: list[dict],
    server: ClickHouse | None,
) -> None:
    for share in [float(x) for x in args.new_stacks.split(",")]:
        new = f", {100 * share:g}% new stacks"
        if _want(args, "memory"):
            rows.append(
                run_ingest("in-memory (baseline)" + new, None, templates, args.agents, seconds, share)
            )
        if share == 0 and _want(args, "tls"):
            certs = Path(tempfile.mkdtemp(prefix="fleetprof-bench-tls-"))
            try:
                label = "in-memory, mutual TLS + token" + new
                secured = Secured(certs)
                rows.append(run_ingest(label, None, templates, args.agents, seconds, share, secured))
            finally:
                shutil.rmtree(certs, ignore_errors=True)
        if _want(args, "durable"):
            tmp = Path(tempfile.mkdtemp(prefix="fleetprof-bench-i-"))
            try:
                rows.append(
                    run_ingest("durable (--data-dir)" + new, tmp, templates, args.agents, seconds, share)
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if server is not None and _want(args, "clickhouse"):
            label = "ClickHouse 18.16 (--clickhouse)" + new
            rows.append(run_ingest(label, None, templates, args.agents, seconds, share, clickhouse=server))
        if server is not None and share == 0 and _want(args, "two"):
            # two collectors on one ClickHouse, the agents split between them
            label = "ClickHouse, two collectors" + new
            rows.append(
                run_ingest(
                    label, None, templates, 2 * args.agents, seconds, share, clickhouse=server, collectors=2
                )
            )


if __name__ == "__main__":
    sys.exit(main())
