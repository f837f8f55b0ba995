"""The collector's SelectMergeStacktraces answer, converted as Grafana's Pyroscope datasource converts it,
drawn by Grafana's own flame graph component (@grafana/flamegraph from npm, bundled by scripts/setup.sh
--test from tests/grafana_flamegraph/) in headless Chromium: the workload's function is in the graph and
in the top table with its self and total time."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetprof._proto.pyroscope import querier_pb2
from tests.conftest import REPO, RunningCollector
from tests.support.browser import CHROMIUM, BrowserError, Page
from tests.support.wire import BatchBuilder, push

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

# scripts/setup.sh --test bundles tests/grafana_flamegraph/ here (npm ci, then esbuild).
BUNDLE = REPO / ".venv" / "share" / "grafana-flamegraph"
CPU = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
FREQUENCY_HZ = 100  # 10 ms a sample, so every time below prints exactly
MS = 1_000_000  # ns
PROBE = "fleetprof_probe_crc32_block"  # the workload's hot function: a name nothing else has


# --- the datasource's conversion: flamebearer levels -> tree -> nested-set data frame ----------------
# What Grafana's backend does (pkg/tsdb/grafana-pyroscope-datasource: levelsToTree,
# treeToNestedSetDataFrame), written again here: it is the contract between our answer and the panel.


@dataclass
class _Node:
    start: int
    total: int
    self_value: int
    level: int
    name: str
    children: list[_Node] = field(default_factory=list)


def levels_to_tree(fg: querier_pb2.FlameGraph) -> _Node | None:
    """The call tree the flamebearer levels describe. Each level's x offsets are relative to the end of
    the previous node on that level; a node belongs to the first parent, in the level above's order,
    whose span [start, start + total) holds it (Grafana's reading, which never looks at parent self)."""
    if not fg.levels:
        return None
    first = fg.levels[0].values
    root = _Node(0, first[1], first[2], 0, fg.names[first[3]])
    parents = [root]
    for depth, level in enumerate(fg.levels[1:], start=1):
        v = list(level.values)
        below: list[_Node] = []
        queue = iter(parents)
        parent: _Node | None = next(queue, None)
        end = 0
        for i in range(0, len(v), 4):
            start = end + v[i]
            node = _Node(start, v[i + 1], v[i + 2], depth, fg.names[v[i + 3]])
            while parent and not (
                parent.start <= start and start + node.total <= parent.start + parent.total
            ):
                parent = next(queue, None)
            if parent is None:
                raise ValueError(
                    f"level {depth}: {node.name} at x={start} lies under no node of the level above"
                )
            parent.children.append(node)
            below.append(node)
            end = start + node.total
        parents = below
    return root


def grafana_unit(profile_type_id: str) -> str:
    """The panel unit Grafana takes from the profile type's sample unit."""
    unit = profile_type_id.split(":")[2]
    return {"nanoseconds": "ns", "count": "short"}.get(unit, unit)


def nested_set_frame(fg: querier_pb2.FlameGraph, profile_type_id: str) -> dict:
    """The flame graph data frame in Grafana's JSON wire form (schema + data), as the backend sends it to
    the browser: int64 level/value/self, depth first with children in level order, label an enum field
    whose text lists each name once in order of first appearance."""
    levels: list[int] = []
    values: list[int] = []
    selfs: list[int] = []
    labels: list[int] = []
    texts: dict[str, int] = {}
    root = levels_to_tree(fg)
    pending = [root] if root else []
    while pending:
        node = pending.pop()
        levels.append(node.level)
        values.append(node.total)
        selfs.append(node.self_value)
        labels.append(texts.setdefault(node.name, len(texts)))
        pending.extend(reversed(node.children))
    unit = grafana_unit(profile_type_id)

    def int64(name: str, **config: object) -> dict:
        return {"name": name, "type": "number", "typeInfo": {"frame": "int64"}, "config": config}

    return {
        "schema": {
            "name": "response",
            "meta": {"typeVersion": [0, 0], "preferredVisualisationType": "flamegraph"},
            "fields": [
                int64("level"),
                int64("value", unit=unit),
                int64("self", unit=unit),
                {
                    "name": "label",
                    "type": "enum",
                    "typeInfo": {"frame": "enum"},
                    "config": {"type": {"enum": {"text": list(texts)}}},
                },
            ],
        },
        "data": {"values": [levels, values, selfs, labels]},
    }


# --- the collector side ------------------------------------------------------------------------------


def select_merge_stacktraces(col: RunningCollector, selector: str) -> querier_pb2.FlameGraph:
    """One Connect unary call, as Grafana's backend makes it (binary protobuf, gzip accepted)."""
    now_ms = int(time.time() * 1000)
    req = querier_pb2.SelectMergeStacktracesRequest(
        profile_typeID=CPU, label_selector=selector, start=now_ms - 600_000, end=now_ms + 60_000
    )
    http_req = urllib.request.Request(
        col.url + "/querier.v1.QuerierService/SelectMergeStacktraces",
        data=req.SerializeToString(),
        headers={
            "Content-Type": "application/proto",
            "Connect-Protocol-Version": "1",
            "Accept-Encoding": "gzip",
        },
        method="POST",
    )
    with urllib.request.urlopen(http_req, timeout=30) as resp:
        body = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return querier_pb2.SelectMergeStacktracesResponse.FromString(body).flamegraph


@pytest.fixture(scope="module")
def checkout(module_collector: RunningCollector) -> querier_pb2.FlameGraph:
    """Service checkout's flame graph as the collector answers Grafana: at 100 Hz, 60 samples in
    main;handle_request;PROBE, 20 in main;handle_request, 20 in main;poll_queue;recv_batch; another
    service's samples are pushed too, for the selector to leave out."""
    b = BatchBuilder(node="node-g", frequency_hz=FREQUENCY_HZ)
    pod = b.process(20, "checkout", {"namespace": "shop", "pod": "checkout-1", "workload": "checkout"})
    other = b.process(21, "cron", {"namespace": "ops", "pod": "cron-1", "workload": "cron"})
    b.sample(pod, b.stack([("main", "checkout"), ("handle_request", "checkout"), (PROBE, "libcrc.so")]), 60)
    b.sample(pod, b.stack([("main", "checkout"), ("handle_request", "checkout")]), 20)
    b.sample(pod, b.stack([("main", "checkout"), ("poll_queue", "checkout"), ("recv_batch", "checkout")]), 20)
    b.sample(other, b.stack([("main", "cron"), ("tick", "cron")]), 50)
    assert push(module_collector.grpc_target, [b.build()]) == [1]
    return select_merge_stacktraces(module_collector, '{service_name="checkout"}')


# --- the browser side --------------------------------------------------------------------------------

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Grafana flame graph</title>
<link rel="stylesheet" href="flamegraph.css">
<script>
  // Everything the component writes on its canvas, in order: the graph itself is pixels only.
  // Positions in CSS pixels from the canvas's top left corner (the canvas is scaled by devicePixelRatio).
  window.canvasTexts = [];
  const fillText = CanvasRenderingContext2D.prototype.fillText;
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
    const scale = window.devicePixelRatio;
    window.canvasTexts.push({text: String(text), x: x / scale, y: y / scale});
    return fillText.call(this, text, x, y, ...rest);
  };
</script>
<script src="flamegraph.js"></script>
</head>
<body style="margin:0">
<div id="root" style="width:1200px;height:800px"></div>
<script>
  fetch("frame.json").then(r => r.json()).then(frame => {
    window.frame = window.grafanaFlameGraph.mount(document.getElementById("root"), frame);
  });
</script>
</body></html>
"""


class _Files(http.server.BaseHTTPRequestHandler):
    files: dict[str, tuple[bytes, str]] = {}

    def do_GET(self) -> None:  # http.server's name
        body, ctype = self.files.get(self.path.split("?")[0], (b"not found", "text/plain"))
        self.send_response(200 if self.path.split("?")[0] in self.files else 404)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def bundle() -> Path:
    js = BUNDLE / "flamegraph.js"
    if not js.is_file():
        pytest.fail(f"no Grafana flame graph bundle at {js}: run scripts/setup.sh --test")
    return BUNDLE


@contextlib.contextmanager
def serve(files: dict[str, tuple[bytes, str]]) -> Iterator[str]:
    """A static HTTP server on a free 127.0.0.1 port for `files` (path -> body, content type)."""
    handler = type("Files", (_Files,), {"files": files})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="grafana-page", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def flame_page(page: Page, bundle: Path, checkout: querier_pb2.FlameGraph) -> Iterator[Page]:
    """Grafana's component on a page of its own, fed the converted answer; waits until it has drawn."""
    files = {
        "/": (PAGE.encode(), "text/html; charset=utf-8"),
        "/flamegraph.js": ((bundle / "flamegraph.js").read_bytes(), "text/javascript"),
        "/flamegraph.css": ((bundle / "flamegraph.css").read_bytes(), "text/css"),
        "/frame.json": (json.dumps(nested_set_frame(checkout, CPU)).encode(), "application/json"),
    }
    with serve(files) as url:
        page.goto(url + "/")
        try:
            page.wait_for(
                "document.querySelector('canvas[data-testid=flameGraph]') && canvasTexts.length > 0"
            )
        except BrowserError as err:
            raise AssertionError(f"the component drew nothing: {err}; page errors: {page.errors()}") from err
        yield page


def frame_rows(frame: dict) -> list[tuple[int, str, int, int]]:
    """(level, label, value, self) per row of a frame in the JSON form, the enum label decoded."""
    fields = {f["name"]: f for f in frame["schema"]["fields"]}
    columns = dict(zip(fields, frame["data"]["values"], strict=True))
    text = fields["label"]["config"]["type"]["enum"]["text"]
    return [
        (level, text[label], value, self_value)
        for level, value, self_value, label in zip(
            columns["level"], columns["value"], columns["self"], columns["label"], strict=True
        )
    ]


def test_the_answer_converts_to_grafanas_nested_set_frame(checkout: querier_pb2.FlameGraph) -> None:
    """Depth first, one root, children after their parent in level order; times in ns, labelled as such;
    the other service's samples are not in it."""
    frame = nested_set_frame(checkout, CPU)
    assert frame_rows(frame) == [
        (0, "total", 1000 * MS, 0),
        (1, "main", 1000 * MS, 0),
        (2, "handle_request", 800 * MS, 200 * MS),
        (3, PROBE, 600 * MS, 600 * MS),
        (2, "poll_queue", 200 * MS, 0),
        (3, "recv_batch", 200 * MS, 200 * MS),
    ]
    fields = frame["schema"]["fields"]
    assert [f["name"] for f in fields] == ["level", "value", "self", "label"]
    assert [f["config"].get("unit") for f in fields[1:3]] == ["ns", "ns"]
    assert fields[3]["type"] == "enum"
    assert frame["schema"]["meta"]["preferredVisualisationType"] == "flamegraph"


def test_grafanas_flame_graph_draws_the_function_with_its_time(flame_page: Page) -> None:
    """The canvas carries the function's bar, labelled as Grafana labels bars; hovering that bar brings up
    the component's own tooltip with its total and self time (60 of 100 samples, 10 ms each)."""
    texts = flame_page.evaluate("canvasTexts")
    bar = next((t for t in texts if t["text"].startswith(PROBE)), None)
    assert bar is not None, f"{PROBE} is not on the canvas, which shows {[t['text'] for t in texts]}"
    assert bar["text"] == f"{PROBE} (600 ms)"
    assert any(t["text"].endswith("total (1 s)") for t in texts)  # the root, with main collapsed into it

    left, top = flame_page.evaluate(
        "(() => { const r = document.querySelector('canvas[data-testid=flameGraph]').getBoundingClientRect();"
        " return [r.left, r.top]; })()"
    )
    # A few pixels right of where the label starts, on its baseline: inside the bar.
    flame_page.call(
        "Input.dispatchMouseEvent", {"type": "mouseMoved", "x": left + bar["x"] + 8, "y": top + bar["y"]}
    )
    tooltip = flame_page.wait_for(
        f"[...document.querySelectorAll('p')].find(p => p.textContent === {json.dumps(PROBE)})"
        "?.parentElement.innerText"
    )
    assert "Total: 600 ms (60%)" in tooltip
    assert "Self: 600 ms (60%)" in tooltip
    assert not [e for e in flame_page.errors() if e.startswith("exception:")]


def test_grafanas_top_table_lists_the_function_first_with_self_and_total(flame_page: Page) -> None:
    """Grafana's top table, sorted by self time: the function first, 600 ms self and total; every other
    row it renders with the times the samples give."""
    rows = flame_page.wait_for(
        "(() => { const rows = [...document.querySelectorAll('[data-testid=topTable] [role=row]')]"
        ".filter(r => r.querySelector('[role=cell]'))"
        ".map(r => [...r.querySelectorAll('[role=cell]')].slice(1).map(c => c.textContent));"
        " return rows.length >= 3 ? rows : null; })()"
    )
    assert rows[0] == [PROBE, "600 ms", "600 ms"]
    expected = {
        PROBE: ["600 ms", "600 ms"],
        "recv_batch": ["200 ms", "200 ms"],
        "handle_request": ["200 ms", "800 ms"],
        "poll_queue": ["0 ns", "200 ms"],
        "main": ["0 ns", "1 s"],
    }
    for symbol, self_time, total in rows:
        assert expected.get(symbol) == [self_time, total], f"top table row {symbol}: {self_time}, {total}"
