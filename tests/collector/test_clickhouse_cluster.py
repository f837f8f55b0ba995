"""Many collectors, one replicated ClickHouse: a batch acknowledged is stored once, whatever dies.

A cluster of two shards of two replicas (four clickhouse-server 18.16 on loopback, one ZooKeeper 3.8), two
collector processes on it (`--clickhouse ...?cluster=fleet`, quorum 2), and two agent-shaped senders: the
agent's own Shipper (its bounded queue, acknowledgements, reconnects and resends over real gRPC) fed
tests/support/wire.py batches of known samples. A real agent would add only BPF sampling, whose sample counts
are not known beforehand; what this test proves lives in the Shipper and the collectors. Each sender's target
lists both collectors (gRPC's pick_first, as a Kubernetes Service's endpoints), its own first.

Mid-stream, one collector is killed with SIGKILL (its sender reconnects to the other and resends what
was not acknowledged), then one replica of a shard is killed (inserts there cannot reach their quorum:
batches are refused, kept by the senders, and go in once the replica is back). The totals read back, per
node, must equal what the senders were acknowledged for: none lost, none doubled; every replica of a shard
ends with the same rows. Then every batch is sent again through a fresh collector: all duplicates.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.shipper import Shipper
from fleetprof.collector.model.profile import FrameKey, SyscallAgg
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.base import StoreUnavailable
from fleetprof.collector.store.clickhouse import open_clickhouse
from fleetprof.collector.store.clickhouse.config import parse_url
from fleetprof.collector.store.clickhouse.connection import NativeConnection
from fleetprof.collector.store.clickhouse.schema import Layout, upgrade_ddl
from tests.conftest import REPO, free_port, http_get, wait_until, wait_until_serving
from tests.support.clickhouse_servers import ClickHouse, Cluster, scratch
from tests.support.wire import BatchBuilder

pytestmark = [pytest.mark.clickhouse, pytest.mark.slow(seconds=160)]  # ~160 s: replication, quorum timeouts

DATABASE = "fleetprof"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(scratch("cluster"), shards=2, replicas=2, name="fleet").start()
    yield c
    c.stop(remove=os.environ.get("FLEETPROF_KEEP_CLUSTER") is None)


@dataclass
class CollectorProcess:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    log: Path

    def metric(self, name: str) -> float:
        for line in http_get(f"http://127.0.0.1:{self.http_port}/metrics").decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_collector(servers: list[ClickHouse], directory: Path) -> CollectorProcess:
    hosts = ",".join(f"127.0.0.1:{s.tcp_port}" for s in servers)
    grpc_port, http_port = free_port(), free_port()
    log = directory / f"collector-{grpc_port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetprof.cli", "collector", "--grpc", f"127.0.0.1:{grpc_port}",
         "--http", f"127.0.0.1:{http_port}", "--clickhouse", f"clickhouse://{hosts}/{DATABASE}?cluster=fleet"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),  # lives with the process
    )  # fmt: skip
    wait_until_serving(proc, f"http://127.0.0.1:{http_port}/healthz", 60, "a ClickHouse collector")
    return CollectorProcess(proc, grpc_port, http_port, log)


@dataclass
class Sender:
    """An agent's Shipper with batches of known samples: `acked` sums what the collector acknowledged."""

    node: str
    target: str
    agent_id: str
    shipper: Shipper = field(init=False)
    submitted: dict[int, int] = field(default_factory=dict)  # sequence -> samples
    batches: dict[int, pb.Batch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shipper = Shipper(self.target, backoff_s=(0.1, 1.0))
        self.shipper.start()

    def send(self, i: int) -> None:
        b = BatchBuilder(node=self.node, agent_id=self.agent_id, window_s=0.2)
        proc = b.process(100 + i % 3, "worker", {"namespace": "ml", "pod": f"{self.node}-pod"})
        b.sample(proc, b.stack([("main", "app"), (f"step_{i % 7}", "app")]), 3 + i % 5)
        b.sample(proc, b.stack([("main", "app"), ("io", "app")]), 1 + i % 2)
        batch = b.build()
        seq = self.shipper.submit(batch)
        self.submitted[seq] = 4 + i % 5 + i % 2
        self.batches[seq] = batch


def _total(col: CollectorProcess, node: str) -> int:
    """The node's CPU samples over the last hour, as the collector's API answers."""
    query = urllib.parse.urlencode({"since": "1h", "query": f'{{node="{node}"}}'})
    return json.loads(http_get(f"http://127.0.0.1:{col.http_port}/api/v1/top?{query}"))["total"]


def _shard_of(conn: NativeConnection, node: str) -> int:
    return conn.query(f"SELECT sipHash64('{node}') % 2")[0][0]


def _local_samples(server: ClickHouse, database: str = DATABASE) -> dict[str, int]:
    conn = NativeConnection(parse_url(f"{server.url}/{database}"), size=1)
    try:
        rows = conn.query(f"SELECT node, sum(count) FROM {database}.rows_local WHERE kind = 1 GROUP BY node")
        return {node: n for node, n in rows}
    finally:
        conn.close()


def _held_samples(reader: NativeConnection, database: str) -> dict[str, int]:
    """CPU samples in each of `rows`, `rows_1m`, `rows_10m`, read through its Distributed table from
    replicas that have them (a part still waiting for its quorum is not read)."""
    settings = {
        "load_balancing": "in_order",
        "prefer_localhost_replica": 0,
        "select_sequential_consistency": 1,
    }
    return {
        table: reader.query(f"SELECT sum(count) FROM {database}.{table} WHERE kind = 1", settings=settings)[
            0
        ][0]
        for table in ("rows", "rows_1m", "rows_10m")
    }


def _resent_until_answered(store, source: str, seq: int, rows: ProfileRows) -> bool:
    """What an agent does with a refused batch: send it again, a second apart, until the store answers
    (stored, or stored before); the answer. Right after a replica resumes its fetches, the quorum of the
    insert that timed out is still open until it has fetched that part, and ClickHouse 18.16 refuses the
    next quorum insert on the shard meanwhile ("Quorum for previous write has not been satisfied yet": a
    fresh-clone run, the resend made as the fetches resumed)."""
    answer: list[bool] = []

    def answered() -> bool:
        try:
            answer.append(store.write_logged(source, seq, b"", rows))
            return True
        except StoreUnavailable:
            return False

    wait_until(answered, 120, f"the store to answer batch {seq} of {source} sent again", every=1.0)
    return answer[0]


def test_kill_a_collector_and_a_replica_mid_stream_and_count_exactly(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="fleetprof.agent.shipper")
    servers = cluster.all  # s1r1, s1r2, s2r1, s2r2
    logs = cluster.directory  # pytest's tmp_path may be deleted by another run's cleanup (see scratch)
    a = start_collector(servers, logs)
    b = start_collector([servers[2], servers[3], servers[0], servers[1]], logs)
    probe = NativeConnection(parse_url(f"{servers[0].url}/{DATABASE}"), size=1)
    # the schema as made is the schema as wanted: no open would drop and make a Distributed table again
    assert upgrade_ddl(probe, Layout(DATABASE, "fleet")) == []
    # one sender's node on each shard
    names = [f"node-{i}" for i in range(40)]
    node_1 = next(n for n in names if _shard_of(probe, n) == 0)
    node_2 = next(n for n in names if _shard_of(probe, n) == 1)
    senders = [
        Sender(node_1, f"ipv4:127.0.0.1:{a.grpc_port},127.0.0.1:{b.grpc_port}", "agent-1"),
        Sender(node_2, f"ipv4:127.0.0.1:{b.grpc_port},127.0.0.1:{a.grpc_port}", "agent-2"),
    ]
    stop = threading.Event()

    def stream(s: Sender) -> None:
        i = 0
        while not stop.is_set():
            s.send(i)
            i += 1
            stop.wait(0.7)  # a real agent sends every 10 s; a stream is acknowledged ~0.4 s a batch

    threads = [threading.Thread(target=stream, args=(s,), daemon=True) for s in senders]
    killed_replica = servers[1]  # s1r2: the shard of node_1 loses half of its quorum
    fresh = None
    try:
        for t in threads:
            t.start()
        wait_until(
            lambda: all(s.shipper.stats.batches_acked >= 4 for s in senders), 60, "batches acknowledged"
        )
        a.kill()  # SIGKILL mid-stream: sender 1 moves to b and resends what a had not acknowledged
        acked = senders[0].shipper.stats.batches_acked
        wait_until(
            lambda: senders[0].shipper.stats.batches_acked >= acked + 4, 60, "sender 1 acknowledged by b"
        )
        killed_replica.kill()
        time.sleep(4)  # shard 1 cannot reach its quorum: its batches wait in sender 1's queue
        assert senders[0].shipper.pending() > 0
        killed_replica.start()
        acked = senders[0].shipper.stats.batches_acked
        wait_until(lambda: senders[0].shipper.stats.batches_acked >= acked + 4, 60, "shard 1 taking batches")
        stop.set()
        for t in threads:
            t.join()
        for s in senders:
            assert s.shipper.flush(120), f"{s.node}: {s.shipper.pending()} batches never acknowledged"
            assert s.shipper.stats.batches_dropped == 0 and s.shipper.stats.batches_rejected == 0
        expected = {s.node: sum(s.submitted.values()) for s in senders}
        # what any collector answers for the fleet: every node's exact total
        assert {s.node: _total(b, s.node) for s in senders} == expected
        # every replica of a shard converges to the same rows
        shard_1, shard_2 = cluster.servers
        for shard, node in ((shard_1, node_1), (shard_2, node_2)):
            wait_until(
                lambda shard=shard, node=node: all(
                    _local_samples(r).get(node, 0) == expected[node] for r in shard
                ),
                60,
                f"both replicas of {node}'s shard to hold its {expected[node]} samples",
            )
        # every batch again, through a collector that stored none of them: all found, none stored
        fresh = start_collector(servers, logs)
        for s in senders:
            again = Shipper(f"127.0.0.1:{fresh.grpc_port}", backoff_s=(0.1, 1.0))
            again.start()
            for seq in sorted(s.batches):
                batch = pb.Batch()
                batch.CopyFrom(s.batches[seq])
                assert again.submit(batch) == seq
            assert again.flush(60)
            again.stop()
        total = sum(len(s.batches) for s in senders)
        assert fresh.metric("fleetprof_ingest_duplicate_batches_total") == total
        assert fresh.metric("fleetprof_ingest_batches_total") == 0
        assert {s.node: _total(fresh, s.node) for s in senders} == expected
    finally:
        stop.set()
        for s in senders:
            s.shipper.stop(flush_timeout_s=0)
        for c in (a, b, fresh):
            if c is not None:
                c.stop()
        probe.close()
        if killed_replica.proc is None or killed_replica.proc.poll() is not None:
            killed_replica.start()


def test_a_batch_a_rollup_missed_is_completed_once_when_resent(cluster: Cluster) -> None:
    """What the test above once read (a node one batch short, through rows_10m, with every row in
    rows_local), made to happen: the second replica of a shard fetches no parts of rows_10m_local (SYSTEM
    STOP FETCHES), so a batch's insert lands in `rows` while its 10 minute rollup waits for a quorum that
    times out (its part written, held back from reads until replicated): the batch is refused. The next
    batch's 10 minute rollup is refused at once (18.16 takes one quorum insert per table and shard at a
    time), and so are the writer's tries of it alone, on the same shard, until they give up. Once fetches
    resume, both batches resent are stored: each table, read through its Distributed table, holds every
    sample once, and a collector that opens the database afresh finds both stored."""
    servers = cluster.all  # s1r1, s1r2, s2r1, s2r2: inserts reach s1r1 first (load_balancing in_order)
    database = "fp_half"
    hosts = ",".join(f"127.0.0.1:{s.tcp_port}" for s in servers)
    url = parse_url(f"clickhouse://{hosts}/{database}?cluster=fleet")
    store = open_clickhouse(url, retention_s=86400.0, background=False)
    lagging = NativeConnection(parse_url(f"{servers[1].url}/{database}"), size=1)
    node = next(n for n in (f"node-{i}" for i in range(40)) if _shard_of(lagging, n) == 0)
    now = time.time()
    lb = (("comm", "w"), ("node", node), ("pid", "7"))
    stacks = [(FrameKey("main", "app"), FrameKey(f"f{i}", "app")) for i in range(2)]
    batches = [
        ProfileRows.from_rows(t - 10, t, 19, [(lb, stacks[0], 5 + i), (lb, stacks[1], 2)],
                              [(lb, "read", SyscallAgg(4 + i, 0, 0, []))], ids=store.ids)
        for i, t in enumerate((now - 20, now - 10))
    ]  # fmt: skip
    samples = sum(7 + i for i in range(2))
    reader = NativeConnection(parse_url(f"{servers[0].url}/{database}"), size=1)

    def held() -> dict[str, int]:
        return _held_samples(reader, database)

    lagging.query(f"SYSTEM STOP FETCHES {database}.rows_10m_local")
    try:
        for seq, rows in enumerate(batches):
            with pytest.raises(StoreUnavailable):
                store.write_logged("agent-h", seq, b"", rows)
        assert held()["rows"] == samples  # every batch's rows went in
    finally:
        lagging.query(f"SYSTEM START FETCHES {database}.rows_10m_local")
    try:
        for seq, rows in enumerate(batches):
            assert _resent_until_answered(store, "agent-h", seq, rows) is True
        assert store.stats()["rollups_completed"] >= 1
        assert held() == {"rows": samples, "rows_1m": samples, "rows_10m": samples}
    finally:
        store.close()
    again = open_clickhouse(url, retention_s=86400.0, background=False)
    try:
        for seq, rows in enumerate(batches):
            assert again.write_logged("agent-h", seq, b"", rows) is False
    finally:
        again.close()
        lagging.close()
        reader.close()


def test_a_batch_whose_quorum_timed_out_is_once_in_every_table_when_resent(cluster: Cluster) -> None:
    """The window the test above leaves, in `rows` itself: the second replica of a shard fetches no parts of
    rows_local, so a batch's insert times out on its quorum with its part written and held back from reads
    (and no view run). The batch is refused, and resent once fetches resume; the replica's fetch lands
    between the writer's lookup (the batch missing) and its insert, as it can in production: the connection
    resumes the fetches at that moment and waits until the part is readable. `rows` then holds the batch
    twice and the rollups once; the writer reads the markers again and takes the copy back. Each table,
    read through its Distributed table, holds every sample once, and a fresh collector finds it stored."""
    servers = cluster.all  # s1r1, s1r2, s2r1, s2r2: inserts reach s1r1 first (load_balancing in_order)
    database = "fp_limbo"
    hosts = ",".join(f"127.0.0.1:{s.tcp_port}" for s in servers)
    url = parse_url(f"clickhouse://{hosts}/{database}?cluster=fleet")
    store = open_clickhouse(url, retention_s=86400.0, background=False)
    lagging = NativeConnection(parse_url(f"{servers[1].url}/{database}"), size=1)
    reader = NativeConnection(parse_url(f"{servers[0].url}/{database}"), size=1)
    node = next(n for n in (f"node-{i}" for i in range(40)) if _shard_of(lagging, n) == 0)
    now = time.time()
    lb = (("comm", "w"), ("node", node), ("pid", "7"))
    stack = (FrameKey("main", "app"), FrameKey("step", "app"))
    rows = ProfileRows.from_rows(now - 20, now - 10, 19, [(lb, stack, 11)],
                                 [(lb, "read", SyscallAgg(3, 0, 0, []))], ids=store.ids)  # fmt: skip

    def held() -> dict[str, int]:
        return _held_samples(reader, database)

    lagging.query(f"SYSTEM STOP FETCHES {database}.rows_local")
    try:
        with pytest.raises(StoreUnavailable):
            store.write_logged("agent-l", 0, b"", rows)
        assert held() == {"rows": 0, "rows_1m": 0, "rows_10m": 0}  # written, not readable, no view ran
    except BaseException:
        lagging.query(f"SYSTEM START FETCHES {database}.rows_local")
        raise
    conn, insert = store._conn, store._conn.insert
    appeared = []

    def fetched_then_insert(table: str, columns: dict, settings: dict | None = None) -> None:
        if table == f"{database}.rows" and not appeared:
            appeared.append(table)
            lagging.query(f"SYSTEM START FETCHES {database}.rows_local")
            wait_until(lambda: held()["rows"] == 11, 60, "the replica to fetch the part that waited")
        insert(table, columns, settings)

    conn.insert = fetched_then_insert  # type: ignore[method-assign]
    try:
        assert store.write_logged("agent-l", 0, b"", rows) is True
        assert appeared and store.stats()["copies_taken_back"] == 1
        assert held() == {"rows": 11, "rows_1m": 11, "rows_10m": 11}
        for server in servers[:2]:  # both replicas of the shard hold the same
            assert _local_samples(server, database) == {node: 11}, server.url
    finally:
        if not appeared:
            lagging.query(f"SYSTEM START FETCHES {database}.rows_local")
        store.close()
    again = open_clickhouse(url, retention_s=86400.0, background=False)
    try:
        assert again.write_logged("agent-l", 0, b"", rows) is False
        assert again.select(parse_selector(f'{{node="{node}"}}'), now - 3600, now).total == 11
    finally:
        again.close()
        lagging.close()
        reader.close()
