"""A self-contained HTML flame graph: data, script and style inline, no network (zoom, search, details).

The page is drawn by app.flame.js, the web UI's flame-graph script, inlined with its style: the same
drawing as the UI's, root on top."""

from __future__ import annotations

import html
import json

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import Node, build_tree, by_name
from fleetprof.collector.render.webflame import flame_script, flame_style

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
#flame{width:100%;background:#fff}
#details{font:12px monospace;min-height:1.4em;margin-top:6px}
#deeper{font-size:12px;color:#555;margin-top:4px}
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
    names: Names = as_stored,
) -> str:
    """One HTML document holding the flame graph of `stacks`: click to zoom, regex search, hover details;
    frames named by their shown (demangled) names.

    The data: a table of names, and the nodes in preorder as [name, module, depth, total, self, kernel],
    names and modules as indexes into the table."""
    tree = build_tree(stacks, names=names)
    names: dict[str, int] = {"": 0}
    nodes: list[list] = []
    if tree.total:
        pending: list[tuple[Node, int]] = [(tree, 0)]
        while pending:
            node, level = pending.pop()
            nodes.append(
                [
                    names.setdefault(node.display, len(names)),
                    names.setdefault(node.module, len(names)),
                    level,
                    node.total,
                    node.self_count,
                    1 if node.kernel else 0,
                ]
            )
            # Children by name, as in the SVG, so a function keeps its place between two profiles.
            children = sorted(node.children.values(), key=by_name)
            pending.extend((child, level + 1) for child in reversed(children))
    data = {"names": list(names), "nodes": nodes, "unit": unit, "hz": frequency_hz}
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}{flame_style()}</style></head>\n<body>\n"
        f'<h1>{html.escape(title)}</h1>\n<div id="subtitle">{html.escape(subtitle)}</div>\n'
        '<div id="bar"><input id="search" type="search" placeholder="search (regex)" spellcheck="false">'
        '<span id="matched"></span><span id="reset" hidden>Reset zoom</span></div>\n'
        '<div id="details"></div>\n<div id="flame"></div>\n<div id="deeper" hidden></div>\n'
        f'<script type="application/json" id="fp-data">{_json_for_script(data)}</script>\n'
        f"<script>\n{flame_script()}\nFleetprofFlame.htmlPage();\n</script>\n</body></html>\n"
    )
