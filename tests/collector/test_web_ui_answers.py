"""The web UI in real headless Chromium, fed over real gRPC: a Python function is one row of the top table
and of the comparison (its lines with "Python lines apart"), a click on its row highlights each of its lines
in the flame graph, and the collector's warnings (a label no series has, a selector that matched nothing)
are shown."""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import parse_qs, urlencode

import pytest

from tests.conftest import RunningCollector, start_collector
from tests.support.browser import CHROMIUM, Page
from tests.support.profiles import Row, push_profile

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

PY = "/srv/hot.py"
PYTHON = "/usr/bin/python3.11"
# checksum_rows: lines 7 (31) and 6 (9) in api-0; parse_rows line 12 (20) in api-0, 50 in api-1; emit 50
# in api-1. So checksum_rows's share changes most (66.67% of A, none of B; parse_rows 33.33% -> 50%).
ROWS: list[Row] = [
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("run (hot.py:20)", PY), ("checksum_rows (hot.py:7)", PY)], 3, 31),
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("run (hot.py:20)", PY), ("checksum_rows (hot.py:6)", PY)], 3, 9),
    (300, "python3", {"namespace": "shop", "pod": "api-0"},
     [("main", PYTHON), ("run (hot.py:21)", PY), ("parse_rows (hot.py:12)", PY)], 3, 20),
    (301, "python3", {"namespace": "shop", "pod": "api-1"},
     [("main", PYTHON), ("run (hot.py:21)", PY), ("parse_rows (hot.py:12)", PY)], 3, 50),
    (301, "python3", {"namespace": "shop", "pod": "api-1"},
     [("main", PYTHON), ("run (hot.py:22)", PY), ("emit (hot.py:30)", PY)], 3, 50),
]  # fmt: skip


@pytest.fixture(scope="module")
def fed() -> Iterator[RunningCollector]:
    col = start_collector()
    try:
        running = RunningCollector(col)
        push_profile(running.grpc_target, ROWS)
        yield running
    finally:
        col.stop()


TOP_NAMES = "[...document.querySelectorAll('#top-table tr.top-row')].map(r => r.dataset.name)"
DIFF_NAMES = "[...document.querySelectorAll('#compare-table tr.diff-row')].map(r => r.dataset.name)"


def top_cells(page: Page, name: str) -> list[str]:
    return page.evaluate(
        "[...[...document.querySelectorAll('#top-table tr.top-row')]"
        f".find(r => r.dataset.name === {name!r}).cells].map(c => c.textContent)"
    )


def test_a_python_function_is_one_row_until_lines_are_asked_for(page: Page, fed: RunningCollector) -> None:
    page.goto(fed.url + "/#" + urlencode({"query": '{pod="api-0"}'}))
    page.wait_for(f"{TOP_NAMES}.includes('checksum_rows (hot.py)')")
    # 31 + 9 of api-0's 60 samples.
    assert top_cells(page, "checksum_rows (hot.py)")[2:4] == ["40", "66.67%"]
    assert not any(":" in name for name in page.evaluate(TOP_NAMES) if "hot.py" in name)
    # The flame graph keeps lines: a click on the row lights both of them, and nothing else.
    frames = "[...document.querySelectorAll('#flamegraph .frame')].map(f => f.dataset.name)"
    assert {"checksum_rows (hot.py:7)", "checksum_rows (hot.py:6)"} <= set(page.evaluate(frames))
    page.click("#top-table tr.top-row[data-name='checksum_rows (hot.py)'] td")
    page.wait_for("document.getElementById('search-status').textContent !== ''")
    assert page.evaluate("document.getElementById('search-status').textContent") == "matched: 66.67%"

    page.click("#top-lines")
    page.wait_for(f"{TOP_NAMES}.includes('checksum_rows (hot.py:7)')")
    assert top_cells(page, "checksum_rows (hot.py:7)")[2:4] == ["31", "51.67%"]
    assert top_cells(page, "checksum_rows (hot.py:6)")[2:4] == ["9", "15.00%"]
    assert "checksum_rows (hot.py)" not in page.evaluate(TOP_NAMES)
    assert parse_qs(page.evaluate("location.hash").lstrip("#"))["lines"] == ["1"]
    page.reload()
    page.wait_for(f"{TOP_NAMES}.includes('checksum_rows (hot.py:7)')")
    assert page.evaluate("document.getElementById('top-lines').checked") is True
    assert page.errors() == []


def test_the_comparison_ranks_functions_and_lines_on_request(page: Page, fed: RunningCollector) -> None:
    page.goto(fed.url + "/")
    page.wait_for("document.querySelectorAll('#flamegraph .frame').length > 0")
    page.click("#compare-toggle")
    page.wait_for("!document.getElementById('compare-section').hidden")
    page.type_into("#a-query", '{pod="api-0"}')
    page.type_into("#b-query", '{pod="api-1"}')
    page.click("#compare-run")
    page.wait_for(f"{DIFF_NAMES}.length > 0")
    assert page.evaluate(DIFF_NAMES)[0] == "checksum_rows (hot.py)"  # 66.67% of A, none of B
    page.click("#compare-lines")
    page.wait_for(f"{DIFF_NAMES}.includes('checksum_rows (hot.py:7)')")
    assert "checksum_rows (hot.py)" not in page.evaluate(DIFF_NAMES)
    assert page.errors() == []


def test_warnings_name_a_missing_label_and_an_empty_selector(page: Page, fed: RunningCollector) -> None:
    page.goto(fed.url + "/#" + urlencode({"query": '{nosuch="x"}'}))
    page.wait_for("!document.getElementById('warnings').hidden")
    warnings = page.evaluate("document.getElementById('warnings').textContent").split("\n")
    assert warnings == [
        'no series in this range has the label "nosuch"; the labels in this range: comm, namespace, node,'
        " pid, pod",
        'the selector {nosuch="x"} matched nothing in this range, which holds other data',
    ]
    empty = page.evaluate("document.querySelector('#top-table td.empty').textContent")
    assert empty == "the selector matched nothing in this range (it holds other data)"
    # A selector that matches: the warnings go.
    page.type_into("#selector", '{pod="api-1"}')
    page.click("#refresh")
    page.wait_for("document.getElementById('warnings').hidden")
    assert page.evaluate("getComputedStyle(document.getElementById('warnings')).display") == "none"
    assert page.errors() == []
