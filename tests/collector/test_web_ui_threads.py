"""The web UI's threads switch in real headless Chromium: wall and off-CPU views count active threads or
all of them (the API's `threads`), each type opening on its own default, with a line on what each counts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import parse_qs, urlencode

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.conftest import RunningCollector, start_collector
from tests.support.browser import CHROMIUM, Chromium, Page
from tests.support.wire import BatchBuilder, push

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

HZ = 100  # 10 ms per sample
MS = 1_000_000  # nanoseconds
APP = "/app/app"


def batch() -> pb.Batch:
    """web-1: burn 30 CPU samples (0.3 s), wait_io 2 s off-CPU in an active thread, and a pool idle in
    pool_wait for 6 s; web-2: wait_lock 0.5 s active, pool_wait 1 s idle. Wall of web-1 is 2.3 s counting
    active threads and 8.3 s counting all; its off-CPU 2 s and 8 s."""
    b = BatchBuilder(node="node-a", frequency_hz=HZ)
    pods = ((10, "web-1", "wait_io", 2000, 6000), (11, "web-2", "wait_lock", 500, 1000))
    for pid, pod, waits_in, active_ms, idle_ms in pods:
        proc = b.process(pid, "app", {"namespace": "shop", "pod": pod})
        if pod == "web-1":
            b.sample(proc, b.stack([("main", APP), ("serve", APP), ("burn", APP)]), 30)
        b.offcpu(proc, b.stack([("main", APP), ("serve", APP), (waits_in, APP)]), active_ms * MS)
        b.offcpu(proc, b.stack([("main", APP), ("pool", APP), ("pool_wait", APP)]), idle_ms * MS, idle=True)
    return b.build()


@pytest.fixture(scope="module")
def pools() -> Iterator[RunningCollector]:
    col = start_collector()
    try:
        running = RunningCollector(col)
        assert push(running.grpc_target, [batch()]) == [1]
        yield running
    finally:
        col.stop()


def frame_names(page: Page) -> set[str]:
    return set(page.evaluate("[...document.querySelectorAll('#flamegraph .frame')].map(f => f.dataset.name)"))


def text_of(page: Page, element_id: str) -> str:
    return page.evaluate(f"document.getElementById('{element_id}').textContent")


def shown(page: Page, element_id: str) -> bool:
    return page.evaluate(f"getComputedStyle(document.getElementById('{element_id}')).display") != "none"


def threads(page: Page) -> str | None:
    return page.evaluate("(document.querySelector('#threads-switch input:checked') || {}).value || null")


def hash_params(page: Page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(page.evaluate("location.hash").lstrip("#")).items()}


def pick(page: Page, switch: str, value: str, total: str) -> None:
    """Click a segment of the Type or Threads switch and wait for the page's total to read `total`."""
    page.click(f'#{switch}-switch input[value="{value}"] + span')
    page.wait_for(f"document.getElementById('total').textContent === {total!r}")


# What the chart's bars add up to (nanoseconds for wall and off-CPU).
CHART_TOTAL = (
    "[...document.querySelectorAll('#chart .bar')].reduce((s, b) => s + Number(b.dataset.samples), 0)"
)


def test_wall_and_off_cpu_count_active_or_all_threads_as_the_switch_says(
    page: Page, pools: RunningCollector
) -> None:
    page.goto(pools.url + "/#" + urlencode({"query": '{pod="web-1"}'}))
    page.wait_for("document.getElementById('total').textContent === '30 samples (0.3 s at 100 Hz)'")
    # CPU samples are every running thread's: no switch, no note.
    assert not shown(page, "threads-field") and not shown(page, "type-note")

    # Wall opens on active threads: the idle pool is left out, and the note says so.
    pick(page, "type", "wall", "2.30 s wall")
    assert shown(page, "threads-field") and threads(page) == "active"
    assert text_of(page, "type-note").startswith("Wall counts active threads only") and shown(
        page, "type-note"
    )
    assert "pool_wait" not in frame_names(page) and "wait_io" in frame_names(page)
    assert hash_params(page)["threads"] == "active"
    page.wait_for(f"{CHART_TOTAL} === {2300 * MS}")

    # All threads: the pool's 6 s join in, in the graph, the table and the chart.
    pick(page, "threads", "all", "8.30 s wall")
    assert "pool_wait" in frame_names(page)
    top = page.evaluate("[...document.querySelectorAll('#top-table tr.top-row')].map(r => r.dataset.name)")
    assert top[0] == "pool_wait"
    page.wait_for(f"{CHART_TOTAL} === {8300 * MS}")
    assert hash_params(page)["threads"] == "all"
    assert text_of(page, "type-note").startswith("Wall of every thread")

    # Off-CPU opens on its own default, all threads; Active leaves the pool out.
    pick(page, "type", "offcpu", "8.00 s off-CPU")
    assert threads(page) == "all" and text_of(page, "type-note").startswith("Off-CPU counts every thread")
    pick(page, "threads", "active", "2.00 s off-CPU")
    assert "pool_wait" not in frame_names(page)
    assert text_of(page, "type-note").startswith("Off-CPU of active threads only")

    # Back to CPU: the switch goes, and the URL stops carrying it.
    pick(page, "type", "cpu", "30 samples (0.3 s at 100 Hz)")
    assert not shown(page, "threads-field") and "threads" not in hash_params(page)
    assert page.errors() == []


def test_the_threads_choice_is_kept_in_the_url_and_counts_in_the_comparison(
    page: Page, browser: Chromium, pools: RunningCollector
) -> None:
    page.goto(pools.url + "/#type=offcpu&threads=active")
    page.wait_for("document.getElementById('total').textContent === '2.50 s off-CPU'")
    assert threads(page) == "active"

    page.click("#compare-toggle")
    page.wait_for("!document.getElementById('compare-section').hidden")
    page.type_into("#a-query", '{pod="web-1"}')
    page.type_into("#b-query", '{pod="web-2"}')
    page.click("#compare-run")
    page.wait_for("document.querySelectorAll('#compare-table tr.diff-row').length > 0")
    rows = page.evaluate(
        "[...document.querySelectorAll('#compare-table tr.diff-row')].map(r => r.dataset.name)"
    )
    assert set(rows) == {"wait_io", "wait_lock"}
    src = parse_qs(page.evaluate("document.getElementById('compare-svg').src").split("?", 1)[1])
    assert src["threads"] == ["active"] and src["type"] == ["offcpu"]

    # All threads: the comparison is redone with the pools in it (6 s of web-1's 8, 1 s of web-2's 1.5).
    pick(page, "threads", "all", "9.50 s off-CPU")
    page.wait_for(
        "[...document.querySelectorAll('#compare-table tr.diff-row')]"
        ".some(r => r.dataset.name === 'pool_wait')"
    )
    totals = page.evaluate(
        "['a-total', 'b-total'].map(id => document.querySelector('#' + id + ' .side-cpu').textContent)"
    )
    assert totals == ["8.00 s off-CPU", "1.50 s off-CPU"]

    shared = browser.new_page()
    try:
        shared.goto(page.evaluate("location.href"))
        shared.wait_for("document.getElementById('total').textContent === '9.50 s off-CPU'")
        assert threads(shared) == "all"
        assert shared.errors() == []
    finally:
        shared.close()
    assert page.errors() == []
