"""Call trees as Grafana data frames for the flame graph panel (nested-set form; the diff form adds
valueRight/selfRight), in Grafana's DataFrame JSON shape (schema + data.values)."""

from __future__ import annotations

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.diff import DiffNode, build_diff_tree
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import KERNEL_SUFFIX, Node, build_tree, by_name, by_weight


def _label(node: Node) -> str:
    """The shown (demangled) name, with folded's "_[k]" for a kernel frame."""
    return node.display + KERNEL_SUFFIX if node.kernel else node.display


def _preorder(root: Node, name_order: bool) -> list[tuple[Node, int]]:
    """(node, level) depth first, one root row. Children heaviest first, or by name for a diff so a
    function keeps its place between the two sides."""
    out: list[tuple[Node, int]] = []
    pending = [(root, 0)]
    while pending:
        node, level = pending.pop()
        out.append((node, level))
        children = sorted(node.children.values(), key=by_name if name_order else by_weight)
        pending.extend((child, level + 1) for child in reversed(children))
    return out


def _frame(name: str, columns: dict[str, list]) -> dict:
    fields = []
    for col in columns:
        entry: dict = {"name": col, "type": "string" if col == "label" else "number"}
        if col.startswith(("value", "self")):
            entry["config"] = {"unit": "short"}
        fields.append(entry)
    return {
        "schema": {
            "name": name,
            "meta": {"preferredVisualisationType": "flamegraph"},
            "fields": fields,
        },
        "data": {"values": list(columns.values())},
    }


def flamegraph_frame(stacks: Stacks, name: str = "cpu", names: Names = as_stored) -> dict:
    """A flame graph data frame: level, value (samples in the subtree), self, label."""
    rows = _preorder(build_tree(stacks, names=names), name_order=False)
    columns = {
        "level": [level for _, level in rows],
        "value": [n.total for n, _ in rows],
        "self": [n.self_count for n, _ in rows],
        "label": [_label(n) for n, _ in rows],
    }
    return _frame(name, columns)


def diff_flamegraph_frame(
    baseline: Stacks, comparison: Stacks, name: str = "cpu diff", names: Names = as_stored
) -> dict:
    """A diff flame graph data frame: value/self are the baseline's samples, valueRight/selfRight the
    comparison's (Grafana adds the two for widths and colours by the change in share)."""
    tree: DiffNode = build_diff_tree(baseline, comparison, names)
    rows = _preorder(tree, name_order=True)
    diff_rows = [(n, level) for n, level in rows if isinstance(n, DiffNode)]
    columns = {
        "level": [level for _, level in diff_rows],
        "value": [n.base_total for n, _ in diff_rows],
        "self": [n.base_self for n, _ in diff_rows],
        "valueRight": [n.comp_total for n, _ in diff_rows],
        "selfRight": [n.comp_self for n, _ in diff_rows],
        "label": [_label(n) for n, _ in diff_rows],
    }
    return _frame(name, columns)
