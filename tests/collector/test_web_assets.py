"""The web UI's files: local assets only, every file in use and served, and the flame-graph script and
style in a form the renderers can inline (the UI itself in Chromium: tests/collector/test_web_ui.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetprof.collector.render import webflame
from tests.conftest import RunningCollector, http_get

WEB = Path(__file__).resolve().parent.parent.parent / "collector" / "web"
# The one URL a web file may hold: the SVG namespace app.flame.js makes elements in (a name, not a fetch).
SVG_NS = "http://www.w3.org/2000/svg"


def index_refs() -> list[str]:
    html = (WEB / "index.html").read_text()
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)


def test_index_html_uses_only_local_assets_and_has_test_ids():
    html = (WEB / "index.html").read_text()
    assert not re.search(r"https?://", html, re.I)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?//""", html, re.I)
    for ref in index_refs():
        if ref.startswith("data:"):  # inline (the empty favicon): fetches nothing
            continue
        assert not ref.startswith("/") and (WEB / ref).is_file(), ref
    for element_id in ("selector", "range", "refresh", "flamegraph", "top-table", "error", "total"):
        assert re.search(rf'\bid="{element_id}"', html), element_id
    assert 'value="{}"' in html
    assert "{namespace=&quot;ml&quot;, pod=~&quot;trainer-.*&quot;}" in html


def test_web_assets_fetch_nothing_external():
    for path in sorted(WEB.iterdir()):
        text = path.read_text().replace(SVG_NS, "")
        assert not re.search(r"https?://", text), path.name
        if path.suffix == ".css":
            assert "@import" not in text and "url(" not in text, path.name
        assert "fetch(" not in text or path.name == "app.api.js", path.name  # one way to the collector


def test_every_web_file_is_loaded_by_the_page_and_each_script_loads_before_its_users():
    refs = [ref for ref in index_refs() if not ref.startswith("data:")]
    assert sorted(refs) == sorted(p.name for p in WEB.iterdir() if p.name != "index.html")
    scripts = [ref for ref in refs if ref.endswith(".js")]
    assert scripts[-1] == "app.js"  # the page, which wires the parts, runs last
    # Each part is one global (window.FleetprofX); a script may use only those defined before it at
    # load time, which it does inside its own IIFE's body: uses are checked against the order.
    defined: dict[str, int] = {}
    for i, name in enumerate(scripts):
        for g in re.findall(r"window\.(Fleetprof\w+)\s*=", (WEB / name).read_text()):
            defined[g] = i
    for i, name in enumerate(scripts):
        text = (WEB / name).read_text()
        for g in set(re.findall(r"\b(Fleetprof[A-Z]\w*)\.", text)):
            assert g in defined, f"{name} uses {g}, which no script defines"
            if g != "FleetprofChart":  # app.format.js calls FleetprofChart.clock only when asked, after load
                assert defined[g] <= i, f"{name} uses {g}, defined later by {scripts[defined[g]]}"


def test_the_flame_script_and_style_inline_safely_and_hold_the_palette():
    script, style = webflame.flame_script(), webflame.flame_style()
    for bad in ("</script", "<!--", "]]>"):
        assert bad not in script.lower()
    assert "</style" not in style.lower()
    look = webflame.look()
    assert set(look) >= {"user", "kernel", "plain", "match", "deep_share"}
    assert 0 < look["deep_share"] < 0.01
    for side in ("user", "kernel"):  # every channel stays a byte: base + span <= 255
        channels = zip(look[side]["base"], look[side]["span"], strict=True)
        assert all(0 <= base and base + span <= 255 for base, span in channels)


def test_a_web_file_that_cannot_be_inlined_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "app.flame.js"
    broken.write_text("const s = '</script>';\n")
    monkeypatch.setattr(webflame, "SCRIPT", broken)
    webflame.flame_script.cache_clear()
    webflame.look.cache_clear()
    try:
        with pytest.raises(webflame.WebAssetError, match="app.flame.js holds '</script'"):
            webflame.flame_script()
        with pytest.raises(webflame.WebAssetError, match="no /\\* LOOK: \\*/"):
            webflame.look()
        monkeypatch.setattr(webflame, "SCRIPT", tmp_path / "missing.js")
        with pytest.raises(webflame.WebAssetError, match="cannot read .*missing.js"):
            webflame.flame_script()
    finally:
        webflame.flame_script.cache_clear()
        webflame.look.cache_clear()


def test_the_collector_serves_every_web_file_at_both_mount_points(collector: RunningCollector) -> None:
    for path in sorted(WEB.iterdir()):
        mounts = ["/ui/"] + (["/"] if path.name != "index.html" else [])
        for mount in mounts:
            assert http_get(f"{collector.url}{mount}{path.name}") == path.read_bytes(), (mount, path.name)
    assert http_get(f"{collector.url}/") == (WEB / "index.html").read_bytes()
