"""The collector's Prometheus metrics: CPU seconds per pod (capped), ingest, store and query self-metrics."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.metrics.cpu import CpuMetrics
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from tests.conftest import http_get, start_collector
from tests.support.wire import make_batch, push


def pod_batch(seq: int, count: int, pod: str = "trainer-0") -> pb.Batch:
    b = make_batch(seq, "metrics-agent", node="gpu-1", count=count)
    base = len(b.strings)
    b.strings.extend(["namespace", "ml", "pod", pod, "container", "main"])
    b.processes[0].labels.extend(
        [
            pb.Label(name=base, value=base + 1),
            pb.Label(name=base + 2, value=base + 3),
            pb.Label(name=base + 4, value=base + 5),
        ]
    )
    return b


def test_cpu_seconds_per_pod_ingest_store_and_query_metrics(tmp_path: Path) -> None:
    col = start_collector(data_dir=str(tmp_path))
    try:
        target = f"127.0.0.1:{col.grpc_port}"
        assert push(target, [pod_batch(1, 38), pod_batch(2, 19)]) == [1, 2]
        push(target, [make_batch(1, "host-agent", node="gpu-2", count=19)])
        reg = col.registry
        pod = {"node": "gpu-1", "namespace": "ml", "pod": "trainer-0", "container": "main"}
        assert reg.get_sample_value("fleetprof_cpu_seconds_total", pod) == 3.0  # 57 samples at 19 Hz
        host = {"node": "gpu-2", "namespace": "", "pod": "", "container": ""}
        assert reg.get_sample_value("fleetprof_cpu_seconds_total", host) == 1.0
        assert reg.get_sample_value("fleetprof_ingest_batches_total") == 3
        assert reg.get_sample_value("fleetprof_ingest_samples_total") == 76
        q = urllib.parse.urlencode({"query": '{pod="trainer-0"}', "since": "2h"})
        http_get(f"http://127.0.0.1:{col.http_port}/api/v1/top?{q}")
        assert reg.get_sample_value("fleetprof_store_query_seconds_count", {"method": "select"}) == 1
        col.store.flush()
        assert reg.get_sample_value("fleetprof_store_disk_bytes") > 0
        assert reg.get_sample_value("fleetprof_store_rows_samples") == 2  # two label sets, one stack
        text = http_get(f"http://127.0.0.1:{col.http_port}/metrics").decode()
        assert (
            'fleetprof_cpu_seconds_total{container="main",namespace="ml",node="gpu-1",pod="trainer-0"} 3.0'
            in text
        )
        assert "fleetprof_store_query_seconds_bucket" in text
    finally:
        col.stop()


def test_cpu_series_per_node_are_capped_and_the_rest_is_other() -> None:
    m = CpuMetrics(per_node_limit=3)
    rows = [
        ((("container", "c"), ("namespace", "ns"), ("node", "n1"), ("pod", f"p{i}")), (), 10)
        for i in range(5)
    ]
    m.observe(ProfileRows.from_rows(0, 10, 10, rows, ids=ContentIds()))
    m.observe(ProfileRows.from_rows(10, 20, 10, rows[:1], ids=ContentIds()))
    series = {tuple(s.labels.values()): s.value for fam in m.collect() for s in fam.samples}
    assert len(series) == 4
    assert series[("n1", "ns", "p0", "c")] == 2.0
    assert series[("n1", "ns", "other", "other")] == 2.0  # p3 and p4, one second each


def test_cpu_seconds_are_exact_and_the_collector_exports_its_own_process_metrics() -> None:
    """2,261 samples at 19 Hz are 119 s. Sent as 323 batches of 7 samples, 7/19 added up in floats read
    118.99999999999972; the counter is the exact sum, rounded once. /metrics is scraped over HTTP."""
    col = start_collector()
    try:
        target = f"127.0.0.1:{col.grpc_port}"
        assert len(push(target, [pod_batch(seq, 7) for seq in range(1, 324)])) == 323
        text = http_get(f"http://127.0.0.1:{col.http_port}/metrics").decode()
        series = 'fleetprof_cpu_seconds_total{container="main",namespace="ml",node="gpu-1",pod="trainer-0"}'
        (line,) = [ln for ln in text.splitlines() if ln.startswith(series)]
        assert line == f"{series} 119.0"
        families = {f.name: f for f in text_string_to_metric_families(text)}
        (rss,) = families["process_resident_memory_bytes"].samples
        assert rss.value > 10 * 2**20  # a Python process with grpcio and numpy loaded
        (cpu,) = families["process_cpu_seconds"].samples
        assert cpu.value > 0
        assert families["process_open_fds"].samples[0].value > 0
        assert families["python_info"].samples[0].labels["implementation"] == "CPython"
    finally:
        col.stop()
