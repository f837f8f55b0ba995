"""Flame graphs as a person opens them, in real headless Chromium: the SVG and HTML files, the web UI's flame
graph and its diff flame graph all put the root on top, open showing it, and are as deep as the deepest
frame holding 0.1% of the samples, with deeper frames a scroll or a zoom away; all draw with one palette;
`fleetprof flame -o x.html` works with the network off."""

from __future__ import annotations

import json
import os
import random
import re
import urllib.parse
from pathlib import Path

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.html import render_html
from fleetprof.collector.render.svg import frame_colour, render_svg
from fleetprof.collector.render.webflame import look
from tests.conftest import RunningCollector, fleetprof
from tests.support.browser import CHROMIUM, Chromium, Page
from tests.support.profiles import Row, push_profile

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

APP = "/app/svc"
CHAIN = [(f"deep_{i:03d}", APP) for i in range(200)]
ODD = "naïve_缓存_𝑓"  # code points beyond ASCII and beyond the BMP: both hashes walk code points
# 11,000 samples. Levels: all 0, main 1, work/read/rare 2, hot/cold/vfs_read/odd/deep_000 3, ...
# deep_199 202. The 200-deep chain holds 8 samples (0.073% < 0.1%), so the drawing opens 4 levels deep;
# rare holds 100 (0.91%), and zoomed into, its chain holds 8% of the view: all 203 levels show.
ROWS: list[Row] = [
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("work", APP), ("hot", APP)], 3, 7000),
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("work", APP), ("cold", APP)], 3, 2850),
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("work", APP), (ODD, APP)], 3, 50),
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("read", "/lib/libc.so.6"), ("vfs_read", "")], 2, 1000),
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("rare", APP)], 2, 92),
    (301, "svc", {"pod": "svc-0"}, [("main", APP), ("rare", APP), *CHAIN], 202, 8),
]
OPEN_LEVELS = 4
ALL_LEVELS = 203
HTML_LEVEL_PX = 18  # app.flame.js's FRAME_H


def stacks_of(rows: list[Row]) -> dict[tuple[FrameKey, ...], int]:
    return {
        tuple(FrameKey(f, m, i >= kernel_start) for i, (f, m) in enumerate(frames)): n
        for _pid, _comm, _labels, frames, kernel_start, n in rows
    }


@pytest.fixture(scope="module")
def deep(module_collector: RunningCollector) -> RunningCollector:
    """svc-0 holding ROWS, and svc-1 the same with hot doubled (a second side for the comparison)."""
    push_profile(module_collector.grpc_target, ROWS)
    svc1 = [
        (302, "svc", {"pod": "svc-1"}, f, k, n * (2 if f[-1][0] == "hot" else 1)) for _, _, _, f, k, n in ROWS
    ]
    push_profile(module_collector.grpc_target, svc1)
    return module_collector


# ---- the SVG file -------------------------------------------------------------------------------------

# The levels an SVG shows: the distinct y of its frames that are drawn (not display:none).
SVG_LEVELS = """[...new Set([...document.querySelectorAll('#frames > g')]
    .filter(g => g.getBoundingClientRect().height > 0)
    .map(g => g.querySelector('rect').getAttribute('y')))].length"""
# The root's rect in the window, the top of the highest frame drawn, and the window's height.
SVG_ROOT = """(() => {
    const drawn = [...document.querySelectorAll('#frames rect')].map(r => r.getBoundingClientRect())
      .filter(r => r.height > 0);
    return [drawn[0].top, drawn[0].bottom, Math.min(...drawn.map(r => r.top)), innerHeight];
  })()"""


def svg_group(name: str, doc: str = "document") -> str:
    """A JS expression: the frame group whose tooltip starts with `name`."""
    return (
        f"[...{doc}.querySelectorAll('#frames > g')]"
        f".find(g => g.querySelector('title').textContent.startsWith({json.dumps(name + ' ')}))"
    )


def svg_levels(page: Page, doc: str = "document") -> int:
    return page.evaluate(SVG_LEVELS.replace("document", doc))


def open_svg(page: Page, tmp_path: Path) -> None:
    path = tmp_path / "deep.svg"
    path.write_text(render_svg(stacks_of(ROWS)))
    page.goto(path.as_uri())
    page.wait_for("document.querySelectorAll('#frames > g[data-i]').length > 0")


def test_svg_opens_on_the_root_as_deep_as_the_frames_that_hold_a_tenth_of_a_percent(
    page: Page, tmp_path: Path
) -> None:
    open_svg(page, tmp_path)
    assert svg_levels(page) == OPEN_LEVELS
    # Root on top, where the first paint shows it: the highest frame, inside the window.
    root = page.evaluate(SVG_ROOT)
    assert root[0] == root[2] and 0 <= root[0] and root[1] <= root[3]
    assert page.evaluate("document.querySelector('#frames > g title').textContent").startswith("all — 11000")
    # The drawing is as tall as four levels and its header, not 203 levels (3,248 px of frames).
    height = page.evaluate("document.documentElement.getBoundingClientRect().height")
    assert height < 16 * OPEN_LEVELS + 120
    # The chain is there, hidden below the view, and the line under the frames says so.
    assert page.evaluate(f"getComputedStyle({svg_group('deep_199')}).display") == "none"
    assert "deeper frames" in page.evaluate("document.getElementById('deeper').textContent")
    assert page.evaluate("document.getElementById('deeper').getBoundingClientRect().height") > 0

    # A click on that line shows every level (an SVG cannot scroll), and another hides them again.
    page.click("#deeper")
    page.wait_for(f"({SVG_LEVELS}) === {ALL_LEVELS}")
    assert page.evaluate("document.documentElement.getBoundingClientRect().height") > 16 * ALL_LEVELS
    page.click("#deeper")
    page.wait_for(f"({SVG_LEVELS}) === {OPEN_LEVELS}")
    assert page.errors() == []


def test_zooming_into_the_svg_brings_the_deep_frames_into_view_and_reset_closes_them(
    page: Page, tmp_path: Path
) -> None:
    open_svg(page, tmp_path)
    rare = page.evaluate(f"{svg_group('rare')}.getAttribute('data-i')")
    page.click(f'#frames > g[data-i="{rare}"] rect')
    # all and main above as ancestors, rare across the width, its 200-deep chain under it: 8% of rare.
    page.wait_for(f"({SVG_LEVELS}) === {ALL_LEVELS}")
    assert page.evaluate("document.getElementById('reset').getAttribute('class')") == "ctl"
    hidden = page.evaluate("[...document.querySelectorAll('#frames > g.hid title')].map(t => t.textContent)")
    assert any(t.startswith("hot ") for t in hidden)  # outside the zoomed subtree
    assert page.evaluate("document.getElementById('deeper').getAttribute('class')") == "ctl hid"
    page.click("#reset")
    page.wait_for(f"({SVG_LEVELS}) === {OPEN_LEVELS}")
    assert page.errors() == []


# ---- the HTML file ------------------------------------------------------------------------------------


def box_geometry(page: Page, box: str) -> dict:
    """The flame graph box's visible and drawn heights, and where its root frame sits in it."""
    return page.evaluate(
        f"(() => {{ const box = document.querySelector({box!r});"
        " const root = box.querySelector('.frame[data-i=\"0\"]');"
        " const b = box.getBoundingClientRect(), r = root.getBoundingClientRect();"
        " return {client: box.clientHeight, scroll: box.scrollHeight, top: b.top + box.clientTop,"
        " bottom: b.top + box.clientTop + box.clientHeight, rootTop: r.top, rootBottom: r.bottom,"
        " window: innerHeight}; })()"
    )


def test_html_opens_on_the_root_in_a_box_as_deep_as_the_frames_that_matter_and_scrolls_to_the_rest(
    page: Page, tmp_path: Path
) -> None:
    path = tmp_path / "deep.html"
    path.write_text(render_html(stacks_of(ROWS)))
    page.goto(path.as_uri())
    page.wait_for("document.querySelectorAll('#flame .frame').length > 0")
    g = box_geometry(page, "#flame")
    assert g["client"] == OPEN_LEVELS * HTML_LEVEL_PX
    assert g["scroll"] == ALL_LEVELS * HTML_LEVEL_PX  # every level is drawn, below the box's edge
    assert g["rootTop"] == g["top"] and g["rootBottom"] < g["window"]  # the first paint shows the root
    assert not page.evaluate("document.getElementById('deeper').hidden")
    # Scrolled to the bottom, the chain's last frame is in the box.
    last = page.evaluate(
        "(() => { const box = document.getElementById('flame'); box.scrollTop = box.scrollHeight;"
        " const r = box.querySelector('.frame[data-name=\"deep_199\"]').getBoundingClientRect(),"
        " b = box.getBoundingClientRect(); return [r.top >= b.top, r.bottom <= b.bottom + 1]; })()"
    )
    assert last == [True, True]

    page.click('#flame .frame[data-name="rare"]')
    page.wait_for("!document.getElementById('reset').hidden")
    g = box_geometry(page, "#flame")
    assert g["client"] == g["scroll"] == ALL_LEVELS * HTML_LEVEL_PX  # zoomed: the chain counts, all shows
    assert page.evaluate("document.getElementById('deeper').hidden")
    assert page.errors() == []


# ---- the web UI's flame graph and diff flame graph -------------------------------------------------------


def open_ui(page: Page, col: RunningCollector, selector: str = '{pod="svc-0"}') -> None:
    page.goto(col.url + "/#" + urllib.parse.urlencode({"query": selector}))
    page.wait_for("document.getElementById('total').textContent.startsWith('11000 samples')")
    page.wait_for("document.querySelectorAll('#labels .chip').length > 0")  # they push the page down


def test_ui_flame_graph_opens_on_the_root_as_deep_as_the_frames_that_matter(
    page: Page, deep: RunningCollector
) -> None:
    open_ui(page, deep)
    g = box_geometry(page, "#flamegraph")
    assert g["client"] == OPEN_LEVELS * HTML_LEVEL_PX and g["scroll"] == ALL_LEVELS * HTML_LEVEL_PX
    assert g["rootTop"] == g["top"] and g["rootBottom"] < g["window"]
    assert not page.evaluate("document.getElementById('flame-deeper').hidden")

    # Root at bottom, as before: the root is then the bottom level, and the box opens scrolled to it.
    page.click("#invert")
    g = box_geometry(page, "#flamegraph")
    assert abs(g["rootBottom"] - g["bottom"]) <= 1 and g["client"] == OPEN_LEVELS * HTML_LEVEL_PX
    page.click("#invert")

    page.click('#flamegraph .frame[data-name="rare"]')
    page.wait_for(f"document.getElementById('flamegraph').clientHeight === {ALL_LEVELS * HTML_LEVEL_PX}")
    assert page.evaluate("document.getElementById('flame-deeper').hidden")
    page.click("#reset-zoom")
    page.wait_for(f"document.getElementById('flamegraph').clientHeight === {OPEN_LEVELS * HTML_LEVEL_PX}")
    assert page.errors() == []


def test_ui_diff_flame_graph_opens_on_the_root_and_its_frame_follows_a_zoom(
    page: Page, deep: RunningCollector
) -> None:
    open_ui(page, deep)
    page.click("#compare-toggle")
    page.wait_for("!document.getElementById('compare-section').hidden")
    page.type_into("#a-query", '{pod="svc-0"}')
    page.type_into("#b-query", '{pod="svc-1"}')
    page.click("#compare-run")
    doc = "document.getElementById('compare-svg').contentDocument"
    page.wait_for(f"{doc} && {doc}.querySelectorAll('#frames > g[data-i]').length > 0")
    page.wait_for(f"document.getElementById('compare-svg').getBoundingClientRect().height < {16 * 8 + 150}")
    assert svg_levels(page, doc) == OPEN_LEVELS
    frame_h, svg_h = page.evaluate(
        f"[document.getElementById('compare-svg').getBoundingClientRect().height,"
        f" Number({doc}.documentElement.getAttribute('height'))]"
    )
    assert frame_h == svg_h + 4  # the iframe takes the drawing's height: no scrolling inside it
    root_y, min_y = page.evaluate(
        f"(() => {{ const ys = [...{doc}.querySelectorAll('#frames rect')]"
        ".map(r => Number(r.getAttribute('y'))); return [ys[0], Math.min(...ys)]; })()"
    )
    assert root_y == min_y  # root on top

    # A real click on rare inside the frame: the diff graph zooms, grows, and the frame grows with it.
    x, y = page.evaluate(
        f"(() => {{ const f = document.getElementById('compare-svg'); f.scrollIntoView({{block: 'start'}});"
        f" const g = {svg_group('rare', doc)};"
        " const o = f.getBoundingClientRect(), r = g.querySelector('rect').getBoundingClientRect();"
        " return [o.left + f.clientLeft + r.left + r.width / 2,"
        " o.top + f.clientTop + r.top + r.height / 2]; })()"
    )
    page.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
    for kind in ("mousePressed", "mouseReleased"):
        page.call(
            "Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}
        )
    page.wait_for(f"({SVG_LEVELS.replace('document', doc)}) === {ALL_LEVELS}")
    page.wait_for(
        f"document.getElementById('compare-svg').getBoundingClientRect().height ==="
        f" Number({doc}.documentElement.getAttribute('height')) + 4"
    )
    grown = page.evaluate("document.getElementById('compare-svg').getBoundingClientRect().height")
    assert grown > 16 * ALL_LEVELS
    assert page.errors() == []


# ---- one palette ------------------------------------------------------------------------------------


def test_the_svg_the_html_file_and_the_ui_give_each_frame_the_same_colour(
    page: Page, browser: Chromium, deep: RunningCollector, tmp_path: Path
) -> None:
    hex_of = (
        "(c => '#' + c.match(/\\d+/g).slice(0, 3).map(n => Number(n).toString(16).padStart(2, '0')).join(''))"
    )
    open_ui(page, deep)
    ui = dict(
        page.evaluate(
            f"[...document.querySelectorAll('#flamegraph .frame')].map(f => [f.dataset.name,"
            f" {hex_of}(getComputedStyle(f).backgroundColor)])"
        )
    )
    svg = browser.new_page()
    try:
        params = urllib.parse.urlencode({"format": "svg", "since": "1h", "query": '{pod="svc-0"}'})
        svg.goto(f"{deep.url}/api/v1/profile?{params}")
        svg.wait_for("document.querySelectorAll('#frames > g[data-i]').length > 0")
        drawn = dict(
            svg.evaluate(
                "[...document.querySelectorAll('#frames > g')].map(g => [g.getAttribute('data-n') ||"
                " g.querySelector('title').textContent.split(' (')[0].split(' — ')[0],"
                " g.querySelector('rect').getAttribute('fill')])"
            )
        )
    finally:
        svg.close()
    html = tmp_path / "svc.html"
    html.write_text(render_html(stacks_of(ROWS)))
    page.goto(html.as_uri())
    page.wait_for("document.querySelectorAll('#flame .frame').length > 0")
    in_html = dict(
        page.evaluate(
            f"[...document.querySelectorAll('#flame .frame')].map(f => [f.dataset.name,"
            f" {hex_of}(getComputedStyle(f).backgroundColor)])"
        )
    )
    names = {"all", "main", "work", "hot", "cold", ODD, "read", "vfs_read", "rare", "deep_000"}
    assert names <= set(ui) and names <= set(drawn) and names <= set(in_html)
    for name in names:
        assert ui[name] == drawn[name] == in_html[name], name
    assert ui["vfs_read"] == frame_colour("vfs_read", True) != frame_colour("vfs_read", False)
    assert ui["all"] == look()["plain"]  # the root, grey

    # And name by name beyond these: the JavaScript palette against the Python one.
    rng = random.Random(29)
    alphabet = "abcxyz_:<>~ éü缓存𝑓😀"
    samples = ["", "a", "__schedule", "std::vector<int>::push_back"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24))) for _ in range(200)
    ]
    pairs = [(name, kernel) for name in samples for kernel in (False, True)]
    js = page.evaluate(f"{json.dumps(pairs)}.map(([n, k]) => FleetprofFlame.frameColour(n, k))")
    assert js == [frame_colour(name, kernel) for name, kernel in pairs]
    assert page.errors() == []


# ---- `fleetprof flame -o x.html` offline -------------------------------------------------------------------


def test_flame_to_html_works_with_the_network_off(page: Page, deep: RunningCollector, tmp_path: Path) -> None:
    out = tmp_path / "cpu.html"
    r = fleetprof(
        "flame", "--collector", deep.url, "--query", '{pod="svc-0"}', "--since", "1h", "-o", str(out)
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    # Everything inline: no script, style or image from anywhere.
    assert not re.search(r"<(?:script|img|iframe)[^>]*\bsrc=", text, re.I)
    assert not re.search(r"<link[^>]*\bhref=(?![\"']data:)", text, re.I)
    assert "FleetprofFlame.htmlPage()" in text

    page.call("Network.enable")
    page.call(
        "Network.emulateNetworkConditions",
        {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )
    start = page.browser.event_count()
    page.goto(out.as_uri())
    page.wait_for("document.querySelectorAll('#flame .frame').length > 0")
    names = set(page.evaluate("[...document.querySelectorAll('#flame .frame')].map(f => f.dataset.name)"))
    assert {"all", "main", "hot", "cold", "vfs_read", "rare"} <= names
    page.click('#flame .frame[data-name="work"]')
    page.wait_for("!document.getElementById('reset').hidden")
    page.type_into("#search", "^hot$")
    assert (
        page.wait_for("document.getElementById('matched').textContent") == "matched: 63.64%"
    )  # 7000 of 11000
    events, _ = page.browser.events(page.session, start)
    requested = {e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"}
    assert requested == {out.as_uri()}
    assert page.errors() == []
