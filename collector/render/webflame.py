"""The web UI's flame-graph script and style (collector/web/app.flame.*), read for the renderers that inline
them (html.py, svg.py), and its palette (LOOK, defined once in app.flame.js) for frames drawn in Python."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
SCRIPT = WEB_DIR / "app.flame.js"
STYLE = WEB_DIR / "app.flame.css"
_LOOK = re.compile(r"/\* LOOK: \*/(.*?)/\* :LOOK \*/", re.S)


class WebAssetError(RuntimeError):
    """A web asset is missing or cannot be inlined as it stands (a packaging or editing mistake)."""


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise WebAssetError(f"cannot read {path}: {err} (the package is missing its web/ files)") from err


@functools.cache
def flame_script() -> str:
    """app.flame.js, checked safe to inline in an HTML <script> and in an SVG CDATA section."""
    text = _read(SCRIPT)
    for bad in ("</script", "<!--", "]]>"):
        if bad in text.lower():
            raise WebAssetError(f"{SCRIPT.name} holds {bad!r}, which would end the element it is inlined in")
    return text


@functools.cache
def flame_style() -> str:
    """app.flame.css, checked safe to inline in an HTML <style>."""
    text = _read(STYLE)
    if "</style" in text.lower():
        raise WebAssetError(f"{STYLE.name} contains '</style', which would end the element it is inlined in")
    return text


@functools.cache
def look() -> dict:
    """The palette and depth rule: the JSON object between app.flame.js's LOOK markers."""
    match = _LOOK.search(_read(SCRIPT))
    if match is None:
        raise WebAssetError(f"{SCRIPT.name} has no /* LOOK: */ ... /* :LOOK */ object")
    try:
        return json.loads(match.group(1))
    except ValueError as err:
        raise WebAssetError(f"{SCRIPT.name}'s LOOK object is not JSON: {err}") from err


def name_hash(name: str) -> int:
    """FNV-1a over code points, as app.flame.js's nameHash."""
    h = 0x811C9DC5
    for ch in name:
        h = ((h ^ ord(ch)) * 0x01000193) & 0xFFFFFFFF
    return h


def frame_colour(name: str, kernel: bool) -> str:
    """As app.flame.js's frameColour: per name, warm for user code, blue for the kernel; each channel
    base + span * byte / 255, floored, evaluated in the same order so both round alike."""
    h = name_hash(name)
    palette = look()["kernel" if kernel else "user"]
    channels = (h & 0xFF, (h >> 8) & 0xFF, (h >> 16) & 0xFF)
    rgb = (
        int(base + span * byte / 255)
        for base, span, byte in zip(palette["base"], palette["span"], channels, strict=True)
    )
    return "#{:02x}{:02x}{:02x}".format(*rgb)
