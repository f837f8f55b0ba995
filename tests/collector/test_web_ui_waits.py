"""The web UI's table for off-CPU and wall time in real headless Chromium: where threads blocked in their
own code and why (read, clock_nanosleep, preempted; running for wall's CPU samples), from stacks of the
shapes the agent records (tests/collector/test_waits.py), and the frame ranking behind "By frame"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import parse_qs, urlencode

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from tests.collector.test_waits import CASES, stack
from tests.conftest import RunningCollector, start_collector
from tests.support.browser import CHROMIUM, Page
from tests.support.wire import BatchBuilder, push

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

HZ = 100  # 10 ms a sample
MS = 1_000_000
READ, NAP, TICK = CASES[0][1], CASES[1][1], CASES[11][1]  # read() on a pipe, nanosleep, the timer tick


def add_stack(b: BatchBuilder, text: str) -> int:
    frames = stack(text)
    kernel_start = next((i for i, f in enumerate(frames) if f.kernel), len(frames))
    return b.stack([(f.function, f.module) for f in frames], kernel_start)


def batch() -> pb.Batch:
    """One process: 2 s blocked reading a pipe, 1 s in nanosleep, 0.5 s preempted, and 30 CPU samples
    (0.3 s) in cap_spin."""
    b = BatchBuilder(node="node-a", frequency_hz=HZ)
    proc = b.process(30, "cap", {"namespace": "shop", "pod": "cap-1"})
    b.offcpu(proc, add_stack(b, READ), 2000 * MS)
    b.offcpu(proc, add_stack(b, NAP), 1000 * MS)
    b.offcpu(proc, add_stack(b, TICK), 500 * MS)
    b.sample(proc, add_stack(b, "start_thread<libc.so.6>;cap_spinner<cap>;cap_spin<cap>"), 30)
    return b.build()


@pytest.fixture(scope="module")
def waits() -> Iterator[RunningCollector]:
    col = start_collector()
    try:
        running = RunningCollector(col)
        assert push(running.grpc_target, [batch()]) == [1]
        yield running
    finally:
        col.stop()


def table(page: Page) -> tuple[list[str], list[list[str]]]:
    """The top table's headings and its rows' cells."""
    return page.evaluate(
        "[[...document.querySelectorAll('#top-table thead th')].map(th => th.textContent),"
        " [...document.querySelectorAll('#top-table tr.top-row')]"
        ".map(r => [...r.querySelectorAll('td')].map(td => td.textContent))]"
    )


def hash_params(page: Page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(page.evaluate("location.hash").lstrip("#")).items()}


def test_off_cpu_and_wall_tables_say_where_threads_blocked_and_why(
    page: Page, waits: RunningCollector
) -> None:
    page.goto(waits.url + "/#" + urlencode({"query": '{pod="cap-1"}', "type": "offcpu"}))
    page.wait_for("document.getElementById('total').textContent === '3.50 s off-CPU'")
    # The label chips load on their own. When they pushed the page down on arrival, a click aimed at a row
    # before them landed on the row above (a fresh-clone run waited the whole 90 s for the highlight): their
    # line's room is now kept from the start, so the table stays where it was.
    table_top = "document.getElementById('top-table').getBoundingClientRect().top + window.scrollY"
    before = page.evaluate(table_top)
    page.wait_for("document.querySelectorAll('#labels .chip').length > 0")
    assert page.evaluate(table_top) == before
    page.wait_for("document.querySelectorAll('#top-table tr.top-row').length === 3")
    head, rows = table(page)
    assert head == ["Where it blocked", "Module", "Reason", "Time", "Share"]
    assert (
        page.evaluate("document.getElementById('top-title').textContent") == "Where threads blocked, and why"
    )
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        ("cap_reader", "cap", "read", "57.14%"),
        ("cap_sleeper", "cap", "clock_nanosleep", "28.57%"),
        ("cap_spin", "cap", "preempted", "14.29%"),
    ]
    # A click highlights the function in the flame graph, as the frame ranking's rows do.
    page.click("#top-table tr.top-row[data-name='cap_reader'] td")
    page.wait_for("document.getElementById('search-status').textContent !== ''")
    assert page.evaluate("document.getElementById('search-status').textContent") == "matched: 57.14%"

    # By frame: the old ranking, every wait's leaf the scheduler; kept in the URL.
    page.click("#top-by-frame")
    page.wait_for("document.getElementById('top-title').textContent === 'Top functions'")
    head, rows = table(page)
    assert head == ["Function", "Module", "Self", "Self %", "Total", "Total %"]
    assert rows[0][0] == "__schedule" and rows[0][3] == "100.00%"
    assert hash_params(page)["rank"] == "frame"
    page.click("#top-by-frame")
    page.wait_for("document.getElementById('top-title').textContent === 'Where threads blocked, and why'")
    assert "rank" not in hash_params(page)

    # Wall: the CPU samples run where they ran; the waits as before.
    page.click('#type-switch input[value="wall"] + span')
    page.wait_for("document.getElementById('total').textContent === '3.80 s wall'")
    page.wait_for("document.querySelectorAll('#top-table tr.top-row').length === 4")
    _, rows = table(page)
    assert ("cap_spin", "running") in [(r[0], r[2]) for r in rows]

    # CPU samples rank by frame only: no switch.
    page.click('#type-switch input[value="cpu"] + span')
    page.wait_for("document.getElementById('total').textContent === '30 samples (0.3 s at 100 Hz)'")
    assert page.evaluate("document.getElementById('top-by-frame-field').hidden") is True
    head, rows = table(page)
    assert head[0] == "Function" and rows[0][0] == "cap_spin"
    assert page.errors() == []
