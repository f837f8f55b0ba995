"""A self-contained HTML flame graph: data, script and style inline, no network (zoom, search, details)."""

from __future__ import annotations

import html
import json

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.svg import frame_colour
from fleetprof.collector.render.tree import OTHER, Node, build_tree, by_name

FRAME_H = 18

# The page's Content-Security-Policy forbids every fetch, so "self-contained" is enforced by the browser.
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"

_STYLE = """
body{font:13px system-ui,sans-serif;margin:12px;background:#f8f8f4;color:#222}
h1{font-size:17px;margin:0 0 2px}
#subtitle{color:#555;margin-bottom:8px}
#bar{display:flex;gap:10px;align-items:center;margin-bottom:6px}
#bar input{font:12px monospace;width:22em;padding:2px 4px}
#reset{cursor:pointer;color:#1f4e9c;text-decoration:underline}
#reset[hidden]{display:none}
#matched{color:#803080}
#flame{position:relative;width:100%;overflow:hidden}
.frame{position:absolute;box-sizing:border-box;height:17px;border:1px solid #f8f8f4;overflow:hidden;
  white-space:nowrap;font:11px monospace;line-height:15px;padding-left:3px;cursor:pointer}
.frame:hover{border-color:#000}
.frame.anc{opacity:.55}
.frame.hit{background:#e040e0 !important}
#details{font:12px monospace;min-height:1.4em;margin-top:6px}
"""

# Nodes arrive in preorder with their level, so a node's x is its parent's x plus the values of the
# siblings before it: one cursor per level is enough. A subtree is the run of following nodes that are
# deeper than it.
_SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("fp-data").textContent);
  var N = D.nodes.length, flame = document.getElementById("flame");
  var X = new Array(N), END = new Array(N), cursor = [0], maxLevel = 0, els = new Array(N);
  for (var i = 0; i < N; i++) {
    var lv = D.nodes[i][2];
    X[i] = cursor[lv] || 0;
    cursor[lv] = X[i] + D.nodes[i][3];
    cursor[lv + 1] = X[i];
    if (lv > maxLevel) maxLevel = lv;
  }
  for (i = N - 1; i >= 0; i--) {  // END[i]: one past the last node of i's subtree
    var e = i + 1;
    while (e < N && D.nodes[e][2] > D.nodes[i][2]) e = END[e];
    END[i] = e;
  }
  flame.style.height = ((maxLevel + 1) * D.fh) + "px";
  function name(k) { return D.names[D.nodes[k][0]]; }
  function describe(k) {
    var n = D.nodes[k], module = D.names[n[1]] || (n[5] ? "kernel" : "");
    var text = name(k) + (module ? " (" + module + ")" : "") + " — " + n[3] + " " + D.unit + ", " +
      (100 * n[3] / D.nodes[0][3]).toFixed(2) + "%";
    if (D.hz) text += ", " + (n[3] / D.hz).toFixed(2) + " s";
    return text;
  }
  function frameEl(k) {
    if (!els[k]) {
      var div = document.createElement("div");
      div.className = "frame";
      div.dataset.i = String(k);
      div.dataset.name = name(k);
      div.style.background = D.nodes[k][6];
      div.style.bottom = (D.nodes[k][2] * D.fh) + "px";
      div.title = describe(k);
      flame.appendChild(div);
      els[k] = div;
    }
    return els[k];
  }
  var zoomed = 0;
  function draw(root) {
    zoomed = root;
    var width = flame.clientWidth, x0 = X[root], w0 = D.nodes[root][3], ancestors = {};
    for (var a = root, lv = D.nodes[root][2]; a >= 0; a--) {
      if (D.nodes[a][2] < lv) { ancestors[a] = true; lv = D.nodes[a][2]; }
    }
    for (var k = 0; k < N; k++) {
      var inside = k >= root && k < END[root], px = inside ? D.nodes[k][3] / w0 * width : width;
      if (!(inside || ancestors[k]) || px < 0.5) {
        if (els[k]) els[k].style.display = "none";
        continue;
      }
      var el = frameEl(k), left = inside ? (X[k] - x0) / w0 * width : 0;
      el.style.display = "";
      el.style.left = left.toFixed(2) + "px";
      el.style.width = px.toFixed(2) + "px";
      el.classList.toggle("anc", !!ancestors[k]);
      el.textContent = px > 24 ? name(k) : "";
    }
    document.getElementById("reset").hidden = root === 0;
    search();
  }
  function search() {
    var pattern = document.getElementById("search").value, re = null, sum = 0, insideUntil = -1;
    var matched = document.getElementById("matched");
    if (pattern) {
      try { re = new RegExp(pattern); } catch (err) {
        matched.textContent = "bad regex: " + err.message;
        return;
      }
    }
    for (var k = 0; k < N; k++) {
      var hit = re !== null && re.test(name(k));
      if (els[k]) els[k].classList.toggle("hit", hit);
      if (hit && k >= insideUntil) { sum += D.nodes[k][3]; insideUntil = END[k]; }
    }
    matched.textContent = re ? "matched: " + (100 * sum / D.nodes[0][3]).toFixed(2) + "%" : "";
  }
  flame.addEventListener("click", function (ev) {
    var el = ev.target.closest(".frame");
    if (el) draw(parseInt(el.dataset.i, 10));
  });
  flame.addEventListener("mouseover", function (ev) {
    var el = ev.target.closest(".frame");
    document.getElementById("details").textContent = el ? describe(parseInt(el.dataset.i, 10)) : "";
  });
  document.getElementById("reset").addEventListener("click", function () { draw(0); });
  document.getElementById("search").addEventListener("input", search);
  window.addEventListener("resize", function () { draw(zoomed); });
  if (N) draw(0); else flame.textContent = "no samples";
})();
"""


def _json_for_script(value: object) -> str:
    # Inside <script>, "</" could close the element early; "<\/" means the same thing in JSON.
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def render_html(
    stacks: Stacks,
    title: str = "CPU flame graph",
    subtitle: str = "",
    unit: str = "samples",
    frequency_hz: int | None = None,
) -> str:
    """One HTML document holding the flame graph of `stacks`: click to zoom, regex search, hover details;
    frames named by their shown (demangled) names."""
    tree = build_tree(stacks)
    names: dict[str, int] = {"": 0}
    nodes: list[list] = []
    if tree.total:
        pending: list[tuple[Node, int]] = [(tree, 0)]
        while pending:
            node, level = pending.pop()
            grey = level == 0 or node.key == OTHER
            shown = node.display
            nodes.append(
                [
                    names.setdefault(shown, len(names)),
                    names.setdefault(node.module, len(names)),
                    level,
                    node.total,
                    node.self_count,
                    1 if node.kernel else 0,
                    "#c8c8c8" if grey else frame_colour(shown, node.kernel),
                ]
            )
            # Children by name, as in the SVG, so a function keeps its place between two profiles.
            children = sorted(node.children.values(), key=by_name)
            pending.extend((child, level + 1) for child in reversed(children))
    data = {"names": list(names), "nodes": nodes, "unit": unit, "hz": frequency_hz, "fh": FRAME_H}
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style></head>\n<body>\n"
        f'<h1>{html.escape(title)}</h1>\n<div id="subtitle">{html.escape(subtitle)}</div>\n'
        '<div id="bar"><input id="search" type="search" placeholder="search (regex)" spellcheck="false">'
        '<span id="matched"></span><span id="reset" hidden>Reset zoom</span></div>\n'
        '<div id="flame"></div>\n<div id="details"></div>\n'
        f'<script type="application/json" id="fp-data">{_json_for_script(data)}</script>\n'
        f"<script>{_SCRIPT}</script>\n</body></html>\n"
    )
