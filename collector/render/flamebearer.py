"""Call trees as Pyroscope's flamebearer (the FlameGraph message Grafana's Pyroscope datasource draws).

Level 0 is one root named "total". Each level is a run of 4-tuples [x offset, total, self, name index]:
the offset counts from the end of the previous node on the same level (the first, from 0); a node's
children start at its own x plus its self (self sits at its left edge), heaviest first; each level lists
nodes under their parents' order on the level above."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import KERNEL_SUFFIX, Node, build_tree, by_weight, truncate


@dataclass(frozen=True)
class Flamebearer:
    names: list[str]
    levels: list[list[int]]
    total: int
    max_self: int


def _label(node: Node) -> str:
    """The shown (demangled) name, with folded's "_[k]" for a kernel frame."""
    return node.display + KERNEL_SUFFIX if node.kernel else node.display


def to_flamebearer(stacks: Stacks, max_nodes: int, scale: int = 1, names: Names = as_stored) -> Flamebearer:
    """The flame graph of `stacks` with at most `max_nodes` nodes besides the root (the lightest merged
    into "other" nodes, totals kept), every value multiplied by `scale` (nanoseconds per sample, say)."""
    scaled = {st: n * scale for st, n in truncate(stacks, max_nodes).items()}
    root = build_tree(scaled, root_name="total", names=names)
    names: list[str] = []
    index: dict[str, int] = {}

    def name_of(node: Node) -> int:
        label = _label(node)
        i = index.get(label)
        if i is None:
            i = index[label] = len(names)
            names.append(label)
        return i

    levels: list[list[int]] = []
    max_self = 0
    current = [(root, 0)]
    while current:
        values: list[int] = []
        below: list[tuple[Node, int]] = []
        end = 0
        for node, x in current:
            values += [x - end, node.total, node.self_count, name_of(node)]
            end = x + node.total
            max_self = max(max_self, node.self_count)
            cx = x + node.self_count
            for child in sorted(node.children.values(), key=by_weight):
                below.append((child, cx))
                cx += child.total
        levels.append(values)
        current = below
    return Flamebearer(names, levels, root.total, max_self)
