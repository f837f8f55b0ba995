"""The per-pod GPU report (/api/v1/gpus, `fleetprof gpus`) reads the stacks of every pod's idle time with
one grouped select of the store (select_groups), whatever the number of pods, and answers as a select per
pod did. On a fleet of pods on two nodes sampled at two frequencies (so a pod's wall time needs its own
sampling period): pods with the CUPTI library's exact idle and pods NVML alone reports, CPU samples,
off-CPU time of active and idle threads, CUDA launches and kernel time, a host process beside them. In
memory, in DuckDB (its hot tier, and its database after a restart) and in ClickHouse (Debian's 18.16
server and chdb)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.gpu import gpu_window
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import GPU_STATE_NAME
from fleetprof.collector.model.selector import Matcher, Selector
from fleetprof.collector.query.answers import Scope
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.service import QueryService
from fleetprof.collector.query.typed import TypedStore
from fleetprof.collector.query.waits import blocked_where
from fleetprof.collector.store.gpu_usage import GpuUsageLog
from fleetprof.collector.store.memory import MemoryStore
from tests.support.stores import Clock, backend_store, open_durable
from tests.support.wire import BatchBuilder, kernel_stack

MS = 1_000_000
PODS_PER_NODE = 4
# (node, sampling frequency): the pods' CPU samples turn into wall nanoseconds at their own node's period
NODES = (("gpu-1", 19), ("gpu-2", 97))
# the views a report can be asked in: each type with its default thread choice, and the other one
VIEWS = (("cpu", None), ("offcpu", None), ("offcpu", "all"), ("wall", None), ("wall", "all"),
         ("cuda_launch", None), ("gpu", None))  # fmt: skip


def node_window(node: int, seq: int, end_ns: int) -> pb.Batch:
    """A 1 s window of one node: PODS_PER_NODE pods on a GPU each, the even ones with the CUPTI library
    (exact idle gaps), the odd ones without (NVML's polls only), each idle on its GPU in a share of its
    polls that differs per pod; per pod its own stacks while idle and busy, off-CPU time of an active and
    an idle thread while idle, CUDA launches and kernel time; and a host process with no pod."""
    name, hz = NODES[node]
    b = BatchBuilder(name, f"c0da00000000000000000000000000{node:02x}", seq, end_ns=end_ns, frequency_hz=hz)
    host = b.process(90, "bench")
    b.sample(host, b.stack([("main", "bench"), ("spin", "bench")]), 7)
    for i in range(PODS_PER_NODE):
        n = node * PODS_PER_NODE + i
        # a "." in every name: a regex built from the names must take it as a dot, not as any character
        pod = b.process(
            10 + i, "python3", {"namespace": f"ns-{n % 2}", "pod": f"train.{n}", "container": "main"}
        )
        gpu = b.batch.gpu_devices.add(index=i, uuid=b.string(f"GPU-{node}-{i}"), name=b.string("NVIDIA H100"))
        for k in range(4):
            t = b.batch.start_unix_ns + k * 250 * MS
            gpu.samples.add(time_unix_ns=t, gpu_utilization_percent=0 if k < i else 70)
        b.batch.gpu_processes.add(process=pod, device=i, polls=4, state_polls=4, idle_polls=min(i, 4))
        if i % 2 == 0:
            b.cuda_activity(pod, i, known_ns=900 * MS, gaps_ns=[(n + 1) * MS, 3 * MS], uuid=f"GPU-{node}-{i}")
        load = [("main", "train.py"), (f"load_{n} (train.py:{n})", "train.py")]
        step = [("main", "train.py"), ("step (train.py:12)", "train.py")]
        wait = [("main", "train.py"), (f"get_{n} (queue.py:171)", "queue.py"), ("futex_wait", "[kernel]")]
        pool = [("worker", "train.py"), ("pool_wait", "queue.py"), ("futex_wait", "[kernel]")]
        b.sample(pod, b.stack(load), 3 + n, pb.GPU_STATE_IDLE)
        b.sample(pod, b.stack(step), 11, pb.GPU_STATE_BUSY)
        b.offcpu(pod, b.stack(wait, kernel_start=2), (n + 2) * MS, pb.GPU_STATE_IDLE)
        b.offcpu(pod, b.stack(pool, kernel_start=2), 500 * MS, pb.GPU_STATE_IDLE, idle=True)
        launch = b.stack(kernel_stack(step, f"kernel_{n}"))
        b.cuda_launch(pod, launch, 20 + n, pb.GPU_STATE_IDLE)
        b.gpu_kernel(pod, launch, (n + 1) * 1_000_000)
    b.batch.gpu_source.MergeFrom(pb.GpuSource(up=True, state=b.string("up"), idle_below_percent=5))
    return b.build()


def feed(store, usage) -> float:  # any ProfileStore, any GpuUsage
    """Two windows of each node into the store and the usage log, as ingest writes them; the time they end."""
    decoder = Decoder(getattr(store, "ids", None) or ContentIds())
    end = time.time_ns()
    seq = 0
    for node in range(len(NODES)):
        for back in (1, 0):
            seq += 1
            batch = node_window(node, seq, end - back * 10**9)
            rows = decoder.decode(batch)
            if isinstance(store, MemoryStore):
                store.write(rows)
            else:  # as ingest writes to a store that logs batches itself
                assert store.write_logged(f"agent-{node}", seq, batch.SerializeToString(), rows)
            usage.observe(gpu_window(batch))
    return end / 1e9


def per_pod(store, usage, scope: Scope, limit: int) -> dict:  # any ProfileStore, GpuUsage
    """What a select per pod answers for each pod of the report (the path the grouped select replaced):
    the idle stacks as the scope's type counts them, and the wall time's two halves of active threads."""
    typed, wall = TypedStore(store, scope.kind, scope.threads), TypedStore(store, "wall", "active")
    out = {}
    for p in usage.pods(scope.selector, scope.start, scope.end)[:limit]:
        idle = Selector((
            *scope.selector.matchers,
            Matcher("namespace", "=", p.namespace),
            Matcher("pod", "=", p.pod),
            Matcher(GPU_STATE_NAME, "=", "idle"),
        ))  # fmt: skip
        own = typed.select(idle, scope.start, scope.end).stacks
        running, waits = wall.select_apart(idle, scope.start, scope.end)
        merged = dict(running.stacks)
        for stack, ns in waits.stacks.items():
            merged[stack] = merged.get(stack, 0) + ns
        out[p.pod] = (own, merged, blocked_where(waits.stacks, running.stacks))
    return out


def grouped(query: QueryService, scope: Scope, limit: int) -> dict:
    return {
        r.pod: (r.idle_stacks, r.idle_wall_stacks, r.idle_wall_waits)
        for r in query.gpu_report(scope, limit, functions=True)
    }


def counting(store, monkeypatch: pytest.MonkeyPatch) -> Counter:  # any ProfileStore
    """The calls of the store's query methods from now on, by name (the real methods, counted)."""
    calls: Counter = Counter()
    for name in ("select", "select_groups", "group", "series", "syscalls"):
        method = getattr(store, name)

        def counted(*args, _method=method, _name=name):
            calls[_name] += 1
            return _method(*args)

        monkeypatch.setattr(store, name, counted)
    return calls


def check(store, usage, now: float, monkeypatch: pytest.MonkeyPatch) -> None:  # any ProfileStore, GpuUsage
    """Every view's report over all pods (and over the first three, and one namespace) equals the per-pod
    path's, and took one select_groups and one group of the store whatever the number of pods."""
    pods = usage.pods(Selector(), now - 300, now + 60)
    # the fleet the report is about: both idle sources, pods on both nodes
    assert len(pods) == PODS_PER_NODE * len(NODES)
    assert {p.idle_source for p in pods} == {"activity", "nvml"}
    query = QueryService(store, usage)
    for kind, threads in VIEWS:
        for q, limit in (("{}", 50), ("{}", 3), ('{namespace="ns-1"}', 50)):
            scope = Scope(parse_selector(q), now - 300, now + 60, kind, threads)
            expected = per_pod(store, usage, scope, limit)
            calls = counting(store, monkeypatch)
            got = grouped(query, scope, limit)
            monkeypatch.undo()
            assert got == expected, (kind, threads, q, limit)
            assert dict(calls) == {"select_groups": 1, "group": 1}, (kind, threads, q, limit)
            # every pod shown had idle time of its own in this view (kernel time carries no GPU state), so
            # nothing passed for an empty answer
            assert all((own or kind == "gpu") and wall for own, wall, _ in got.values()), (kind, threads, q)
            assert len(got) == min(limit, len(expected)) and len(got) >= 3


def test_the_memory_store_answers_every_pod_with_one_grouped_select(monkeypatch: pytest.MonkeyPatch) -> None:
    store, usage = MemoryStore(clock=time.time), GpuUsageLog(clock=time.time)
    check(store, usage, feed(store, usage), monkeypatch)


def test_duckdb_does_from_its_hot_tier_and_from_its_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # started before the report's range, so its hot tier holds all of it
    clock = Clock(time.time() - 400)
    store = open_durable(tmp_path, clock=clock, background=False)
    usage = GpuUsageLog(clock=time.time)
    now = feed(store, usage)
    check(store, usage, now, monkeypatch)
    assert store.counters["hot_queries"] > 0 and store.counters["cold_queries"] == 0
    store.close()
    clock.t = time.time() + 30  # restarted within the range: its hot tier does not cover it
    again = open_durable(tmp_path, clock=clock, background=False)
    try:
        check(again, usage, now, monkeypatch)
        assert again.counters["cold_queries"] > 0 and again.counters["hot_queries"] == 0
    finally:
        again.close()


def test_select_groups_is_select_per_group(tmp_path: Path) -> None:
    """The store method itself, on both tiers of DuckDB and in memory: each group's stacks and frequency are
    select()'s with a matcher per group-by label, a derived label (service_name) too."""
    mem = MemoryStore(clock=time.time)
    clock = Clock(time.time() + 30)
    durable = open_durable(tmp_path, clock=clock, background=False)
    now = feed(mem, GpuUsageLog(clock=time.time))
    feed(durable, GpuUsageLog(clock=clock))
    durable.flush()
    try:
        for store in (mem, durable):
            # the pods; each node's idle, busy and untagged (kernel time) rows; one workload-less comm; all
            for by, n in ((["pod"], 8), (["node", GPU_STATE_NAME], 6), (["service_name"], 1), ([], 1)):
                groups = store.select_groups(parse_selector('{comm!="bench"}'), now - 300, now + 60, by)
                assert len(groups) == n, (by, list(groups))
                for key, sel in groups.items():
                    one = Selector((Matcher("comm", "!=", "bench"),
                                    *(Matcher(n, "=", v) for n, v in zip(by, key, strict=True))))  # fmt: skip
                    assert sel == store.select(one, now - 300, now + 60), (by, key)
    finally:
        durable.close()


@pytest.mark.clickhouse
@pytest.mark.parametrize("backend", ["server", "chdb"])
def test_clickhouse_does_too(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = f"gpus_{backend}_{time.time_ns()}"
    store = backend_store(backend, request, database)
    try:
        check(store, store.gpu_usage, feed(store, store.gpu_usage), monkeypatch)
    finally:
        store.close()
