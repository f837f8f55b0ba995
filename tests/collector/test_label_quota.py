"""One agent cannot grow the label index without bound: per node, label sets and the distinct values of
each label are capped within an hour (a counted refusal of the whole batch), a process's labels are capped,
and the label listings answer at most `limit` values (bounded by default), of the label sets `match[]`
selects."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

from fleetprof._proto.pyroscope import types_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.validate import BatchError, IngestLimits
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.query import service as query_service
from tests.conftest import RunningCollector, http_get, start_collector
from tests.support.wire import BatchBuilder, push


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def pods_batch(seq: int, processes: int, node: str = "node-a", pod: str = "p-{i}", pid0: int = 0) -> pb.Batch:
    """`processes` processes (pids pid0…), each of pod `pod.format(i=…)`, one sample each; the node's
    agent id."""
    b = BatchBuilder(node, f"a9e17{node.encode().hex()}", seq)
    stack = b.stack([("main", "app")])
    for i in range(processes):
        b.sample(b.process(pid0 + i, "worker", {"pod": pod.format(i=pid0 + i)}), stack, 1)
    return b.build()


def test_a_node_past_its_label_set_cap_is_refused_until_old_sets_age_out() -> None:
    clock = Clock()
    limits = IngestLimits(max_series_per_node=100, series_horizon_s=3600)
    decoder = Decoder(ContentIds(), clock)
    decoder.decode(pods_batch(1, 60, pod="same"), limits)
    decoder.decode(pods_batch(2, 60, pod="same"), limits)  # the same 60 sets: nothing new
    with pytest.raises(BatchError, match="would have 110 label sets") as info:
        decoder.decode(pods_batch(3, 50, pod="same", pid0=60), limits)
    assert info.value.reason == "series_limit"
    decoder.decode(pods_batch(4, 40, pod="same", pid0=60), limits)  # 100: at the cap, not past it
    assert decoder.quota.sizes()["label_sets"] == 100
    # Sets used within the hour stay; unused ones are forgotten after it (and their values with them).
    clock.t += 1800
    decoder.decode(pods_batch(5, 30, pod="same"), limits)  # pids 0-29 in use again
    clock.t += 1900
    assert decoder.quota.sizes()["label_sets"] == 100  # not swept until the next batch looks
    decoder.decode(pods_batch(6, 50, pod="same", pid0=500), limits)
    assert decoder.quota.sizes()["label_sets"] == 80  # pids 0-29 and the 50 new ones


def test_a_label_past_its_distinct_value_cap_is_refused_per_node() -> None:
    limits = IngestLimits(max_values_per_label=50)
    decoder = Decoder(ContentIds())
    decoder.decode(pods_batch(1, 50), limits)
    with pytest.raises(
        BatchError, match="label 'pod' of node 'node-a' would have 51 distinct values"
    ) as info:
        decoder.decode(pods_batch(2, 1, pid0=50), limits)
    assert info.value.reason == "label_values_limit"
    decoder.decode(pods_batch(1, 50, node="node-b"), limits)  # another node has its own quota
    decoder.decode(pods_batch(3, 50, pid0=0, pod="p-{i}"), limits)  # known values: not new
    # Per node: 50 pods and one comm; "p-0".."p-9" are 3 bytes, "p-10".."p-49" 4, "worker" 6.
    sizes = {"tenants": 2, "label_sets": 100, "values": 2 * (50 + 1), "value_bytes": 2 * (30 + 160 + 6)}
    assert decoder.quota.sizes() == sizes


def test_distinct_value_bytes_per_node_are_capped() -> None:
    limits = IngestLimits(max_label_value_bytes_per_node=10_000)
    with pytest.raises(BatchError, match="would hold 20[0-9]{3} bytes of distinct label values"):
        Decoder(ContentIds()).decode(pods_batch(1, 20, pod="x" * 1000 + "{i}"), limits)


def test_all_nodes_together_are_capped() -> None:
    """What bounds a token holder that poses as many nodes (no per-node certificates): the totals."""
    limits = IngestLimits(max_series_total=100)
    decoder = Decoder(ContentIds())
    for n in range(5):
        decoder.decode(pods_batch(1, 20, node=f"n{n}"), limits)
    with pytest.raises(BatchError, match="the collector holds 100 label sets from all nodes") as info:
        decoder.decode(pods_batch(1, 1, node="n9"), limits)
    assert info.value.reason == "series_limit_total"
    limits = IngestLimits(max_label_value_bytes_total=5_000)
    decoder = Decoder(ContentIds())
    decoder.decode(pods_batch(1, 4, node="n0", pod="x" * 1000 + "{i}"), limits)
    with pytest.raises(BatchError, match="holds 4010 bytes of distinct label values from all nodes"):
        decoder.decode(pods_batch(1, 1, node="n1", pod="y" * 1000 + "{i}"), limits)


def test_a_process_with_too_many_labels_is_refused() -> None:
    b = BatchBuilder("node-a", "a9e17000000000000000000000000002", 1)
    b.sample(b.process(1, "w", {f"l{i:05d}": "v" * 1000 for i in range(20_000)}), b.stack([("main", "m")]), 1)
    with pytest.raises(BatchError, match="process 0 has 20000 labels, over the limit of 64") as info:
        Decoder(ContentIds()).decode(b.build(), IngestLimits())
    assert info.value.reason == "too_many_labels"


def _metric(col: RunningCollector, name: str, reason: str) -> float:
    text = http_get(f"{col.url}/metrics").decode()
    found = re.search(rf'^{name}\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_attack_of_the_issue_is_refused_and_counted(collector: RunningCollector) -> None:
    """The run of 2026-11-27 at full size: 10 batches of 20,000 processes, each with a unique 1,000-byte
    pod (815 MiB of RSS then, and a 200 MB label-values answer), and one process with 20,000 labels of
    1,000 bytes (accepted then). Each is refused whole, counted by reason; nothing of them is listed."""
    for seq in range(1, 11):
        batch = pods_batch(seq, 20_000, pod=f"{seq:02d}-{{i:06d}}-" + "p" * 990, pid0=seq * 20_000)
        with pytest.raises(grpc.RpcError) as info:
            push(collector.grpc_target, [batch])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "label 'pod' of node 'node-a' would have 20000 distinct values" in info.value.details()
    b = BatchBuilder("node-a", "a9e17000000000000000000000000003", 1)
    b.sample(b.process(1, "w", {f"l{i:05d}": "v" * 1000 for i in range(20_000)}), b.stack([("main", "m")]), 1)
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [b.build()])
    assert "has 20000 labels" in info.value.details()
    assert _metric(collector, "fleetprof_ingest_rejected_batches_total", "label_values_limit") == 10
    assert _metric(collector, "fleetprof_ingest_rejected_batches_total", "too_many_labels") == 1
    assert collector.json("/api/v1/labels/pod/values") == {"name": "pod", "values": [], "truncated": False}
    # A node within its quota is stored as ever.
    assert push(collector.grpc_target, [pods_batch(1, 300, node="node-b")]) == [1]
    assert collector.json("/api/v1/top", since="1h")["total"] == 300


@pytest.fixture(scope="module")
def listed() -> RunningCollector:
    col = start_collector()
    assert push(f"127.0.0.1:{col.grpc_port}", [pods_batch(1, 1500, node="node-a")]) == [1]
    assert push(f"127.0.0.1:{col.grpc_port}", [pods_batch(1, 3, node="node-b", pod="b-{i}")]) == [1]
    team = BatchBuilder("node-c", "a9e17000000000000000000000000c0c", 1)
    team.sample(team.process(1, "w", {"team": "infra"}), team.stack([("main", "app")]), 1)
    assert push(f"127.0.0.1:{col.grpc_port}", [team.build()]) == [1]
    yield RunningCollector(col)
    col.stop()


def _get(col: RunningCollector, path: str, **params: str | list[str]) -> tuple[int, dict]:
    query = urllib.parse.urlencode(params, doseq=True)
    try:
        return 200, json.loads(http_get(f"{col.url}{path}?{query}"))
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_label_values_are_limited_by_default_and_by_limit(listed: RunningCollector) -> None:
    status, body = _get(listed, "/api/v1/labels/pod/values")
    assert status == 200 and len(body["values"]) == 1000 and body["truncated"] is True
    assert body["values"] == sorted(body["values"])
    status, body = _get(listed, "/api/v1/labels/pod/values", limit="5")
    assert body["values"] == ["b-0", "b-1", "b-2", "p-0", "p-1"] and body["truncated"] is True
    status, body = _get(listed, "/api/v1/labels/pod/values", limit="10000")
    assert len(body["values"]) == 1503 and body["truncated"] is False
    assert _get(listed, "/api/v1/labels/pod/values", limit="10001")[0] == 400
    assert _get(listed, "/api/v1/labels", limit="2")[1] == {"labels": ["comm", "node"], "truncated": True}


def test_label_values_of_the_sets_match_selects(listed: RunningCollector) -> None:
    status, body = _get(listed, "/api/v1/labels/pod/values", **{"match[]": '{node="node-b"}'})
    assert (status, body["values"], body["truncated"]) == (200, ["b-0", "b-1", "b-2"], False)
    status, body = _get(
        listed, "/api/v1/labels/pod/values", **{"match[]": ['{pod="p-7"}', '{pod=~"b-[12]"}']}
    )
    assert body["values"] == ["b-1", "b-2", "p-7"]
    status, body = _get(listed, "/api/v1/labels/pod/values", **{"match[]": "{pod=~"})
    assert status == 400 and "match[]" in body["error"]
    status, body = _get(listed, "/api/v1/labels", **{"match[]": '{node="node-b"}'})
    assert body["labels"] == ["comm", "node", "pid", "pod"]


def test_connect_label_values_are_bounded(listed: RunningCollector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pyroscope's LabelValues has no limit: the first MAX_LABEL_VALUES, sorted."""
    monkeypatch.setattr(query_service, "MAX_LABEL_VALUES", 4)
    body = types_pb2.LabelValuesRequest(name="pod").SerializeToString()
    req = urllib.request.Request(
        f"{listed.url}/querier.v1.QuerierService/LabelValues",
        data=body,
        headers={"Content-Type": "application/proto"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        names = list(types_pb2.LabelValuesResponse.FromString(resp.read()).names)
    assert names == ["b-0", "b-1", "b-2", "p-0"]


def test_connect_label_names_are_of_the_series_the_matchers_select(listed: RunningCollector) -> None:
    """Grafana's matchers name __profile_type__, which no stored label set carries: it is set aside."""
    matcher = '{node="node-b", __profile_type__="process_cpu:cpu:nanoseconds:cpu:nanoseconds"}'
    body = types_pb2.LabelNamesRequest(matchers=[matcher]).SerializeToString()
    req = urllib.request.Request(
        f"{listed.url}/querier.v1.QuerierService/LabelNames",
        data=body,
        headers={"Content-Type": "application/proto"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        names = set(types_pb2.LabelNamesResponse.FromString(resp.read()).names)
    assert {"node", "pod", "pid", "comm", "__profile_type__"} <= names and "team" not in names
    everything = types_pb2.LabelNamesRequest().SerializeToString()
    req = urllib.request.Request(
        f"{listed.url}/querier.v1.QuerierService/LabelNames",
        data=everything,
        headers={"Content-Type": "application/proto"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert "team" in types_pb2.LabelNamesResponse.FromString(resp.read()).names
