"""End-to-end tests of the collector's web UI and SVG in real headless Chromium, fed over real gRPC ingest."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, start_collector
from tests.support.browser import CHROMIUM, Chromium, Page
from tests.support.profiles import PROFILE, profile_batch, push_profile
from tests.support.wire import BatchBuilder, push

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

FREQUENCY_HZ = 19
# PROFILE (tests/support/profiles.py): hot_loop 300 samples, cold_path 60 + 40 = 100; only the server ever
# runs accept_loop and sys_read.
TOTAL = 400


@pytest.fixture(scope="module")
def profiled(module_collector: RunningCollector) -> RunningCollector:
    """The module's collector holding PROFILE, pushed through the real gRPC ingest path."""
    push_profile(module_collector.grpc_target, PROFILE, frequency_hz=FREQUENCY_HZ)
    return module_collector


def frame_names(page: Page) -> list[str]:
    return page.evaluate("[...document.querySelectorAll('#flamegraph .frame')].map(f => f.dataset.name)")


def open_ui(page: Page, collector: RunningCollector) -> None:
    page.goto(collector.url + "/")
    page.wait_for("document.querySelectorAll('#flamegraph .frame').length > 0")


def test_behind_the_api_token_the_browser_logs_in_and_the_page_works(page: Page, tmp_path: Path) -> None:
    """With --api-token-file the page answers 401 with a Basic challenge; a person types any user name and
    the token as password, and the page and every API call it makes go through with it."""
    tokens = tmp_path / "api-tokens"
    tokens.write_text("ui-token-63f1\n")
    col = start_collector(api_token_file=str(tokens))
    try:
        protected = RunningCollector(col)
        push_profile(protected.grpc_target, PROFILE, frequency_hz=FREQUENCY_HZ)
        prompted = page.answer_logins("sre", "ui-token-63f1")
        open_ui(page, protected)
        assert prompted and prompted[0].startswith(protected.url + "/")
        assert {"hot_loop", "cold_path"} <= set(frame_names(page))
        assert page.evaluate("document.getElementById('error').hidden") is True
        assert col.http.unauthorized >= 1  # the prompt came from a real 401
    finally:
        col.stop()


def test_page_draws_flame_graph_top_table_and_total_from_ingested_profile(
    page: Page, profiled: RunningCollector
) -> None:
    open_ui(page, profiled)
    names = frame_names(page)
    assert {"hot_loop", "cold_path", "accept_loop", "sys_read"} <= set(names)
    widths = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#flamegraph .frame')]"
        ".filter(f => f.dataset.name === 'hot_loop' || f.dataset.name === 'run')"
        ".map(f => [f.dataset.name, f.getBoundingClientRect().width]))"
    )
    assert widths["hot_loop"] > 0.8 * widths["run"]  # 300 of run's 360 samples
    kernel = page.evaluate(
        "document.querySelector('#flamegraph .frame[data-name=\"sys_read\"]').dataset.kernel"
    )
    assert kernel == "true"

    first_row = page.evaluate(
        "[...document.querySelector('#top-table tbody tr').cells].map(c => c.textContent)"
    )
    assert first_row[0] == "hot_loop"
    assert first_row[2] == "300" and first_row[3] == "75.00%"
    assert page.evaluate("document.getElementById('total').textContent").startswith(f"{TOTAL} samples")
    assert page.evaluate("document.getElementById('error').hidden") is True
    assert page.errors() == []

    # Left for a person to look at; not an assertion.
    page.screenshot(Path("/tmp/fleetprof-web-ui.png"))


def test_typed_selector_and_refresh_narrow_the_flame_graph(page: Page, profiled: RunningCollector) -> None:
    open_ui(page, profiled)
    assert "accept_loop" in frame_names(page)

    page.type_into("#selector", '{comm="worker"}')
    page.click("#refresh")
    page.wait_for(
        "!document.querySelector('#flamegraph .frame[data-name=\"accept_loop\"]')"
        " && document.getElementById('total').textContent.startsWith('360 samples')"
    )
    names = set(frame_names(page))
    assert {"hot_loop", "cold_path", "run"} <= names
    assert not {"accept_loop", "sys_read"} & names
    top = page.evaluate("[...document.querySelectorAll('#top-table tbody tr')].map(r => r.dataset.name)")
    assert "sys_read" not in top and top[0] == "hot_loop"
    # The query lands in the URL hash, so the view can be shared or reloaded.
    assert parse_qs(page.evaluate("location.hash").lstrip("#"))["query"] == ['{comm="worker"}']
    assert page.errors() == []


def test_bad_selector_shows_the_collectors_message(page: Page, profiled: RunningCollector) -> None:
    open_ui(page, profiled)
    page.type_into("#selector", '{pod=~"("}')
    page.click("#refresh")
    page.wait_for("!document.getElementById('error').hidden")
    message = page.evaluate("document.getElementById('error').innerText")
    assert "bad selector" in message and "regex" in message
    assert "HTTP 400" in message
    assert page.evaluate("getComputedStyle(document.getElementById('error')).display") != "none"
    # The browser logs the 400 responses themselves as network errors; nothing else may go wrong.
    assert page.errors(include_network=False) == []


def test_svg_endpoint_renders_in_the_browser_and_its_script_runs(
    page: Page, profiled: RunningCollector
) -> None:
    page.goto(profiled.url + "/api/v1/profile?format=svg")
    assert page.evaluate("document.documentElement.localName") == "svg"
    assert page.evaluate("document.querySelectorAll('#frames rect').length") >= 8
    titles = page.evaluate("[...document.querySelectorAll('#frames title')].map(t => t.textContent)")
    assert any(t.startswith("hot_loop (/app/worker) — 300 samples, 75.00%") for t in titles)
    assert any(t.startswith("cold_path") for t in titles)
    labels = page.evaluate("[...document.querySelectorAll('#frames text')].map(t => t.textContent)")
    assert "hot_loop" in labels
    # The embedded script first numbers every frame group (its zoom handler relies on that).
    assert page.evaluate("[...document.querySelectorAll('#frames > g')].every(g => g.hasAttribute('data-i'))")

    # Clicking a frame zooms into it: siblings outside its subtree hide and "Reset zoom" appears.
    index = page.evaluate(
        "[...document.querySelectorAll('#frames > g')]"
        ".findIndex(g => g.querySelector('title').textContent.startsWith('hot_loop'))"
    )
    page.click(f'#frames > g[data-i="{index}"] rect')
    page.wait_for("document.getElementById('reset').getAttribute('class') === 'ctl'")
    hidden = page.evaluate(
        "[...document.querySelectorAll('#frames > g.hid title')].map(t => t.textContent.split(' ')[0])"
    )
    assert "accept_loop" in hidden
    assert page.errors() == []


# ---- CPU over time: the chart, a drag to zoom into a time range, and the A/B comparison --------------

CHART_HZ = 100  # 10 ms per sample: 60 samples are 0.60 CPU s
# Samples per 10 s store bucket, keyed by how many buckets before the current one: "early_work" ran about
# five minutes ago in pod trainer-0, "late_work" about two minutes ago in trainer-1; both lie inside the
# page's default range (last 15m), with empty steps between them.
EARLY = {30: 10, 29: 20, 28: 30}
LATE = {12: 40, 11: 50, 10: 60}


@dataclass
class TimeSplit:
    collector: RunningCollector
    samples: dict[float, int]  # step start (unix seconds) -> samples pushed into that 10 s step
    early: list[float]  # step starts of early_work, oldest first
    late: list[float]  # step starts of late_work


@pytest.fixture
def time_split(collector: RunningCollector) -> TimeSplit:
    """A fresh collector holding early_work in three early 10 s steps and late_work in three late ones."""
    now = time.time()
    current = math.floor(now / 10) * 10
    batches, samples, starts = [], {}, {}
    for function, pod, counts in (("early_work", "trainer-0", EARLY), ("late_work", "trainer-1", LATE)):
        starts[function] = []
        for ago, n in sorted(counts.items(), reverse=True):
            start = current - 10 * ago
            frames = [("main", "/app/worker"), ("step", "/app/worker"), (function, "/app/worker")]
            rows = [(101, "worker", {"namespace": "ml", "pod": pod}, frames, 3, n)]
            # A 1 s batch in the middle of its step: the store files a batch under its midpoint's bucket.
            batches.append(
                profile_batch(rows, ago_s=now - (start + 5.5), window_s=1.0, frequency_hz=CHART_HZ)
            )
            samples[float(start)] = n
            starts[function].append(float(start))
    assert push(collector.grpc_target, batches) == [1] * len(batches)
    return TimeSplit(collector, samples, starts["early_work"], starts["late_work"])


def chart_bars(page: Page) -> dict[float, dict]:
    """Each bar of the chart by its step start: samples, and its box in viewport pixels."""
    bars = page.evaluate(
        "[...document.querySelectorAll('#chart .bar')].map(b => { const r = b.getBoundingClientRect();"
        " return [Number(b.dataset.t), Number(b.dataset.samples), r.left, r.right, r.height]; })"
    )
    return {t: {"samples": n, "left": left, "right": right, "height": h} for t, n, left, right, h in bars}


def drag_across(page: Page, first: float, last: float) -> None:
    """Drag on the chart from inside the bar of step `first` to inside the bar of step `last`."""
    bars = chart_bars(page)
    y = page.evaluate(
        "(() => { const r = document.querySelector('#chart .chart-plot').getBoundingClientRect();"
        " return r.top + r.height / 2; })()"
    )
    page.drag((bars[first]["left"] + 2, y), (bars[last]["right"] - 2, y))


def hash_params(page: Page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(page.evaluate("location.hash").lstrip("#")).items()}


def unix(text: str) -> float:
    """The unix seconds of an RFC 3339 time as the page writes them into its fields and URL."""
    return datetime.fromisoformat(text).timestamp()


def diff_rows(page: Page) -> dict[str, dict]:
    """The comparison table as a person reads it, by function."""
    rows = page.evaluate(
        "[...document.querySelectorAll('#compare-table tr.diff-row')].map(r => [r.dataset.name,"
        " r.dataset.direction, Number(r.dataset.delta), [...r.cells].map(c => c.textContent)])"
    )
    return {name: {"direction": d, "delta": delta, "cells": cells} for name, d, delta, cells in rows}


def open_chart(page: Page, split: TimeSplit) -> None:
    """The page with its chart drawn and its label chips in: they load last and push the page down, so
    coordinates taken before them would miss."""
    open_ui(page, split.collector)
    page.wait_for(
        f"document.querySelectorAll('#chart .bar').length === {len(split.samples)}"
        " && document.querySelectorAll('#labels .chip').length > 0"
    )


def open_compare(page: Page) -> None:
    page.click("#compare-toggle")
    page.wait_for("!document.getElementById('compare-section').hidden")


def test_cpu_chart_draws_one_bar_per_step_as_tall_as_its_cpu_time(page: Page, time_split: TimeSplit) -> None:
    open_chart(page, time_split)
    bars = chart_bars(page)
    assert {t: b["samples"] for t, b in bars.items()} == time_split.samples
    # Heights follow the samples pushed into each step (60 samples, the most, nearly fill the plot) ...
    px_per_sample = bars[time_split.late[-1]]["height"] / 60
    assert px_per_sample * 60 > 100
    for b in bars.values():
        assert abs(b["height"] - b["samples"] * px_per_sample) <= 1, b
    # ... and x positions follow time, early steps left of late ones with the empty minutes between.
    first = min(bars)
    px_per_s = (bars[max(bars)]["left"] - bars[first]["left"]) / (max(bars) - first)
    for t, b in bars.items():
        assert abs(b["left"] - (bars[first]["left"] + (t - first) * px_per_s)) <= 1, (t, b)
    assert page.evaluate("document.getElementById('chart-unit').textContent") == "CPU seconds per 10 s step"
    top_label = page.evaluate("document.querySelector('#chart .chart-ylabel').textContent")
    assert top_label == "0.6 s"  # 60 samples at 100 Hz

    # Hovering a step tells its CPU time.
    bar = bars[time_split.late[-1]]
    y = page.evaluate("document.querySelector('#chart .chart-plot').getBoundingClientRect().bottom - 5")
    page.call(
        "Input.dispatchMouseEvent", {"type": "mouseMoved", "x": (bar["left"] + bar["right"]) / 2, "y": y}
    )
    tip = page.wait_for(
        "!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent"
    )
    assert "60 samples" in tip and "0.60 CPU s" in tip
    assert page.errors() == []
    page.screenshot(Path("/tmp/fleetprof-web-ui-chart.png"))  # for a person to look at


def test_dragging_across_the_late_steps_zooms_flame_graph_and_top_table_into_them(
    page: Page, time_split: TimeSplit
) -> None:
    open_chart(page, time_split)
    assert {"early_work", "late_work"} <= set(frame_names(page))

    drag_across(page, time_split.late[0], time_split.late[-1])
    page.wait_for("document.getElementById('total').textContent.startsWith('150 samples')")
    names = set(frame_names(page))
    assert "late_work" in names and "early_work" not in names
    top = page.evaluate("[...document.querySelectorAll('#top-table tbody tr')].map(r => r.dataset.name)")
    assert "late_work" in top and "early_work" not in top
    # The picked range is whole steps, in the range fields and the URL: from the first late step's start
    # to the last second of the last late step.
    params = hash_params(page)
    assert unix(params["from"]) == time_split.late[0]
    assert unix(params["until"]) == time_split.late[-1] + 9
    assert page.evaluate("document.getElementById('range').value") == "custom"
    assert page.evaluate("document.getElementById('from').value") == params["from"]
    # The chart zooms with it.
    page.wait_for(f"document.querySelectorAll('#chart .bar').length === {len(time_split.late)}")
    assert set(chart_bars(page)) == set(time_split.late)

    # Zoom out goes back to the range before the drag.
    page.click("#zoom-out")
    page.wait_for(
        "document.getElementById('total').textContent.startsWith('210 samples')"
        f" && document.querySelectorAll('#chart .bar').length === {len(time_split.samples)}"
    )
    assert {"early_work", "late_work"} <= set(frame_names(page))
    assert page.evaluate("document.getElementById('range').value") == "15m"
    assert page.evaluate("document.getElementById('zoom-out').disabled") is True
    assert page.errors() == []


def test_comparing_the_early_and_late_steps_shows_early_work_shrank_and_late_work_grew(
    page: Page, browser: Chromium, time_split: TimeSplit
) -> None:
    open_chart(page, time_split)
    open_compare(page)
    # The first drag sets A, the next B, and then both are compared; the flame graph stays as it was.
    drag_across(page, time_split.early[0], time_split.early[-1])
    page.wait_for('document.querySelector(\'input[name="drag-sets"][value="b"]\').checked')
    drag_across(page, time_split.late[0], time_split.late[-1])
    page.wait_for("document.querySelectorAll('#compare-table tr.diff-row').length > 0")

    rows = diff_rows(page)
    early, late = rows["early_work"], rows["late_work"]
    assert early["direction"] == "decreased" and early["delta"] == -100.0
    assert early["cells"][4] == "▼ −100.00 pp (gone)"
    assert early["cells"][2] == "0.60 CPU s · 100.00%" and early["cells"][3] == "0.00 CPU s · 0.00%"
    assert late["direction"] == "increased" and late["delta"] == 100.0
    assert late["cells"][4] == "▲ +100.00 pp (new)"
    assert late["cells"][3] == "1.50 CPU s · 100.00%"
    assert list(rows)[:2] == ["early_work", "late_work"]  # the biggest changes first
    totals = page.evaluate(
        "['a-total', 'b-total'].map(id => [document.getElementById(id).dataset.samples,"
        " document.querySelector('#' + id + ' .side-cpu').textContent])"
    )
    assert totals == [["60", "0.60 CPU s"], ["150", "1.50 CPU s"]]
    assert page.evaluate("document.getElementById('range').value") == "15m"
    assert page.evaluate("document.getElementById('total').textContent").startswith("210 samples")
    # A and B stay marked on the chart, A over the early steps and B over the late ones.
    bands = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#chart .chart-band')].map(b =>"
        " [b.classList.contains('a') ? 'a' : 'b', [Number(b.dataset.from), Number(b.dataset.until)]]))"
    )
    assert bands == {
        "a": [time_split.early[0], time_split.early[-1] + 9],
        "b": [time_split.late[0], time_split.late[-1] + 9],
    }
    # The diff flame graph below it says the same.
    page.wait_for(
        "(() => { const d = document.getElementById('compare-svg').contentDocument;"
        " return d && d.querySelectorAll('#frames title').length > 0; })()"
    )
    titles = page.evaluate(
        "[...document.getElementById('compare-svg').contentDocument.querySelectorAll('#frames title')]"
        ".map(t => t.textContent)"
    )
    assert any(t.startswith("late_work") and "Δ +100.00 pp" in t for t in titles)
    assert any(t.startswith("early_work") and "Δ -100.00 pp" in t for t in titles)
    assert page.errors() == []
    page.screenshot(Path("/tmp/fleetprof-web-ui-compare.png"))  # for a person to look at

    # The URL holds both sides: opened elsewhere, it shows the same comparison.
    params = hash_params(page)
    assert [unix(params[k]) for k in ("a_from", "a_until", "b_from", "b_until")] == [
        time_split.early[0], time_split.early[-1] + 9, time_split.late[0], time_split.late[-1] + 9,
    ]  # fmt: skip
    shared = browser.new_page()
    try:
        shared.goto(page.evaluate("location.href"))
        shared.wait_for("document.querySelectorAll('#compare-table tr.diff-row').length > 0")
        again = diff_rows(shared)
        assert again["early_work"]["delta"] == -100.0 and again["late_work"]["delta"] == 100.0
        assert shared.errors() == []
    finally:
        shared.close()


def test_comparing_two_selectors_over_one_range_and_a_bad_side_named_by_the_collector(
    page: Page, time_split: TimeSplit
) -> None:
    open_chart(page, time_split)
    open_compare(page)
    # Both sides start as the page's selector and range.
    fields = "['a-query', 'a-from', 'a-until', 'b-query', 'b-from', 'b-until']"
    assert (
        page.evaluate(f"{fields}.map(id => document.getElementById(id).value)")
        == ["{}", "now-15m", "now"] * 2
    )
    # A side the collector refuses gets its reason beside the button; the flame graph above is still right,
    # so the page's error box stays closed.
    page.type_into("#b-query", '{pod=~"("}')
    page.click("#compare-run")
    page.wait_for("document.getElementById('compare-status').classList.contains('failed')")
    status = page.evaluate("document.getElementById('compare-status').textContent")
    assert 'bad "query2"' in status and "HTTP 400" in status
    assert page.evaluate("document.getElementById('error').hidden") is True

    page.type_into("#a-query", '{pod="trainer-0"}')
    page.type_into("#b-query", '{pod="trainer-1"}')
    page.click("#compare-run")
    page.wait_for("document.querySelectorAll('#compare-table tr.diff-row').length > 0")
    rows = diff_rows(page)
    assert rows["early_work"]["direction"] == "decreased" and rows["early_work"]["delta"] == -100.0
    assert rows["late_work"]["direction"] == "increased" and rows["late_work"]["delta"] == 100.0
    queries = page.evaluate(
        "['a-total', 'b-total'].map(id => document.querySelector('#' + id + ' .side-query').textContent)"
    )
    assert queries == ['{pod="trainer-0"}', '{pod="trainer-1"}']
    assert page.evaluate("document.querySelector('#b-total .side-cpu').textContent") == "1.50 CPU s"
    assert page.errors(include_network=False) == []


# ---- profile types: the Type switch between CPU samples, off-CPU time and wall time -------------------

TYPE_HZ = 100  # 10 ms per sample: burn's 30 samples are 0.3 s of CPU
MS = 1_000_000  # nanoseconds


def typed_batch(pods: dict[str, tuple[int, str, int]]) -> pb.Batch:
    """One batch ending now; pods: pod -> (samples, function, blocked_ms): `burn` on CPU for `samples`
    samples, and `function` switched out (off-CPU) for `blocked_ms`, both called from main;serve."""
    b = BatchBuilder(node="node-a", frequency_hz=TYPE_HZ)
    for pid, (pod, (samples, waits_in, blocked_ms)) in enumerate(pods.items(), start=10):
        proc = b.process(pid, "app", {"namespace": "shop", "pod": pod})
        b.sample(proc, b.stack([("main", "/app/app"), ("serve", "/app/app"), ("burn", "/app/app")]), samples)
        waits = b.stack([("main", "/app/app"), ("serve", "/app/app"), (waits_in, "/app/app")])
        b.offcpu(proc, waits, blocked_ms * MS)
    return b.build()


@pytest.fixture(scope="module")
def typed() -> Iterator[RunningCollector]:
    """A collector of its own holding web-1: burn 30 CPU samples at 100 Hz (0.3 s), wait_io 2 s off-CPU.
    Wall time is 2.3 s, 87% of it in wait_io."""
    col = start_collector()
    try:
        running = RunningCollector(col)
        assert push(running.grpc_target, [typed_batch({"web-1": (30, "wait_io", 2000)})]) == [1]
        yield running
    finally:
        col.stop()


def top_rows(page: Page) -> dict[str, list[str]]:
    """The top table's cells as a person reads them, by function."""
    rows = page.evaluate(
        "[...document.querySelectorAll('#top-table tbody tr.top-row')]"
        ".map(r => [r.dataset.name, [...r.cells].map(c => c.textContent)])"
    )
    return dict(rows)


def text_of(page: Page, element_id: str) -> str:
    return page.evaluate(f"document.getElementById('{element_id}').textContent")


def pick_type(page: Page, kind: str, total: str) -> None:
    """Click the Type switch's `kind` button, then wait for the page's total line to read `total`: the
    flame graph, top table and chart are drawn from the same answers in the same step."""
    page.click(f'#type-switch input[value="{kind}"] + span')
    page.wait_for(f"document.getElementById('total').textContent === {total!r}")


def hover(page: Page, css: str) -> str:
    """Move the mouse to the middle of the element and return the tooltip it brings up."""
    x, y = page.evaluate(
        f"(() => {{ const r = document.querySelector({css!r}).getBoundingClientRect();"
        " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
    )
    page.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
    return page.wait_for(
        "!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent"
    )


def test_type_switch_shows_cpu_samples_then_off_cpu_and_wall_time_in_seconds(
    page: Page, typed: RunningCollector
) -> None:
    open_ui(page, typed)
    # CPU, the default: the CPU view as before, with burn only and in samples.
    assert page.evaluate("document.querySelector('#type-switch input:checked').value") == "cpu"
    names = set(frame_names(page))
    assert "burn" in names and "wait_io" not in names
    assert text_of(page, "total") == "30 samples (0.3 s at 100 Hz)"
    assert top_rows(page)["burn"][2:4] == ["30", "100.00%"]

    # Off-CPU: only the time threads spent switched out, in seconds.
    pick_type(page, "offcpu", "2.00 s off-CPU")
    names = set(frame_names(page))
    assert "wait_io" in names and "burn" not in names
    rows = top_rows(page)
    # Ranked by where threads blocked (these stacks have no kernel frames: the reason is unknown) ...
    assert rows["wait_io"][2:] == ["unknown", "2.00 s", "100.00%"] and "burn" not in rows
    # ... and by frame, self and total.
    page.click("#top-by-frame")
    page.wait_for("document.getElementById('top-title').textContent === 'Top functions'")
    rows = top_rows(page)
    assert "burn" not in rows
    assert rows["wait_io"][2:] == ["2.00 s", "100.00%", "2.00 s", "100.00%"]
    assert rows["serve"][2:] == ["0.00 s", "0.00%", "2.00 s", "100.00%"]
    tip = hover(page, '#flamegraph .frame[data-name="wait_io"]')
    assert tip.splitlines()[0] == "wait_io"
    assert "off-CPU time: 2.00 s (100.00%)" in tip and "samples" not in tip

    # Wall: both, on one scale: wait_io 2 s of 2.3 s, burn 0.3 s (30 samples x 10 ms).
    pick_type(page, "wall", "2.30 s wall")
    assert {"burn", "wait_io"} <= set(frame_names(page))
    rows = top_rows(page)
    assert rows["wait_io"][2:4] == ["2.00 s", "86.96%"]
    assert rows["burn"][2:4] == ["0.30 s", "13.04%"]
    widths = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#flamegraph .frame')]"
        ".map(f => [f.dataset.name, f.getBoundingClientRect().width]))"
    )
    assert widths["wait_io"] / widths["serve"] == pytest.approx(2 / 2.3, abs=0.01)
    tip = hover(page, '#flamegraph .frame[data-name="burn"]')
    assert "wall time: 0.30 s (13.04%)" in tip
    page.screenshot(Path("/tmp/fleetprof-web-ui-wall.png"))  # for a person to look at

    # And back: the CPU view exactly as it was.
    pick_type(page, "cpu", "30 samples (0.3 s at 100 Hz)")
    assert "wait_io" not in frame_names(page)
    assert top_rows(page)["burn"][2:4] == ["30", "100.00%"]
    assert page.errors() == []


def test_the_type_is_kept_in_the_url_and_a_reload_restores_it(
    page: Page, browser: Chromium, typed: RunningCollector
) -> None:
    open_ui(page, typed)
    assert hash_params(page)["type"] == "cpu"
    pick_type(page, "offcpu", "2.00 s off-CPU")
    assert hash_params(page)["type"] == "offcpu"

    shared = browser.new_page()
    try:
        shared.goto(page.evaluate("location.href"))
        shared.wait_for("document.getElementById('total').textContent === '2.00 s off-CPU'")
        assert shared.evaluate("document.querySelector('#type-switch input:checked').value") == "offcpu"
        assert "wait_io" in frame_names(shared) and "burn" not in frame_names(shared)
        assert text_of(shared, "chart-title") == "Off-CPU over time"
        assert shared.errors() == []
    finally:
        shared.close()


def test_the_chart_follows_the_type(page: Page, typed: RunningCollector) -> None:
    def bar() -> tuple[float, str, str, str]:
        """The chart's one bar (its value), its top axis label, caption and title."""
        page.wait_for("document.querySelectorAll('#chart .bar').length === 1")
        bars = chart_bars(page)
        (only,) = bars.values()
        top = page.evaluate("document.querySelector('#chart .chart-ylabel').textContent")
        return only["samples"], top, text_of(page, "chart-unit"), text_of(page, "chart-title")

    open_ui(page, typed)
    assert bar() == (30, "0.3 s", "CPU seconds per 10 s step", "CPU over time")
    pick_type(page, "offcpu", "2.00 s off-CPU")
    assert bar() == (2000 * MS, "2 s", "off-CPU seconds per 10 s step", "Off-CPU over time")
    tip = hover(page, "#chart .bar")
    assert "2.00 s off-CPU" in tip and "0.200 threads off-CPU on average" in tip
    pick_type(page, "wall", "2.30 s wall")
    assert bar() == (2300 * MS, "2.5 s", "wall seconds per 10 s step", "Wall time over time")
    assert page.errors() == []


def test_comparing_two_pods_counts_in_the_type_picked(page: Page, collector: RunningCollector) -> None:
    """web-1 waits in wait_io 2 s, web-2 in wait_lock 0.5 s; both burn 30 samples of CPU."""
    pods = {"web-1": (30, "wait_io", 2000), "web-2": (30, "wait_lock", 500)}
    assert push(collector.grpc_target, [typed_batch(pods)]) == [1]
    open_ui(page, collector)
    pick_type(page, "offcpu", "2.50 s off-CPU")
    open_compare(page)
    page.type_into("#a-query", '{pod="web-1"}')
    page.type_into("#b-query", '{pod="web-2"}')
    page.click("#compare-run")
    page.wait_for("document.querySelectorAll('#compare-table tr.diff-row').length > 0")

    rows = diff_rows(page)
    assert set(rows) == {"wait_io", "wait_lock"}  # burn is CPU time: none of it here
    assert rows["wait_io"]["cells"][2:5] == ["2.00 s · 100.00%", "0.00 s · 0.00%", "▼ −100.00 pp (gone)"]
    assert rows["wait_lock"]["cells"][2:5] == ["0.00 s · 0.00%", "0.50 s · 100.00%", "▲ +100.00 pp (new)"]
    totals = page.evaluate(
        "['a-total', 'b-total'].map(id => document.querySelector('#' + id + ' .side-cpu').textContent)"
    )
    assert totals == ["2.00 s off-CPU", "0.50 s off-CPU"]
    assert text_of(page, "compare-measure") == "off-CPU time"
    svg = parse_qs(page.evaluate("document.getElementById('compare-svg').src").split("?", 1)[1])
    assert svg["type"] == ["offcpu"]

    # Switching the type redoes the comparison: in CPU samples both pods only burn, alike.
    pick_type(page, "cpu", "60 samples (0.6 s at 100 Hz)")
    page.wait_for(
        "document.getElementById('compare-measure').textContent === 'CPU time'"
        " && document.querySelectorAll('#compare-table tr.diff-row').length > 0"
    )
    rows = diff_rows(page)
    assert set(rows) == {"burn"}
    assert rows["burn"]["cells"][2:5] == ["0.30 CPU s · 100.00%", "0.30 CPU s · 100.00%", "= 0.00 pp"]
    assert hash_params(page)["type"] == "cpu"
    assert page.errors() == []


def test_a_type_without_data_says_so_in_its_own_unit(page: Page, profiled: RunningCollector) -> None:
    """PROFILE holds CPU samples only: opened on Off-CPU from a link, every part of the page says there is
    no off-CPU time rather than showing empty CPU views."""
    page.goto(profiled.url + "/#type=offcpu")
    page.wait_for("document.getElementById('total').textContent === '0.00 s off-CPU'")
    empty = page.evaluate(
        "['#flamegraph .empty', '#top-table td.empty', '#chart .chart-empty']"
        ".map(css => document.querySelector(css).textContent)"
    )
    assert empty == ["no off-CPU time in this range"] * 3
    assert text_of(page, "chart-unit") == "off-CPU seconds per 10 s step"
    assert page.errors() == []


@pytest.fixture(scope="module")
def cuda() -> Iterator[RunningCollector]:
    """A collector of its own holding trainer-0's launches and GPU kernel time
    (tests/collector/test_cuda_collector.py) and 4 CPU samples."""
    from tests.collector.test_cuda_collector import trainer_batch

    col = start_collector()
    try:
        running = RunningCollector(col)
        assert push(running.grpc_target, [trainer_batch()]) == [1]
        yield running
    finally:
        col.stop()


def test_type_switch_shows_gpu_kernel_time_and_cuda_launches(page: Page, cuda: RunningCollector) -> None:
    """The GPU type in seconds of kernel time and the Launches type in launches, each with the kernels as
    the flame graph's leaves; the choice is in the link."""
    from tests.collector.test_cuda_collector import GEMM, RELU

    open_ui(page, cuda)
    pick_type(page, "gpu", "0.68 s GPU kernel")  # 675 ms
    assert {GEMM, RELU} <= set(frame_names(page))
    assert top_rows(page)[GEMM][2:4] == ["0.60 s", "88.89%"]
    assert hash_params(page)["type"] == "gpu"
    pick_type(page, "cuda_launch", "6300 launches")
    assert {GEMM, RELU, "noop"} <= set(frame_names(page))
    assert top_rows(page)["noop"][2:4] == ["5000", "79.37%"]
    assert text_of(page, "chart-unit").startswith("launches per ")
