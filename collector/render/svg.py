"""A self-contained interactive flame graph SVG (zoom, search, tooltips) from merged stacks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.tree import OTHER, Node, build_tree, by_name

FRAME_H = 16  # px per stack level; rects are one px shorter so levels stay visually apart
PAD = 10
FONT_PX = 11
# Width of one monospace character at FONT_PX; labels are cut to fit by counting characters, which is
# only honest with a monospace font (the style below asks for one).
CHAR_W = 6.7
LABEL_INSET = 3

# XML 1.0 forbids most control characters and lone surrogates (which surrogateescape-decoded symbol names
# can contain); either would make the whole file unparsable, so they become U+FFFD.
_XML_INVALID = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text: str) -> str:
    text = _XML_INVALID.sub("\ufffd", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def name_hash(name: str) -> int:
    """FNV-1a over code points; collector/web/app.js computes the same, so both views colour alike."""
    h = 0x811C9DC5
    for ch in name:
        h = ((h ^ ord(ch)) * 0x01000193) & 0xFFFFFFFF
    return h


def frame_colour(name: str, kernel: bool) -> str:
    """Deterministic per name: warm reds/oranges/yellows for user code, blues for the kernel."""
    h = name_hash(name)
    a, b, c = (h & 0xFF) / 255, ((h >> 8) & 0xFF) / 255, ((h >> 16) & 0xFF) / 255
    if kernel:
        r, g, bl = 70 + 60 * a, 140 + 60 * b, 200 + 55 * c
    else:
        r, g, bl = 200 + 55 * a, 60 + 150 * b, 30 + 40 * c
    return f"#{int(r):02x}{int(g):02x}{int(bl):02x}"


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

# Frames are emitted in preorder, so a node's subtree is the run of following frames that are deeper than
# it; depth is read back from each rect's y. Geometry attributes are rewritten on zoom, the originals kept.
_SCRIPT = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var frames = document.getElementById("frames");
  var details = document.getElementById("details");
  var matched = document.getElementById("matched");
  var reset = document.getElementById("reset");
  var gs = [], X = [], W = [], D = [], names = [], fills = [], texts = [], rects = [];
  var kids = frames.children;
  for (var i = 0; i < kids.length; i++) {
    var g = kids[i], r = g.querySelector("rect"), t = g.querySelector("text");
    var y = parseFloat(r.getAttribute("y"));
    var level = Math.round((y - CFG.top) / CFG.fh);
    gs.push(g); rects.push(r); texts.push(t);
    X.push(parseFloat(r.getAttribute("x"))); W.push(parseFloat(r.getAttribute("width")));
    D.push(CFG.icicle ? level : CFG.maxd - level);
    names.push(g.getAttribute("data-n") || (t ? t.textContent : ""));
    fills.push(r.getAttribute("fill"));
    g.setAttribute("data-i", String(i));
  }
  function label(name, w) {
    var room = Math.floor((w - 2 * CFG.inset) / CFG.cw);
    if (room < 3) return "";
    return name.length <= room ? name : name.slice(0, room - 2) + "..";
  }
  function place(k, x, w) {
    rects[k].setAttribute("x", x.toFixed(2));
    rects[k].setAttribute("width", w.toFixed(2));
    var text = label(names[k], w);
    if (text && !texts[k]) {
      texts[k] = document.createElementNS(NS, "text");
      texts[k].setAttribute("y", String(parseFloat(rects[k].getAttribute("y")) + CFG.fh - 5));
      gs[k].appendChild(texts[k]);
    }
    if (texts[k]) {
      texts[k].setAttribute("x", (x + CFG.inset).toFixed(2));
      texts[k].textContent = text;
    }
  }
  function zoom(i) {
    var end = i + 1;
    while (end < gs.length && D[end] > D[i]) end++;
    var scale = W[0] / W[i], ancestor = {}, depth = D[i];
    for (var a = i - 1; a >= 0; a--) {
      if (D[a] < depth) { ancestor[a] = true; depth = D[a]; }
    }
    for (var k = 0; k < gs.length; k++) {
      if (k >= i && k < end) {
        gs[k].setAttribute("class", "");
        place(k, X[0] + (X[k] - X[i]) * scale, W[k] * scale);
      } else if (ancestor[k]) {
        gs[k].setAttribute("class", "anc");
        place(k, X[0], W[0]);
      } else {
        gs[k].setAttribute("class", "hid");
      }
    }
    reset.setAttribute("class", i === 0 ? "ctl hid" : "ctl");
  }
  function search(pattern) {
    var re = null, sum = 0, inside = -1;
    if (pattern) {
      try { re = new RegExp(pattern); } catch (e) { matched.textContent = "bad regex: " + e.message; return; }
    }
    for (var k = 0; k < gs.length; k++) {
      var hit = re !== null && re.test(names[k]);
      rects[k].setAttribute("fill", hit ? CFG.hl : fills[k]);
      if (inside >= 0 && D[k] <= inside) inside = -1;
      if (hit && inside < 0) { sum += W[k]; inside = D[k]; }
    }
    matched.textContent = re ? "matched: " + (100 * sum / W[0]).toFixed(2) + "%" : "";
  }
  function ask() {
    var pattern = window.prompt("Search frames (regular expression), empty to clear", "");
    if (pattern !== null) search(pattern);
  }
  frames.addEventListener("click", function (e) {
    var g = e.target.closest ? e.target.closest("#frames > g") : null;
    if (g) zoom(parseInt(g.getAttribute("data-i"), 10));
  });
  frames.addEventListener("mouseover", function (e) {
    var g = e.target.closest ? e.target.closest("#frames > g") : null;
    var t = g ? g.querySelector("title") : null;
    details.textContent = t ? t.textContent : "";
  });
  frames.addEventListener("mouseout", function () { details.textContent = ""; });
  reset.addEventListener("click", function () { zoom(0); });
  document.getElementById("search").addEventListener("click", ask);
  document.addEventListener("keydown", function (e) {
    if ((e.ctrlKey || e.metaKey) && (e.key === "f" || e.key === "F")) { e.preventDefault(); ask(); }
    else if (e.key === "Escape") { search(""); }
  });
})();
"""


def render_svg(
    stacks: Stacks,
    title: str = "CPU flame graph",
    subtitle: str = "",
    unit: str = "samples",
    frequency_hz: int | None = None,
    width: int = 1200,
    min_width_px: float = 0.1,
    icicle: bool = False,
) -> str:
    """An interactive flame graph (root at the bottom, or at the top when icicle) as one SVG document."""
    tree = build_tree(stacks)

    def fill(node: Node, depth: int) -> str:
        return "#c8c8c8" if depth == 0 or node.key == OTHER else frame_colour(node.display, node.kernel)

    return render_tree_svg(
        tree,
        fill=fill,
        tooltip=lambda node: _tooltip(node, tree.total, unit, frequency_hz),
        title=title,
        subtitle=subtitle,
        width=width,
        min_width_px=min_width_px,
        icicle=icicle,
    )


def render_tree_svg(
    tree: Node,
    fill: Callable[[Node, int], str],
    tooltip: Callable[[Node], str],
    title: str,
    subtitle: str = "",
    width: int = 1200,
    min_width_px: float = 0.1,
    icicle: bool = False,
) -> str:
    """The SVG for any call tree whose nodes are sized by `total`; fill(node, depth) and tooltip(node)
    give each frame's colour and hover text (the diff flame graph brings its own). Frames are labelled
    with their shown (demangled) names."""
    if width < 4 * PAD:
        raise ValueError(f"width {width}px is too small for a flame graph")
    avail = width - 2 * PAD
    top = 60 if subtitle else 44
    laid = _layout(tree, avail, min_width_px) if tree.total else []
    max_depth = max((depth for _, depth, _, _ in laid), default=0)
    frames_h = (max_depth + 1) * FRAME_H if laid else 2 * FRAME_H
    height = top + frames_h + 30

    parts = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n',
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n',
        f"<style>{_STYLE}</style>\n",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#f8f8f4"/>\n',
        f'<text id="title" x="{width / 2:g}" y="24">{_xml(title)}</text>\n',
    ]
    if subtitle:
        parts.append(f'<text id="subtitle" x="{width / 2:g}" y="42">{_xml(subtitle)}</text>\n')
    parts.append(f'<text id="reset" class="ctl hid" x="{PAD}" y="24">Reset zoom</text>\n')
    parts.append(f'<text id="search" class="ctl" x="{width - PAD}" y="24" text-anchor="end">Search</text>\n')
    parts.append('<g id="frames">\n')
    for node, depth, x, w in laid:
        level = depth if icicle else max_depth - depth
        y = top + level * FRAME_H
        shown = node.display
        label = fit_label(shown, w)
        colour = fill(node, depth)
        full_name = "" if label == shown else f' data-n="{_xml(shown)}"'
        text = (
            f'<text x="{_num(x + LABEL_INSET)}" y="{y + FRAME_H - 5}">{_xml(label)}</text>' if label else ""
        )
        parts.append(
            f"<g{full_name}><title>{_xml(tooltip(node))}</title>"
            f'<rect x="{_num(x)}" y="{y}" width="{_num(w)}" height="{FRAME_H - 1}" fill="{colour}"/>'
            f"{text}</g>\n"
        )
    parts.append("</g>\n")
    if not laid:
        parts.append(f'<text x="{width / 2:g}" y="{top + FRAME_H}" text-anchor="middle">no samples</text>\n')
    footer_y = top + frames_h + 20
    parts.append(f'<text id="details" x="{PAD}" y="{footer_y}"> </text>\n')
    parts.append(f'<text id="matched" x="{width - PAD}" y="{footer_y}" text-anchor="end"></text>\n')
    config = {
        "top": top,
        "fh": FRAME_H,
        "maxd": max_depth,
        "icicle": icicle,
        "cw": CHAR_W,
        "inset": LABEL_INSET,
        "hl": "#e040e0",
    }
    # CDATA keeps the script's '<' and '&' literal; nothing in it or in the JSON config can contain "]]>".
    parts.append(f"<script><![CDATA[\nvar CFG = {json.dumps(config)};{_SCRIPT}]]></script>\n")
    parts.append("</svg>\n")
    return "".join(parts)
