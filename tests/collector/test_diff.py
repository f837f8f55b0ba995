"""Diff of two selections: per-function share deltas, the red/blue SVG, Grafana's diff frame, API and CLI."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.diff import (
    build_diff_tree,
    diff_colour,
    function_diff,
    limit_pair,
    render_diff_svg,
)
from fleetprof.collector.render.grafana import diff_flamegraph_frame, flamegraph_frame
from fleetprof.collector.render.tree import OTHER
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.profiles import PROFILE, Row, push_profile

SVG = "{http://www.w3.org/2000/svg}"


def F(name: str) -> FrameKey:
    return FrameKey(name, "app")


MAIN, A, B, C = F("main"), F("a"), F("b"), F("c")
# Baseline: a 50%, b 50%. Comparison (twice the samples): a 25%, b 50%, c 25% (new).
BASE = {(MAIN, A): 50, (MAIN, B): 50}
COMP = {(MAIN, A): 50, (MAIN, B): 100, (MAIN, C): 50}


# ---- per-function table ----------------------------------------------------------------------------


def test_function_diff_compares_shares_and_sorts_by_absolute_delta():
    rows = function_diff(BASE, COMP)
    by_name = {r["function"]: r for r in rows}
    assert [r["function"] for r in rows][:2] == ["a", "c"]  # |−25| and |+25| first (ties by name), then b (0)
    assert (by_name["a"]["baseline_self_pct"], by_name["a"]["comparison_self_pct"]) == (50.0, 25.0)
    assert by_name["a"]["self_delta_pct"] == -25.0
    assert by_name["c"]["baseline_self"] == 0 and by_name["c"]["self_delta_pct"] == 25.0
    assert by_name["b"]["self_delta_pct"] == 0.0
    assert by_name["main"]["total_delta_pct"] == 0.0 and by_name["main"]["baseline_total_pct"] == 100.0
    assert rows[-1]["function"] == "main"


def test_function_diff_sort_by_total_and_limit():
    base = {(MAIN, A, B): 10, (MAIN, C): 10}
    comp = {(MAIN, A, B): 5, (MAIN, A): 10, (MAIN, C): 5}  # a's total 50% -> 75%, b's self 50% -> 25%
    rows = function_diff(base, comp, sort="total", limit=1)
    assert len(rows) == 1 and rows[0]["function"] in ("a", "c") and abs(rows[0]["total_delta_pct"]) == 25.0
    with pytest.raises(ValueError, match="sort"):
        function_diff(base, comp, sort="median")


def test_function_diff_with_an_empty_side():
    rows = function_diff({}, BASE)
    assert {r["function"]: r["self_delta_pct"] for r in rows} == {"a": 50.0, "b": 50.0, "main": 0.0}


# ---- merged tree and max_nodes ------------------------------------------------------------------------


def test_diff_tree_keeps_both_sides_and_weights_by_share():
    tree = build_diff_tree(BASE, COMP)
    assert (tree.base_total, tree.comp_total) == (100, 200)
    c = tree.children[MAIN].children[C]
    assert (c.base_total, c.comp_total, c.comp_self) == (0, 50, 50)
    # Layout weight ∝ base share + comparison share: a = 0.5 + 0.25, c = 0 + 0.25.
    a = tree.children[MAIN].children[A]
    assert a.total / tree.total == pytest.approx((0.5 + 0.25) / 2)
    assert c.total / tree.total == pytest.approx(0.25 / 2)


def test_limit_pair_cuts_both_sides_to_one_shape_and_keeps_totals():
    base = {(MAIN, F("x0")): 1, (MAIN, F("x1")): 3}  # few samples, big shares
    comp = {(MAIN, F(f"y{i}")): 100 + i for i in range(40)}  # many samples, 2.5% each
    b, c = limit_pair(base, comp, 12)
    assert sum(b.values()) == sum(base.values()) and sum(c.values()) == sum(comp.values())
    tree = build_diff_tree(b, c)

    def count(node) -> int:
        return sum(1 + count(ch) for ch in node.children.values())

    assert count(tree) <= 12
    kept = set(tree.children[MAIN].children)
    assert OTHER in kept
    # Shares, not raw counts, choose: the baseline's 1 and 3 samples outrank the comparison's 139.
    assert {F("x0"), F("x1"), F("y39")} <= kept and F("y0") not in kept


# ---- Grafana frames ---------------------------------------------------------------------------------


def columns(frame: dict) -> dict[str, list]:
    names = [f["name"] for f in frame["schema"]["fields"]]
    return dict(zip(names, frame["data"]["values"], strict=True))


def check_nested_set(cols: dict[str, list], value: str, self_: str) -> None:
    """One root, depth-first, levels step down by at most one, value = self + children's values."""
    levels = cols["level"]
    assert levels[0] == 0 and levels.count(0) == 1
    assert all(b <= a + 1 for a, b in zip(levels, levels[1:], strict=False))
    for i, lv in enumerate(levels):
        children_sum, j = 0, i + 1
        while j < len(levels) and levels[j] > lv:
            if levels[j] == lv + 1:
                children_sum += cols[value][j]
            j += 1
        assert cols[value][i] == cols[self_][i] + children_sum, (i, cols["label"][i])


def test_diff_frame_is_grafanas_nested_set_with_right_fields():
    frame = diff_flamegraph_frame(BASE, COMP)
    assert frame["schema"]["meta"]["preferredVisualisationType"] == "flamegraph"
    cols = columns(frame)
    assert set(cols) == {"level", "value", "self", "label", "valueRight", "selfRight"}
    check_nested_set(cols, "value", "self")
    check_nested_set(cols, "valueRight", "selfRight")
    assert cols["label"] == ["all", "main", "a", "b", "c"]  # children by name: stable between sides
    assert cols["value"] == [100, 100, 50, 50, 0]
    assert cols["valueRight"] == [200, 200, 50, 100, 50]
    types = {f["name"]: f["type"] for f in frame["schema"]["fields"]}
    assert types["label"] == "string" and types["level"] == "number"


def test_profile_frame_has_no_right_fields_and_marks_kernel_frames():
    frame = flamegraph_frame({(MAIN, FrameKey("vfs_read", "", True)): 3, (MAIN,): 1})
    cols = columns(frame)
    assert set(cols) == {"level", "value", "self", "label"}
    check_nested_set(cols, "value", "self")
    assert cols["label"] == ["all", "main", "vfs_read_[k]"] and cols["value"] == [4, 4, 3]


# ---- SVG --------------------------------------------------------------------------------------------


def fill_by_name(svg: str) -> dict[str, str]:
    root = ET.fromstring(svg.encode())
    out = {}
    for g in root.find(f".//{SVG}g[@id='frames']"):
        title = g.find(f"{SVG}title").text
        out[title.split(" ")[0]] = g.find(f"{SVG}rect").get("fill")
    return out


def rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def test_diff_svg_colours_growth_red_and_shrinkage_blue():
    svg = render_diff_svg(BASE, COMP, subtitle="v1 vs v2")
    fills = fill_by_name(svg)
    r, g, b = rgb(fills["a"])
    assert b > r + 60  # a: 50% -> 25%, blue
    r, g, b = rgb(fills["c"])
    assert r > b + 60  # c: new, red
    assert fills["b"] == fills["main"] == diff_colour(0.0, 0.25)  # unchanged: neutral
    assert "baseline 50.00% (50), comparison 25.00% (50), Δ -25.00 pp" in svg
    assert "red: larger share in the comparison" in svg


def test_diff_colour_saturates_with_the_largest_change():
    assert rgb(diff_colour(0.5, 0.5)) == (224, 48, 32)
    assert rgb(diff_colour(-0.5, 0.5)) == (32, 96, 224)
    assert diff_colour(0.0, 0.0) == diff_colour(0.1, 0.0)


# ---- API and CLI ------------------------------------------------------------------------------------


def scaled(rows: list[Row], leaf: str, factor: int, **labels: str) -> list[Row]:
    """The rows with `leaf`'s samples multiplied by factor and labels added (an image version, say)."""
    out = []
    for pid, comm, lb, frames, k, n in rows:
        out.append((pid, comm, {**lb, **labels}, frames, k, n * factor if frames[-1][0] == leaf else n))
    return out


@pytest.fixture(scope="module")
def two_versions(module_collector: RunningCollector) -> RunningCollector:
    """v1 20 minutes ago and v2 now; v2 spends 4x the samples in cold_path (60 -> 240 of the worker's)."""
    push_profile(module_collector.grpc_target, scaled(PROFILE, "cold_path", 1, image="v1"), ago_s=1200)
    push_profile(module_collector.grpc_target, scaled(PROFILE, "cold_path", 4, image="v2"))
    return module_collector


def get(col: RunningCollector, path: str, **params: str) -> bytes:
    return http_get(f"{col.url}{path}?{urllib.parse.urlencode(params)}")


def error_of(col: RunningCollector, path: str, **params: str) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as info:
        get(col, path, **params)
    return info.value.code, json.loads(info.value.read())["error"]


def test_diff_of_two_selectors(two_versions: RunningCollector) -> None:
    body = json.loads(
        get(two_versions, "/api/v1/diff", query='{image="v1"}', query2='{image="v2"}', since="1h")
    )
    assert body["baseline"]["total"] == 400 and body["comparison"]["total"] == 400 + 180
    assert body["baseline"]["query"] == '{image="v1"}' and body["comparison"]["query"] == '{image="v2"}'
    top = body["functions"][0]
    assert (top["function"], top["module"]) == ("cold_path", "/app/worker")
    assert top["baseline_self_pct"] == 15.0 and top["comparison_self_pct"] == 41.379
    assert top["self_delta_pct"] == pytest.approx(41.379 - 15.0, abs=0.002)
    deltas = [abs(r["self_delta_pct"]) for r in body["functions"]]
    assert deltas == sorted(deltas, reverse=True)


def test_diff_of_two_time_ranges_defaults_query2_to_query(two_versions: RunningCollector) -> None:
    body = json.loads(
        get(
            two_versions,
            "/api/v1/diff",
            query='{pod="trainer-0"}',
            **{"from": "now-25m", "until": "now-15m"},
            since2="2m",
            sort="total",
        )
    )
    assert body["comparison"]["query"] == '{pod="trainer-0"}'
    assert (body["baseline"]["total"], body["comparison"]["total"]) == (360, 540)
    assert body["sort"] == "total"
    top = body["functions"][0]
    assert top["function"] == "cold_path" and top["total_delta_pct"] > 0


def test_diff_formats_svg_and_grafana(two_versions: RunningCollector) -> None:
    params = {"query": '{image="v1"}', "query2": '{image="v2"}', "since": "1h"}
    svg = get(two_versions, "/api/v1/diff", format="svg", **params).decode()
    fills = fill_by_name(svg)
    r, _, b = rgb(fills["cold_path"])
    assert r > b
    frame = json.loads(get(two_versions, "/api/v1/diff", format="grafana", max_nodes="5", **params))
    cols = columns(frame)
    check_nested_set(cols, "value", "self")
    check_nested_set(cols, "valueRight", "selfRight")
    assert cols["value"][0] == 400 and cols["valueRight"][0] == 580 and len(cols["level"]) <= 6


@pytest.mark.parametrize(
    "params, message",
    [
        ({"since": "1h"}, "same selection as the baseline"),
        ({"query2": '{pod=~"("}'}, 'bad "query2"'),
        ({"since2": "soon"}, 'bad "since2"'),
        ({"from2": "now-1m", "until2": "now-2m"}, '"from2"'),
        ({"query2": "{}", "format": "png"}, '"format" must be one of json, svg, grafana'),
        ({"query2": "{}", "sort": "avg"}, '"sort" must be one of self, total'),
    ],
)
def test_diff_rejects_bad_parameters_naming_them(
    two_versions: RunningCollector, params: dict, message: str
) -> None:
    code, error = error_of(two_versions, "/api/v1/diff", query='{image="v1"}', **params)
    assert code == 400 and message in error, error


def test_cli_diff_prints_the_table_and_writes_files(two_versions: RunningCollector, tmp_path: Path) -> None:
    base = ["diff", "--collector", two_versions.url, "--query", '{image="v1"}', "--query2", '{image="v2"}']
    r = fleetprof(*base, "--since", "1h", "--limit", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith('baseline {image="v1"}') and "(400 samples)" in lines[0]
    assert lines[1].startswith('comparison {image="v2"}') and "(580 samples)" in lines[1]
    assert lines[2].split() == ["BASE", "SELF%", "COMP", "SELF%", "DELTA", "TOTAL", "DELTA", "FUNCTION"]
    assert lines[3].split()[:4] == ["15.00%", "41.38%", "+26.38", "+26.38"] and "cold_path" in lines[3]
    assert len(lines) == 6

    svg, frame = tmp_path / "d.svg", tmp_path / "d.grafana.json"
    assert fleetprof(*base, "--since", "1h", "-o", str(svg)).returncode == 0
    assert ET.fromstring(svg.read_bytes()).tag == f"{SVG}svg"
    assert fleetprof(*base, "--since", "1h", "-o", str(frame)).returncode == 0
    assert columns(json.loads(frame.read_text()))["valueRight"][0] == 580
    bad = fleetprof(*base, "-o", str(tmp_path / "d.png"))
    assert bad.returncode == 2 and "cannot tell the format" in bad.stderr
