"""/api/v1/profile's formats: max_nodes keeps every total, the CLI picks formats by extension, and the
self-contained HTML flame graph works in real headless Chromium with every fetch forbidden."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.html import render_html
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.browser import CHROMIUM, Page
from tests.support.profiles import PROFILE, push_profile, wide_rows

SVG = "{http://www.w3.org/2000/svg}"
needs_chromium = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)
WIDE = wide_rows(6, 3, comm="wide-formats")
WIDE_TOTAL = sum(r[5] for r in WIDE)


@pytest.fixture(scope="module")
def profiled(module_collector: RunningCollector) -> RunningCollector:
    push_profile(module_collector.grpc_target, PROFILE)
    push_profile(module_collector.grpc_target, WIDE)
    return module_collector


def get(col: RunningCollector, **params: str) -> bytes:
    q = urllib.parse.urlencode({"since": "10m", **params})
    return http_get(f"{col.url}/api/v1/profile?{q}")


def html_data(page_text: str) -> dict:
    m = re.search(r'<script type="application/json" id="fp-data">(.*?)</script>', page_text, re.S)
    assert m
    return json.loads(m.group(1))


def json_nodes(node: dict) -> int:
    return sum(1 + json_nodes(c) for c in node["children"])


WIDE_QUERY = '{comm="wide-formats"}'


@pytest.mark.parametrize("max_nodes", [1, 7, 50])
def test_max_nodes_bounds_every_tree_format_and_keeps_the_total(
    profiled: RunningCollector, max_nodes: int
) -> None:
    n = str(max_nodes)
    doc = json.loads(get(profiled, query=WIDE_QUERY, format="json", max_nodes=n))
    assert doc["total"] == doc["root"]["value"] == WIDE_TOTAL
    assert json_nodes(doc["root"]) <= max_nodes

    data = html_data(get(profiled, query=WIDE_QUERY, format="html", max_nodes=n).decode())
    assert len(data["nodes"]) - 1 <= max_nodes and data["nodes"][0][3] == WIDE_TOTAL

    svg = ET.fromstring(get(profiled, query=WIDE_QUERY, format="svg", max_nodes=n))
    frames = list(svg.find(f".//{SVG}g[@id='frames']"))
    assert len(frames) - 1 <= max_nodes
    assert frames[0].find(f"{SVG}title").text.startswith(f"all — {WIDE_TOTAL} samples")

    frame = json.loads(get(profiled, query=WIDE_QUERY, format="grafana", max_nodes=n))
    values = dict(zip([f["name"] for f in frame["schema"]["fields"]], frame["data"]["values"], strict=True))
    assert len(values["level"]) - 1 <= max_nodes and values["value"][0] == WIDE_TOTAL


def test_default_max_nodes_leaves_small_profiles_whole_and_folded_is_never_cut(
    profiled: RunningCollector,
) -> None:
    doc = json.loads(get(profiled, query=WIDE_QUERY, format="json"))
    assert json_nodes(doc["root"]) == 6 + 36 + 216  # under the default of 2048
    folded = get(profiled, query=WIDE_QUERY, format="folded", max_nodes="1").decode()
    assert len(folded.splitlines()) == 216 and "other" not in folded


@pytest.mark.parametrize(
    "path, message",
    [
        ("profile?format=png", '"format" must be one of json, folded, svg, html, pprof, speedscope, grafana'),
        ("profile?max_nodes=0", '"max_nodes" must be between 1 and'),
        ("top?sort=avg", '"sort" must be one of self, total'),
    ],
)
def test_bad_parameters_are_400_naming_them(profiled: RunningCollector, path: str, message: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        http_get(f"{profiled.url}/api/v1/{path}")
    assert info.value.code == 400 and message in json.loads(info.value.read())["error"]


def test_top_sorts_by_total_and_groups_by_label(profiled: RunningCollector) -> None:
    by_total = json.loads(
        http_get(f"{profiled.url}/api/v1/top?since=10m&sort=total&query={{pod=~%22.*-0%22}}")
    )
    assert by_total["sort"] == "total"
    totals = [f["total"] for f in by_total["functions"]]
    assert totals == sorted(totals, reverse=True)
    r = fleetprof("top", "--collector", profiled.url, "--by", "pod", "--query", '{comm!="wide-formats"}')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["POD", "CPU%", "CPU_S", "SAMPLES"]
    assert lines[2].split() == ["trainer-0", "90.0%", "3.6", "360"]
    assert lines[3].split() == ["api-0", "10.0%", "0.4", "40"]


@pytest.mark.parametrize(
    "name, fmt",
    [("cpu.html", "html"), ("cpu.grafana.json", "grafana"), ("CPU.SVG", "svg"), ("cpu.pprof", "pprof")],
)
def test_flame_picks_the_format_from_the_extension(
    profiled: RunningCollector, tmp_path: Path, name: str, fmt: str
) -> None:
    out = tmp_path / name
    r = fleetprof("flame", "--collector", profiled.url, "--query", '{pod="trainer-0"}', "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert f"({fmt}," in r.stdout
    body = out.read_bytes()
    if fmt == "html":
        assert html_data(body.decode())["nodes"][0][3] == 360
    elif fmt == "grafana":
        assert json.loads(body)["data"]["values"][1][0] == 360
    elif fmt == "svg":
        assert ET.fromstring(body).tag == f"{SVG}svg"
    else:
        assert body[:2] == b"\x1f\x8b"


# ---- the HTML flame graph in Chromium -----------------------------------------------------------------


def widths(page: Page) -> dict[str, float]:
    return page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#flame .frame')]"
        ".filter(f => f.style.display !== 'none')"
        ".map(f => [f.dataset.name, f.getBoundingClientRect().width]))"
    )


@needs_chromium
def test_html_flame_graph_draws_zooms_and_searches_offline(
    profiled: RunningCollector, page: Page, tmp_path: Path
) -> None:
    html_file = tmp_path / "cpu.html"
    html_file.write_bytes(get(profiled, query='{comm!="wide-formats"}', format="html"))
    page.goto(html_file.as_uri())
    page.wait_for("document.querySelectorAll('#flame .frame').length > 0")
    w = widths(page)
    assert {"all", "main", "run", "hot_loop", "cold_path", "accept_loop", "sys_read"} <= set(w)
    assert w["hot_loop"] / w["all"] == pytest.approx(300 / 400, abs=0.01)
    assert w["run"] / w["all"] == pytest.approx(360 / 400, abs=0.01)

    page.click('#flame .frame[data-name="run"]')
    page.wait_for("!document.getElementById('reset').hidden")
    w = widths(page)
    assert w["run"] == pytest.approx(w["all"], abs=1)  # zoomed: run fills the width
    assert w["hot_loop"] / w["run"] == pytest.approx(300 / 360, abs=0.01)
    assert "accept_loop" not in w  # outside the zoomed subtree

    page.type_into("#search", "cold_path")
    text = page.wait_for("document.getElementById('matched').textContent")
    assert text == "matched: 25.00%"  # 60 + 40 of 400
    assert page.evaluate("document.querySelectorAll('#flame .frame.match').length") >= 1

    page.click("#reset")
    page.wait_for("document.getElementById('reset').hidden")
    assert "accept_loop" in widths(page)
    page.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": 5, "y": 5})
    details = page.evaluate(
        "(() => { const f = document.querySelector('#flame .frame[data-name=\"hot_loop\"]');"
        " f.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));"
        " return document.getElementById('details').textContent; })()"
    )
    assert details == "hot_loop (/app/worker) — 300 samples, 75.00%, 3.00 s"
    assert page.errors() == []  # the CSP forbids every fetch: any attempt would be logged here


@needs_chromium
def test_html_survives_hostile_names_and_an_empty_profile(page: Page, tmp_path: Path) -> None:
    evil = '</script><script>window.pwned=1</script>"<&>'
    path = tmp_path / "evil.html"
    path.write_text(render_html({(FrameKey(evil, "m"),): 2, (FrameKey("ok", "m"),): 1}, title="<t>"))
    page.goto(path.as_uri())
    page.wait_for("document.querySelectorAll('#flame .frame').length === 3")
    assert page.evaluate("window.pwned === undefined")
    assert evil in page.evaluate("[...document.querySelectorAll('#flame .frame')].map(f => f.dataset.name)")
    empty = tmp_path / "empty.html"
    empty.write_text(render_html({}))
    page.goto(empty.as_uri())
    assert page.evaluate("document.getElementById('flame').textContent") == "no samples"
    assert page.errors() == []
