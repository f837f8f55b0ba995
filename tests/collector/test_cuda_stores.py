"""Every store keeps the CUDA data and answers for it alike: launches and kernel time as profiles, CUDA calls
apart from the syscalls beside them, and the exact GPU activity per pod. In memory, in DuckDB (after a flush
and after a restart) and in ClickHouse (Debian's 18.16 server and chdb's 26.x)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.gpu import gpu_window
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.query.answers import Scope
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.service import QueryService
from fleetprof.collector.store.clickhouse import ClickHouseStore
from fleetprof.collector.store.clickhouse.schema import Layout
from fleetprof.collector.store.gpu_usage import GpuUsageLog
from fleetprof.collector.store.memory import MemoryStore
from tests.collector.test_cuda_collector import GEMM, RELU, trainer_batch
from tests.collector.test_cuda_gpus import window
from tests.support.chdb_connection import ChdbConnection
from tests.support.stores import Clock, backend_store, open_durable


def answers(query: QueryService, now: float) -> dict:
    """What the CUDA views answer over the minutes around `now` (when the batches were fed)."""

    def scope(kind: str = "cpu", q: str = "{}") -> Scope:
        return Scope(parse_selector(q), now - 300, now + 60, kind)

    def leaves(kind: str, q: str = "{}") -> dict[str, int]:
        out: dict[str, int] = {}
        for stack, n in query.profile(scope(kind, q)).stacks.items():
            out[stack[-1].function] = out.get(stack[-1].function, 0) + n
        return out

    calls, total = query.cuda_calls(scope(), ["pod", "call"], "count", 10)
    syscalls, sys_total = query.syscalls(scope(), ["syscall"], "count", 10)
    pods = {
        p.pod: (p.idle_source, p.idle_ratio, p.gaps, tuple(p.gap_histogram))
        for p in query.gpu_report(scope(), 10, functions=False)
    }
    return {
        "launches": leaves("cuda_launch", '{pod="trainer-0"}'),
        "idle launches": leaves("cuda_launch", '{gpu_state="idle"}'),
        "kernel ns": leaves("gpu"),
        "cpu": sum(query.profile(scope()).stacks.values()),
        "calls": [(c.labels, c.count, c.timed, c.histogram) for c in calls],
        "call total": total,
        "syscalls": [(r.labels, r.count) for r in syscalls] + [sys_total],
        "pods": pods,
    }


EXPECTED = {
    "launches": {GEMM: 800, RELU: 500},
    "idle launches": {RELU: 400},
    "kernel ns": {GEMM: 600_000_000, RELU: 75_000_000},
    "cpu": 4 + 36,  # the trainer batch's 4, the two GPU windows' 18 each
    "calls": [
        ({"pod": "", "call": "cudaStreamSynchronize"}, 1000, 1000, [(2**10 / 1e9, 1000)]),
        ({"pod": "trainer-0", "call": "cudaStreamSynchronize"}, 10, 10, [(2**22 / 1e9, 8), (2**23 / 1e9, 2)]),
        ({"pod": "trainer-0", "call": "cudaMalloc"}, 3, 3, [(2**10 / 1e9, 3)]),
    ],
    "call total": 1013,
    "syscalls": [({"syscall": "read"}, 5), 5],
    "pods": {
        "trainer-0": ("activity", round(37.024 / 1800, 4), 5, (1, 1, 0, 1, 2, 0, 0)),
        "infer-0": ("nvml", 0.5, 0, (0,) * 7),
    },
}


def feed(store, usage, source: str = "agent-1") -> float:  # any ProfileStore, any GpuUsage
    """The batches into the store and the usage log, as ingest writes them; the time they end (now)."""
    decoder = Decoder(getattr(store, "ids", None) or ContentIds())
    end = time.time_ns()
    batches = (trainer_batch(), window(1, end - 10**9, [5, 20, 0.02]), window(2, end, [12, 0.004]))
    for seq, batch in enumerate(batches, start=1):
        rows = decoder.decode(batch)
        if isinstance(store, MemoryStore):
            store.write(rows)
        else:  # as ingest writes to a store that logs batches itself
            assert store.write_logged(source, seq, batch.SerializeToString(), rows)
        if (gpu := gpu_window(batch)) is not None:
            usage.observe(gpu)
    return end / 1e9


def test_the_memory_store_answers_the_cuda_views() -> None:
    store = MemoryStore(clock=time.time)
    usage = GpuUsageLog(clock=time.time)
    now = feed(store, usage)
    assert answers(QueryService(store, usage), now) == EXPECTED


def test_duckdb_answers_them_after_a_flush_and_a_restart(tmp_path: Path) -> None:
    clock = Clock(time.time() + 30)
    store = open_durable(tmp_path, clock=clock, background=False)
    usage = GpuUsageLog(clock=clock)
    now = feed(store, usage)
    store.flush()
    assert store.stats()["pending_rows"] == 0
    assert answers(QueryService(store, usage), now) == EXPECTED
    store.close()
    again = open_durable(tmp_path, clock=clock, background=False)
    try:
        assert answers(QueryService(again, usage), now) == EXPECTED
    finally:
        again.close()


@pytest.mark.clickhouse
@pytest.mark.parametrize("backend", ["server", "chdb"])
def test_clickhouse_answers_them_and_keeps_the_activity(backend: str, request: pytest.FixtureRequest) -> None:
    database = f"cuda_{backend}_{time.time_ns()}"
    store = backend_store(backend, request, database)
    try:
        now = feed(store, store.gpu_usage)
        assert answers(QueryService(store, store.gpu_usage), now) == EXPECTED
    finally:
        store.close()


@pytest.mark.clickhouse
def test_a_version_1_database_made_before_the_activity_table_gains_it(chdb: object) -> None:
    """A database whose schema predates gpu_activity (dropped here, as it was) gets it when a collector
    opens it, and keeps what it held."""
    database = f"cuda_old_{time.time_ns()}"
    conn = ChdbConnection(chdb)
    store = ClickHouseStore(conn, Layout(database, None), background=False)
    now = feed(store, store.gpu_usage)
    store.close()
    conn.query(f"DROP TABLE {database}.gpu_activity")
    again = ClickHouseStore(conn, Layout(database, None), background=False)
    try:
        got = answers(QueryService(again, again.gpu_usage), now)
        # The activity went with the table; NVML's rows and everything else are as they were.
        assert got["pods"]["trainer-0"][0] == "nvml" and got["launches"] == EXPECTED["launches"]
        now = feed(again, again.gpu_usage, "agent-2")
        assert answers(QueryService(again, again.gpu_usage), now)["pods"]["trainer-0"][0] == "activity"
    finally:
        again.close()
