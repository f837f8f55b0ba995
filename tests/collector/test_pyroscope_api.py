"""The collector answers Grafana's Pyroscope query API (Connect unary RPCs): binary and JSON, gzip, and
Connect errors, over batches with a known split. tests/e2e/test_grafana_connect.py drives it with a
published Connect client and a real agent."""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.request

import pytest
from google.protobuf import json_format

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2, types_pb2
from tests.conftest import RunningCollector, start_collector
from tests.support.wire import BatchBuilder, push

CPU = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
SAMPLES = "process_cpu:samples:count:cpu:nanoseconds"
OFFCPU = "process_offcpu:offcpu:nanoseconds:offcpu:nanoseconds"
WALL = "wall:wall:nanoseconds:wall:nanoseconds"
CUDA_LAUNCH = "cuda_launch:launches:count:launches:count"
GPU = "gpu:gpu:nanoseconds:gpu:nanoseconds"
PERIOD_NS = round(1e9 / 19)
SERVICE = "/querier.v1.QuerierService/"


def call(col: RunningCollector, method: str, request, response_cls=None, codec: str = "proto", headers=None):
    """POST one Connect unary call; the decoded answer, or (status, error JSON) when it fails."""
    if codec == "proto":
        body, ctype = request.SerializeToString(), "application/proto"
    else:
        body, ctype = json_format.MessageToJson(request).encode(), "application/json"
    req = urllib.request.Request(
        col.url + SERVICE + method,
        data=body,
        headers={"Content-Type": ctype, "Connect-Protocol-Version": "1", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = resp.read()
            if resp.headers.get("Content-Encoding") == "gzip":
                data = gzip.decompress(data)
            assert resp.headers["Content-Type"] == ctype
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    cls = response_cls
    return cls.FromString(data) if codec == "proto" else json_format.Parse(data, cls())


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture(scope="module")
def fleet(module_collector: RunningCollector) -> RunningCollector:
    """Two pods: web-1 (Deployment web) 60 samples of main;serve;parse and 20 of main;serve, and a pod-less
    process `cron` with 20 samples of main;tick, 10 of them while its GPU idled."""
    b = BatchBuilder(node="node-a", sequence=1)
    web = b.process(10, "python3", {"namespace": "shop", "pod": "web-1", "workload": "web"})
    cron = b.process(11, "cron")
    b.sample(web, b.stack([("main", "app"), ("serve", "app"), ("parse", "app")]), 60)
    b.sample(web, b.stack([("main", "app"), ("serve", "app")]), 20)
    b.sample(cron, b.stack([("main", "cron"), ("tick", "cron")]), 10, gpu=1)
    b.sample(cron, b.stack([("main", "cron"), ("tick", "cron")]), 10)
    assert push(module_collector.grpc_target, [b.build()]) == [1]
    return module_collector


def merge(col: RunningCollector, selector: str = "{}", kind: str = CPU, codec: str = "proto", **kw):
    req = querier_pb2.SelectMergeStacktracesRequest(
        profile_typeID=kind, label_selector=selector, start=now_ms() - 600_000, end=now_ms() + 60_000, **kw
    )
    return call(col, "SelectMergeStacktraces", req, querier_pb2.SelectMergeStacktracesResponse, codec)


def nodes(fg: querier_pb2.FlameGraph) -> dict[tuple[str, ...], tuple[int, int]]:
    """(path of names) -> (total, self), rebuilt from the levels' x offsets as a flame graph reader does."""
    out: dict[tuple[str, ...], tuple[int, int]] = {}
    spans = [(0, fg.levels[0].values[1], ())]  # (x, total, path) of the level above
    for depth, level in enumerate(fg.levels):
        v = list(level.values)
        x, here = 0, []
        for i in range(0, len(v), 4):
            x += v[i]
            name = fg.names[v[i + 3]]
            parents = [p for p in spans if p[0] <= x < p[0] + p[1]] if depth else [(0, 0, ())]
            path = parents[-1][2] + (name,) if depth else (name,)
            out[path] = (v[i + 1], v[i + 2])
            here.append((x, v[i + 1], path))
            x += v[i + 1]
        spans = here
    return out


@pytest.mark.parametrize("codec", ["proto", "json"])
def test_the_flame_graph_in_cpu_nanoseconds_and_samples(fleet: RunningCollector, codec: str) -> None:
    fg = merge(fleet, codec=codec).flamegraph
    assert fg.names[0] == "total" and len(fg.levels[0].values) == 4
    assert fg.total == 100 * PERIOD_NS
    got = nodes(fg)
    assert got[("total", "main", "serve", "parse")] == (60 * PERIOD_NS, 60 * PERIOD_NS)
    assert got[("total", "main", "serve")] == (80 * PERIOD_NS, 20 * PERIOD_NS)
    assert got[("total", "main", "tick")] == (20 * PERIOD_NS, 20 * PERIOD_NS)
    assert fg.max_self == 60 * PERIOD_NS
    samples = merge(fleet, kind=SAMPLES, codec=codec).flamegraph
    assert samples.total == 100
    assert nodes(samples)[("total", "main", "serve", "parse")] == (60, 60)


def test_selectors_see_every_label_gpu_state_and_service_name(fleet: RunningCollector) -> None:
    assert merge(fleet, '{namespace="shop"}', SAMPLES).flamegraph.total == 80
    assert merge(fleet, '{service_name="web"}', SAMPLES).flamegraph.total == 80
    assert merge(fleet, '{service_name="cron"}', SAMPLES).flamegraph.total == 20  # no workload: comm
    assert merge(fleet, '{gpu_state="idle"}', SAMPLES).flamegraph.total == 10


def test_max_nodes_merges_the_tail_and_keeps_the_total(fleet: RunningCollector) -> None:
    fg = merge(fleet, kind=SAMPLES, max_nodes=2).flamegraph
    assert fg.total == 100
    assert sum(len(level.values) // 4 for level in fg.levels[1:]) <= 2
    assert "other" in fg.names


@pytest.mark.parametrize("codec", ["proto", "json"])
def test_select_series_adds_up_to_the_flame_graph(fleet: RunningCollector, codec: str) -> None:
    req = querier_pb2.SelectSeriesRequest(
        profile_typeID=CPU,
        label_selector="{}",
        start=now_ms() - 600_000,
        end=now_ms() + 60_000,
        step=15,
        group_by=["service_name"],
    )
    res = call(fleet, "SelectSeries", req, querier_pb2.SelectSeriesResponse, codec)
    totals = {s.labels[0].value: sum(p.value for p in s.points) for s in res.series}
    assert totals == {"web": 80 * PERIOD_NS, "cron": 20 * PERIOD_NS}
    assert [s.labels[0].value for s in res.series] == ["web", "cron"]  # largest first
    for s in res.series:
        # 15 s is served as 20 s, whole 10 s buckets per point; timestamps in ms on that step
        assert all(p.timestamp % 20_000 == 0 for p in s.points)
    req.limit = 1
    assert len(call(fleet, "SelectSeries", req, querier_pb2.SelectSeriesResponse, codec).series) == 1


def test_label_names_values_series_types_and_stats(fleet: RunningCollector) -> None:
    span = {"start": now_ms() - 600_000, "end": now_ms() + 60_000}
    names = call(fleet, "LabelNames", types_pb2.LabelNamesRequest(**span), types_pb2.LabelNamesResponse).names
    assert {"namespace", "pod", "comm", "node", "service_name", "__profile_type__"} <= set(names)
    values = call(
        fleet,
        "LabelValues",
        types_pb2.LabelValuesRequest(name="service_name", **span),
        types_pb2.LabelValuesResponse,
    ).names
    assert list(values) == ["cron", "web"]
    only = types_pb2.LabelValuesRequest(name="pod", matchers=['{namespace="shop"}'], **span)
    assert list(call(fleet, "LabelValues", only, types_pb2.LabelValuesResponse).names) == ["web-1"]
    series = call(
        fleet,
        "Series",
        querier_pb2.SeriesRequest(label_names=["service_name", "__profile_type__"], **span),
        querier_pb2.SeriesResponse,
    )
    sets = {tuple((p.name, p.value) for p in s.labels) for s in series.labels_set}
    assert (("__profile_type__", CPU), ("service_name", "web")) in sets
    assert (("__profile_type__", SAMPLES), ("service_name", "cron")) in sets
    types = call(
        fleet,
        "ProfileTypes",
        querier_pb2.ProfileTypesRequest(start=1000, end=4000),
        querier_pb2.ProfileTypesResponse,
    )  # Grafana's health check
    assert {t.ID for t in types.profile_types} == {CPU, SAMPLES, OFFCPU, WALL, CUDA_LAUNCH, GPU}
    assert {(t.sample_type, t.sample_unit) for t in types.profile_types} == {
        ("cpu", "nanoseconds"),
        ("samples", "count"),
        ("offcpu", "nanoseconds"),
        ("wall", "nanoseconds"),
        ("launches", "count"),
        ("gpu", "nanoseconds"),
    }
    stats = call(
        fleet, "GetProfileStats", types_pb2.GetProfileStatsRequest(), types_pb2.GetProfileStatsResponse
    )
    assert (
        stats.data_ingested and stats.oldest_profile_time <= now_ms() <= stats.newest_profile_time + 3_600_000
    )


def test_select_merge_profile_is_pprof(fleet: RunningCollector) -> None:
    req = querier_pb2.SelectMergeProfileRequest(
        profile_typeID=CPU, label_selector='{pod="web-1"}', start=now_ms() - 600_000, end=now_ms() + 60_000
    )
    prof = call(fleet, "SelectMergeProfile", req, profile_pb2.Profile)
    types = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
    assert types == [("samples", "count"), ("cpu", "nanoseconds")]
    assert sum(s.value[0] for s in prof.sample) == 80


def test_gzip_both_ways(fleet: RunningCollector) -> None:
    req = querier_pb2.SelectMergeStacktracesRequest(
        profile_typeID=SAMPLES, start=now_ms() - 600_000, end=now_ms() + 60_000
    )
    http = urllib.request.Request(
        fleet.url + SERVICE + "SelectMergeStacktraces",
        data=gzip.compress(req.SerializeToString()),
        headers={"Content-Type": "application/proto", "Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
        method="POST",
    )
    with urllib.request.urlopen(http, timeout=30) as resp:
        body = resp.read()
        encoding = resp.headers.get("Content-Encoding")
    answer = querier_pb2.SelectMergeStacktracesResponse.FromString(
        gzip.decompress(body) if encoding == "gzip" else body
    )
    assert answer.flamegraph.total == 100


@pytest.mark.parametrize(
    "method, message, code, status, words",
    [
        (
            "SelectMergeStacktraces",
            querier_pb2.SelectMergeStacktracesRequest(
                profile_typeID=CPU, label_selector="{pod=", start=1, end=2
            ),
            "invalid_argument",
            400,
            "label_selector",
        ),
        (
            "SelectMergeStacktraces",
            querier_pb2.SelectMergeStacktracesRequest(profile_typeID="memory:alloc:bytes::", start=1, end=2),
            "invalid_argument",
            400,
            "unknown profile type",
        ),
        (
            "SelectSeries",
            querier_pb2.SelectSeriesRequest(profile_typeID=CPU, start=1, end=2000, step=0),
            "invalid_argument",
            400,
            "step",
        ),
        (
            "SelectSeries",
            querier_pb2.SelectSeriesRequest(profile_typeID=CPU, start=5, end=1, step=15),
            "invalid_argument",
            400,
            "after start",
        ),
        ("Diff", querier_pb2.ProfileTypesRequest(), "unimplemented", 501, "not served"),
        ("NoSuchMethod", querier_pb2.ProfileTypesRequest(), "unimplemented", 404, "no such method"),
    ],
)
def test_bad_requests_get_connect_errors(
    fleet: RunningCollector, method, message, code, status, words
) -> None:
    got_status, err = call(fleet, method, message, None)
    assert (got_status, err["code"]) == (status, code)
    assert words in err["message"]


def test_unreadable_bodies_and_wrong_content_types(fleet: RunningCollector) -> None:
    for body, ctype, status in [
        (b"\xff\xff\xff", "application/proto", 400),
        (b"{not json", "application/json", 400),
        (b"{}", "text/plain", 415),
    ]:
        http = urllib.request.Request(
            fleet.url + SERVICE + "ProfileTypes", data=body, headers={"Content-Type": ctype}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(http, timeout=30)
        assert info.value.code == status
        assert json.loads(info.value.read())["code"] in ("invalid_argument",)
    bomb = gzip.compress(b"\0" * (64 << 20))
    http = urllib.request.Request(
        fleet.url + SERVICE + "ProfileTypes",
        data=bomb,
        headers={"Content-Type": "application/proto", "Content-Encoding": "gzip"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(http, timeout=30)
    assert (info.value.code, json.loads(info.value.read())["code"]) == (429, "resource_exhausted")


def test_the_api_token_guards_the_connect_methods(tmp_path) -> None:
    """Grafana's datasource sends the API token as a header; without it a call is unauthenticated."""
    (tmp_path / "tokens").write_text("s3cret-token\n")
    col = RunningCollector(start_collector(api_token_file=str(tmp_path / "tokens")))
    try:
        req = querier_pb2.ProfileTypesRequest(start=1000, end=4000)
        status, err = call(col, "ProfileTypes", req, querier_pb2.ProfileTypesResponse)
        assert (status, err["code"]) == (401, "unauthenticated")
        wrong = call(col, "ProfileTypes", req, None, headers={"Authorization": "Bearer nope"})
        assert wrong[0] == 401 and wrong[1]["code"] == "unauthenticated"
        ok = call(
            col,
            "ProfileTypes",
            req,
            querier_pb2.ProfileTypesResponse,
            headers={"Authorization": "Bearer s3cret-token"},
        )
        assert len(ok.profile_types) == 6
    finally:
        col.collector.stop()


def test_chunked_request_bodies_are_read_and_bounded(fleet: RunningCollector) -> None:
    """Node's HTTP/1.1 client (Connect for Node) streams a request body in chunks, with no Content-Length."""
    import http.client

    body = querier_pb2.SelectMergeStacktracesRequest(
        profile_typeID=SAMPLES, start=now_ms() - 600_000, end=now_ms() + 60_000
    ).SerializeToString()

    def post(chunks: list[bytes]) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", fleet.collector.http_port, timeout=30)
        try:
            conn.request(
                "POST",
                SERVICE + "SelectMergeStacktraces",
                body=iter(chunks),
                encode_chunked=True,
                headers={"Content-Type": "application/proto"},
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    status, answer = post([body[:3], body[3:]])
    assert status == 200
    assert querier_pb2.SelectMergeStacktracesResponse.FromString(answer).flamegraph.total == 100
    status, answer = post([b"\0" * (1 << 19)] * 3)  # 1.5 MiB: over the 1 MiB a request may have
    assert (status, json.loads(answer)["code"]) == (413, "resource_exhausted")


def test_series_steps_are_whole_buckets_and_diff_ranges_share_one_now(fleet: RunningCollector) -> None:
    body = fleet.json("/api/v1/series", since="10m", step="15")
    assert body["step"] == 20
    with pytest.raises(urllib.error.HTTPError) as info:  # both sides resolve "now" once: the same range
        fleet.json("/api/v1/diff", since="15m", since2="15m")
    assert info.value.code == 400 and "same selection" in json.loads(info.value.read())["error"]
