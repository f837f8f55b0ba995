"""A self-contained interactive flame graph SVG (zoom, search, tooltips) from merged stacks: frames drawn
here, root on top, and app.flame.js (the web UI's flame-graph script) inlined to zoom and search them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import OTHER, Node, build_tree, by_name
from fleetprof.collector.render.webflame import flame_script, frame_colour, look

FRAME_H = 16  # px per stack level; rects are one px shorter so levels stay visually apart
PAD = 10
FONT_PX = 11
# Width of one monospace character at FONT_PX; labels are cut to fit by counting characters, which is
# only honest with a monospace font (the style below asks for one).
CHAR_W = 6.7
LABEL_INSET = 3
HIDDEN = ' class="hid"'
BOTTOM = 24  # px under the frames: the line that says deeper frames are hidden

# XML 1.0 forbids most control characters and lone surrogates (which surrogateescape-decoded symbol names
# can contain); either would make the whole file unparsable, so they become U+FFFD.
_XML_INVALID = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text: str) -> str:
    text = _XML_INVALID.sub("\ufffd", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def fit_label(name: str, width_px: float) -> str:
    """The name cut to fit width_px, ending in ".." when cut; empty when fewer than 3 characters fit."""
    room = int((width_px - 2 * LABEL_INSET) / CHAR_W)
    if room < 3:
        return ""
    if len(name) <= room:
        return name
    return name[: room - 2] + ".."


def _tooltip(node: Node, total: int, unit: str, frequency_hz: int | None) -> str:
    module = node.module or ("kernel" if node.kernel else "")
    head = f"{node.display} ({module})" if module else node.display
    text = f"{head} — {node.total} {unit}, {100.0 * node.total / total:.2f}%"
    if frequency_hz:
        text += f", {node.total / frequency_hz:.2f} s"
    return text


def _layout(root: Node, avail: float, min_width_px: float) -> list[tuple[Node, int, float, float]]:
    """(node, depth, x, width) in preorder, dropping nodes narrower than min_width_px with their subtrees."""
    out = []
    scale = avail / root.total
    pending = [(root, 0, float(PAD))]
    while pending:
        node, depth, x = pending.pop()
        out.append((node, depth, x, node.total * scale))
        # Children by name, not weight, as in classic flame graphs: a function keeps its place between
        # two profiles of the same program, which makes them comparable by eye.
        children = sorted(node.children.values(), key=by_name)
        placed = []
        cx = x
        for child in children:
            width = child.total * scale
            if width >= min_width_px:
                placed.append((child, depth + 1, cx))
            cx += width
        pending.extend(reversed(placed))
    return out


_STYLE = """
text{font-family:monospace;font-size:11px;fill:#000}
#title{font-size:16px;font-weight:bold;text-anchor:middle}
#subtitle{fill:#555;text-anchor:middle}
#frames g{cursor:pointer}
#frames g:hover rect{stroke:#000;stroke-width:.6}
#frames text{pointer-events:none}
#frames .anc{opacity:.55}
.hid{display:none}
.ctl{cursor:pointer;fill:#1f4e9c}
.ctl:hover{text-decoration:underline}
"""


def render_svg(
    stacks: Stacks,
    title: str = "CPU flame graph",
    subtitle: str = "",
    unit: str = "samples",
    frequency_hz: int | None = None,
    width: int = 1200,
    min_width_px: float = 0.1,
    names: Names = as_stored,
) -> str:
    """An interactive flame graph, root on top, as one SVG document."""
    tree = build_tree(stacks, names=names)
    plain = look()["plain"]

    def fill(node: Node, depth: int) -> str:
        return plain if depth == 0 or node.key == OTHER else frame_colour(node.display, node.kernel)

    return render_tree_svg(
        tree,
        fill=fill,
        tooltip=lambda node: _tooltip(node, tree.total, unit, frequency_hz),
        title=title,
        subtitle=subtitle,
        width=width,
        min_width_px=min_width_px,
    )


def frames_in_view(laid: list[tuple[Node, int, float, float]], total: int) -> int:
    """Levels the drawing opens with: down to the deepest frame holding at least LOOK's deep_share of the
    samples (app.flame.js sizes every flame graph by the same rule, and again on each zoom)."""
    enough = look()["deep_share"] * total
    return 1 + max((depth for node, depth, _, _ in laid if node.total >= enough), default=0)


def render_tree_svg(
    tree: Node,
    fill: Callable[[Node, int], str],
    tooltip: Callable[[Node], str],
    title: str,
    subtitle: str = "",
    width: int = 1200,
    min_width_px: float = 0.1,
) -> str:
    """The SVG for any call tree whose nodes are sized by `total`; fill(node, depth) and tooltip(node)
    give each frame's colour and hover text (the diff flame graph brings its own). Frames are labelled
    with their shown (demangled) names.

    The frames are drawn here, so the file shows without scripts (an <img>, a viewer); app.flame.js,
    inlined, zooms and searches them. Frames below the levels in view are drawn hidden: zooming into
    their ancestors shows them."""
    if width < 4 * PAD:
        raise ValueError(f"width {width}px is too small for a flame graph")
    avail = width - 2 * PAD
    # Title, subtitle, then a line for the hovered frame's details and the search's match.
    details_y = 62 if subtitle else 44
    top = details_y + 8
    laid = _layout(tree, avail, min_width_px) if tree.total else []
    rows = frames_in_view(laid, tree.total) if laid else 2
    deeper = any(depth >= rows for _, depth, _, _ in laid)
    frames_bottom = top + rows * FRAME_H
    height = frames_bottom + BOTTOM

    parts = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n',
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n',
        f"<style>{_STYLE}</style>\n",
        f'<rect id="background" x="0" y="0" width="{width}" height="{height}" fill="#f8f8f4"/>\n',
        f'<text id="title" x="{width / 2:g}" y="24">{_xml(title)}</text>\n',
    ]
    if subtitle:
        parts.append(f'<text id="subtitle" x="{width / 2:g}" y="42">{_xml(subtitle)}</text>\n')
    parts.append(f'<text id="reset" class="ctl hid" x="{PAD}" y="24">Reset zoom</text>\n')
    parts.append(f'<text id="search" class="ctl" x="{width - PAD}" y="24" text-anchor="end">Search</text>\n')
    parts.append(f'<text id="details" x="{PAD}" y="{details_y}"> </text>\n')
    parts.append(f'<text id="matched" x="{width - PAD}" y="{details_y}" text-anchor="end"></text>\n')
    parts.append('<g id="frames">\n')
    for node, depth, x, w in laid:
        y = top + depth * FRAME_H
        shown = node.display
        label = fit_label(shown, w)
        hidden = HIDDEN if depth >= rows else ""
        full_name = "" if label == shown else f' data-n="{_xml(shown)}"'
        text = (
            f'<text x="{_num(x + LABEL_INSET)}" y="{y + FRAME_H - 5}">{_xml(label)}</text>' if label else ""
        )
        parts.append(
            f'<g{hidden}{full_name} data-v="{node.total}"><title>{_xml(tooltip(node))}</title>'
            f'<rect x="{_num(x)}" y="{y}" width="{_num(w)}" height="{FRAME_H - 1}" '
            f'fill="{fill(node, depth)}"/>'
            f"{text}</g>\n"
        )
    parts.append("</g>\n")
    if not laid:
        parts.append(f'<text x="{width / 2:g}" y="{top + FRAME_H}" text-anchor="middle">no samples</text>\n')
    share = f"{100 * look()['deep_share']:g}%"
    parts.append(
        f'<text id="deeper" class="ctl{"" if deeper else " hid"}" x="{PAD}" y="{frames_bottom + 16}">'
        f"deeper frames hold under {share} each: click here to show them, or click a frame to zoom</text>\n"
    )
    config = {
        "width": width,
        "avail": avail,
        "pad": PAD,
        "top": top,
        "bottom": BOTTOM,
        "fh": FRAME_H,
        "cw": CHAR_W,
        "inset": LABEL_INSET,
    }
    # CDATA keeps the script's '<' and '&' literal; webflame checks the script holds no "]]>", and the
    # JSON config cannot.
    parts.append(
        f"<script><![CDATA[\n{flame_script()}\nFleetprofFlame.svgDocument({json.dumps(config)});\n]]></script>\n"
    )
    parts.append("</svg>\n")
    return "".join(parts)
