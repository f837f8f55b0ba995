"""End-to-end tests of the collector's web UI and SVG in real headless Chromium, fed over real gRPC ingest."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from .browser import CHROMIUM, Page
from .conftest import RunningCollector, start_collector
from .profiles import PROFILE, push_profile

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"needs Chromium at {CHROMIUM} (Debian package chromium)"
)

FREQUENCY_HZ = 19
# PROFILE (tests/profiles.py): hot_loop 300 samples, cold_path 60 + 40 = 100; only the server ever runs
# accept_loop and sys_read.
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
