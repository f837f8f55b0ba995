"""Tests for the rendering layer: tree model, folded/JSON/top views, truncation and the SVG (the web UI's
files: tests/collector/test_web_assets.py)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.svg import frame_colour, render_svg
from fleetprof.collector.render.tree import (
    OTHER,
    Node,
    build_tree,
    parse_folded,
    to_folded,
    to_json,
    top_functions,
    truncate,
)

SVG = "{http://www.w3.org/2000/svg}"


def F(name: str, module: str = "app", kernel: bool = False) -> FrameKey:
    return FrameKey(name, module, kernel)


MAIN, WORK, SLEEP, READ = F("main"), F("work"), F("sleep", "libc.so.6"), F("vfs_read", "", True)

STACKS = {
    (MAIN, WORK): 50,
    (MAIN, WORK, READ): 20,
    (MAIN, SLEEP): 25,
    (MAIN,): 5,
}


def count_nodes(node: Node) -> int:
    return sum(1 + count_nodes(child) for child in node.children.values())


def node_by_path(root: Node, *keys: FrameKey) -> Node:
    for key in keys:
        root = root.children[key]
    return root


def wide_stacks(fanout: int = 6, depth: int = 4) -> dict[tuple[FrameKey, ...], int]:
    """A bushy profile with distinct weights so truncation has real choices to make."""
    stacks: dict[tuple[FrameKey, ...], int] = {}
    frontier: list[tuple[FrameKey, ...]] = [()]
    for level in range(depth):
        frontier = [p + (F(f"f{level}_{i}"),) for p in frontier for i in range(fanout)]
    for n, stack in enumerate(frontier):
        stacks[stack] = 1 + (n * 7919) % 97
    return stacks


# ---- build_tree ------------------------------------------------------------------------------------


def test_build_tree_totals_and_self_counts():
    root = build_tree(STACKS)
    assert root.name == "all" and root.total == 100 and root.self_count == 0
    main = node_by_path(root, MAIN)
    assert (main.total, main.self_count) == (100, 5)
    work = node_by_path(root, MAIN, WORK)
    assert (work.total, work.self_count) == (70, 50)
    read = node_by_path(root, MAIN, WORK, READ)
    assert (read.total, read.self_count, read.kernel) == (20, 20, True)
    assert node_by_path(root, MAIN, SLEEP).module == "libc.so.6"


def test_build_tree_keeps_frames_apart_by_module_and_kernel_flag():
    root = build_tree({(F("f", "a"),): 1, (F("f", "b"),): 2, (F("f", "a", True),): 3})
    assert sorted(c.total for c in root.children.values()) == [1, 2, 3]


def test_build_tree_counts_empty_stack_as_root_self_and_skips_zero_counts():
    root = build_tree({(): 4, (MAIN,): 0})
    assert (root.total, root.self_count, root.children) == (4, 4, {})


def test_build_tree_rejects_negative_counts():
    with pytest.raises(ValueError, match="negative"):
        build_tree({(MAIN,): -1})


# ---- folded ----------------------------------------------------------------------------------------


def test_folded_round_trips_counts_and_is_sorted():
    text = to_folded(STACKS)
    lines = text.splitlines()
    assert lines == sorted(lines)
    assert "main;work;vfs_read_[k] 20" in lines
    back = parse_folded(text)
    strip = {tuple(FrameKey(f.function, "", f.kernel) for f in s): c for s, c in STACKS.items()}
    assert back == strip


def test_folded_kernel_suffix_only_on_kernel_frames():
    text = to_folded({(F("do_syscall_64", "", True), F("user_fn")): 3})
    assert text == "do_syscall_64_[k];user_fn 3\n"


def test_folded_escapes_separators_so_every_line_parses():
    tricky = {(F("a;b"), F("multi\nline"), F("has space")): 7, (F(""),): 1}
    text = to_folded(tricky)
    assert text.count("\n") == 2
    back = parse_folded(text)
    assert back == {
        (FrameKey("a,b"), FrameKey("multi line"), FrameKey("has space")): 7,
        (FrameKey("[unknown]"),): 1,
    }


def test_folded_merges_stacks_that_fold_to_the_same_text():
    assert to_folded({(F("f", "a"),): 1, (F("f", "b"),): 2}) == "f 3\n"


def test_parse_folded_reports_bad_lines():
    with pytest.raises(ValueError, match="line 2"):
        parse_folded("a;b 1\na;b x\n")


# ---- JSON ------------------------------------------------------------------------------------------


def test_to_json_shape_and_child_order():
    doc = to_json(STACKS, frequency_hz=19)
    json.dumps(doc)  # plain, serialisable values only
    assert doc["total"] == 100 and doc["frequency_hz"] == 19
    root = doc["root"]
    assert root == {**root, "name": "all", "module": "", "kernel": False, "value": 100, "self": 0}
    main = root["children"][0]
    assert [c["name"] for c in main["children"]] == ["work", "sleep"]
    assert [c["value"] for c in main["children"]] == [70, 25]
    read = main["children"][0]["children"][0]
    assert read == {"name": "vfs_read", "module": "", "kernel": True, "value": 20, "self": 20, "children": []}


def test_to_json_ties_sorted_by_name_and_total_override():
    doc = to_json({(F("b"),): 5, (F("a"),): 5, (F("c"),): 9}, total_samples=30)
    assert [c["name"] for c in doc["root"]["children"]] == ["c", "a", "b"]
    assert doc["total"] == 30 and doc["root"]["value"] == 19 and doc["frequency_hz"] is None


def test_to_json_handles_stacks_deeper_than_the_recursion_limit():
    deep = tuple(F(f"f{i}") for i in range(3000))
    doc = to_json({deep: 1})
    node, depth = doc["root"], 0
    while node["children"]:
        node, depth = node["children"][0], depth + 1
    assert depth == 3000


# ---- top functions ---------------------------------------------------------------------------------


def test_top_functions_self_and_total():
    rows = top_functions(STACKS)
    by_name = {r["function"]: r for r in rows}
    assert [r["function"] for r in rows] == ["work", "sleep", "vfs_read", "main"]
    assert (by_name["work"]["self"], by_name["work"]["total"]) == (50, 70)
    assert (by_name["main"]["self"], by_name["main"]["total"]) == (5, 100)
    assert by_name["vfs_read"]["kernel"] is True and by_name["sleep"]["module"] == "libc.so.6"
    assert by_name["work"]["self_pct"] == 50.0 and by_name["work"]["total_pct"] == 70.0


def test_top_functions_counts_recursion_once_per_stack():
    rec = F("recurse")
    rows = top_functions({(MAIN, rec, rec, rec): 10, (MAIN, rec): 5})
    row = next(r for r in rows if r["function"] == "recurse")
    assert (row["self"], row["total"], row["total_pct"]) == (15, 15, 100.0)


def test_top_functions_limit_and_empty():
    assert len(top_functions(STACKS, limit=2)) == 2
    assert top_functions({}) == []


def test_top_functions_merge_a_python_functions_lines_and_only_python_frames():
    """A Python frame is "qualname (file.py:LINE)" with the file's path as its module: its lines are one
    function; a name that only looks alike (another module, a kernel frame) is left as it is. A recursive
    function running two lines of one stack counts once in its total."""
    py = "/srv/a.py"
    f7, f6, g = F("f (a.py:7)", py), F("f (a.py:6)", py), F("g (a.py:2)", py)
    lookalike, kernel = F("op (a.py:3)", "/usr/bin/app"), F("k (a.py:4)", "", True)
    stacks = {(g, f6, f7): 30, (g, f6): 10, (MAIN, lookalike): 5, (MAIN, kernel): 5}
    rows = {r["function"]: r for r in top_functions(stacks)}
    assert (rows["f (a.py)"]["self"], rows["f (a.py)"]["total"], rows["f (a.py)"]["lines"]) == (
        40,
        40,
        [6, 7],
    )
    assert rows["f (a.py)"]["module"] == py and rows["g (a.py)"]["lines"] == [2]
    assert "lines" not in rows["op (a.py:3)"] and "lines" not in rows["k (a.py:4)"]
    apart = {r["function"]: r for r in top_functions(stacks, lines=True)}
    assert (apart["f (a.py:7)"]["self"], apart["f (a.py:6)"]["self"], apart["f (a.py:6)"]["total"]) == (
        30,
        10,
        40,
    )


# ---- truncate --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_nodes", [1, 2, 5, 17, 60, 500, 100_000])
def test_truncate_preserves_sum_and_bounds_nodes(max_nodes):
    stacks = wide_stacks()
    out = truncate(stacks, max_nodes)
    assert sum(out.values()) == sum(stacks.values())
    assert count_nodes(build_tree(out)) <= max_nodes
    assert build_tree(out).total == build_tree(stacks).total


def test_truncate_keeps_heaviest_and_folds_the_rest_into_other():
    stacks = {(F("big"),): 90, (F("small1"),): 6, (F("small2"),): 4}
    out = truncate(stacks, 2)
    assert out == {(F("big"),): 90, (OTHER,): 10}


def test_truncate_is_identity_when_everything_fits():
    stacks = wide_stacks(3, 3)
    assert truncate(stacks, 10_000) == stacks


def test_truncate_keeps_parent_self_counts():
    out = truncate(STACKS, 3)
    assert sum(out.values()) == 100
    assert out[(MAIN,)] == 5


# ---- SVG -------------------------------------------------------------------------------------------


def svg_frames(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg.encode("utf-8"))
    frames = root.find(f".//{SVG}g[@id='frames']")
    assert frames is not None
    return list(frames)


def test_svg_is_wellformed_with_a_rect_per_visible_node():
    svg = render_svg(STACKS, title="cpu <test>", subtitle="node-1 & co", frequency_hz=19)
    frames = svg_frames(svg)
    assert len(frames) == 1 + count_nodes(build_tree(STACKS))
    assert all(g.find(f"{SVG}rect") is not None for g in frames)
    titles = [g.find(f"{SVG}title").text for g in frames]
    assert "work (app) — 70 samples, 70.00%, 3.68 s" in titles
    assert any(t.startswith("vfs_read (kernel) — 20 samples") for t in titles)
    root = ET.fromstring(svg.encode("utf-8"))
    assert root.find(f".//{SVG}script") is not None and "zoom" in root.find(f".//{SVG}script").text
    assert "cpu &lt;test&gt;" in svg and "node-1 &amp; co" in svg
    assert "Reset zoom" in svg and "Search" in svg


def test_svg_escapes_hostile_names():
    evil = "<&>\"'\x01"
    svg = render_svg({(F(evil), F("x" * 10)): 3, (F("ok"),): 1})
    names = [g.get("data-n") or g.find(f"{SVG}text").text for g in svg_frames(svg)]
    assert "<&>\"'\ufffd" in names


def test_svg_omits_frames_narrower_than_min_width():
    stacks = {(F("wide"),): 10_000, (F("tiny"),): 1}
    svg = render_svg(stacks, width=1200, min_width_px=0.5)
    titles = [g.find(f"{SVG}title").text for g in svg_frames(svg)]
    assert not any(t.startswith("tiny") for t in titles)
    assert titles[0].startswith("all — 10001 samples")


def test_svg_puts_the_root_on_top():
    rects = [g.find(f"{SVG}rect") for g in svg_frames(render_svg(STACKS))]
    root_y, leaf_y = float(rects[0].get("y")), float(rects[-1].get("y"))
    assert root_y < leaf_y
    assert min(float(r.get("y")) for r in rects) == root_y


def test_svg_labels_truncated_with_dots_and_full_name_kept():
    long_name = "a_really_long_function_name_" * 4
    svg = render_svg({(F(long_name),): 1, (F("other_side"),): 9}, width=400)
    g = next(g for g in svg_frames(svg) if g.get("data-n") == long_name)
    text = g.find(f"{SVG}text")
    assert text is None or text.text.endswith("..")


def test_svg_colours_are_deterministic_and_kernel_differs():
    assert frame_colour("malloc", False) == frame_colour("malloc", False)
    user = frame_colour("malloc", False)
    kernel = frame_colour("malloc", True)
    assert user != kernel
    assert int(user[1:3], 16) >= 200  # warm: red dominant
    assert int(kernel[5:7], 16) >= 200  # kernel: blue dominant


def test_svg_size_stays_near_200_bytes_per_rect():
    stacks = wide_stacks(8, 3)
    svg = render_svg(stacks)
    rects = len(svg_frames(svg))
    script_and_chrome = len(render_svg({(F("x"),): 1}))
    assert (len(svg.encode()) - script_and_chrome) / rects < 260


def test_svg_empty_profile_is_still_valid():
    svg = render_svg({})
    assert svg_frames(svg) == [] and "no samples" in svg
