"""Two merged profiles compared: per-function shares and deltas, a merged call tree, a red/blue SVG."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetprof.collector.model.profile import FrameKey, Stacks
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.svg import render_tree_svg
from fleetprof.collector.render.tree import (
    OTHER,
    Node,
    PythonFunctions,
    function_counts,
    function_fields,
    truncate,
    truncate_onto,
)
from fleetprof.collector.render.webflame import look

SORTS = ("self", "total")
GROWTH_RGB = (224, 48, 32)  # red: a larger share in the comparison
SHRINK_RGB = (32, 96, 224)  # blue: a smaller share
NEUTRAL_RGB = (236, 236, 230)


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def function_diff(
    baseline: Stacks,
    comparison: Stacks,
    limit: int = 50,
    sort: str = "self",
    lines: bool = False,
    names: Names = as_stored,
) -> list[dict]:
    """Per function: its share of each profile (self and total %), and comparison − baseline in points.

    Shares, not sample counts, are compared, so selections of different lengths or sizes compare fairly.
    Rows are sorted by |delta| of `sort` ("self" or "total"), largest first. A row per function (raw name,
    module, kernel), named by function_fields() (the shown name, and the raw one where it differs); a
    Python function's lines are one row (listed as "lines") unless `lines`, as in top_functions().
    """
    if sort not in SORTS:
        raise ValueError(f'sort must be "self" or "total", got {sort!r}')
    functions = None if lines else PythonFunctions()
    b_self, b_total, b_all = function_counts(baseline, functions)
    c_self, c_total, c_all = function_counts(comparison, functions)
    rows = []
    for frame in b_total.keys() | c_total.keys():
        row: dict = {**function_fields(frame, names), "module": frame.module, "kernel": frame.kernel}
        if functions and frame in functions.lines:
            row["lines"] = sorted(functions.lines[frame])
        for kind, b_counts, c_counts in (("self", b_self, c_self), ("total", b_total, c_total)):
            b, c = b_counts.get(frame, 0), c_counts.get(frame, 0)
            b_pct, c_pct = _pct(b, b_all), _pct(c, c_all)
            row[f"baseline_{kind}"] = b
            row[f"comparison_{kind}"] = c
            row[f"baseline_{kind}_pct"] = round(b_pct, 3)
            row[f"comparison_{kind}_pct"] = round(c_pct, 3)
            row[f"{kind}_delta_pct"] = round(c_pct - b_pct, 3)
        rows.append(row)
    other = "total" if sort == "self" else "self"
    rows.sort(
        key=lambda r: (
            -abs(r[f"{sort}_delta_pct"]),
            -abs(r[f"{other}_delta_pct"]),
            r["function"],
            r.get("system_name", r["function"]),
            r["module"],
            r["kernel"],
        )
    )
    return rows[: max(limit, 0)]


@dataclass(eq=False)
class DiffNode(Node):
    """A node of the merged call tree: `total` is a layout weight (the two shares added), and the
    baseline's and comparison's own samples are kept beside it."""

    base_total: int = 0
    base_self: int = 0
    comp_total: int = 0
    comp_self: int = 0
    children: dict[FrameKey, DiffNode] = field(default_factory=dict)  # type: ignore[assignment]

    def delta(self, base_all: int, comp_all: int) -> float:
        """Comparison share − baseline share of this subtree, as a fraction of each profile."""
        return (self.comp_total / comp_all if comp_all else 0.0) - (
            self.base_total / base_all if base_all else 0.0
        )


def limit_pair(baseline: Stacks, comparison: Stacks, max_nodes: int) -> tuple[dict, dict]:
    """Both profiles cut to one shared shape of at most max_nodes nodes (long tails become OTHER).

    The shape is truncate()'s choice on the two profiles combined by share, so a function heavy in
    either one is kept; each profile's sum is unchanged.
    """
    b_all, c_all = sum(baseline.values()), sum(comparison.values())
    combined: dict = {}
    # Weighted by the other side's total, so each profile counts by its share, in exact integers.
    for stacks, weight in ((baseline, c_all or 1), (comparison, b_all or 1)):
        for stack, count in stacks.items():
            if count > 0:
                combined[stack] = combined.get(stack, 0) + count * weight
    shape = truncate(combined, max_nodes)
    return truncate_onto(baseline, shape), truncate_onto(comparison, shape)


def build_diff_tree(baseline: Stacks, comparison: Stacks, names: Names = as_stored) -> DiffNode:
    """The union of both call trees; each node's layout weight is base × |comparison| + comp × |baseline|,
    which is proportional to the sum of its two shares."""
    root = DiffNode(name="all", module="", kernel=False, display="all")
    b_all, c_all = sum(baseline.values()), sum(comparison.values())
    for stacks, side, weight in ((baseline, "base", c_all or 1), (comparison, "comp", b_all or 1)):
        for stack, count in stacks.items():
            if count <= 0:
                continue
            node = root
            path = [root]
            for frame in stack:
                child = node.children.get(frame)
                if child is None:
                    child = DiffNode(
                        frame.function, frame.module, frame.kernel, display=names(frame.function)
                    )
                    node.children[frame] = child
                node = child
                path.append(node)
            for n in path:
                n.total += count * weight
                setattr(n, f"{side}_total", getattr(n, f"{side}_total") + count)
            setattr(node, f"{side}_self", getattr(node, f"{side}_self") + count)
    return root


def diff_colour(delta: float, max_abs_delta: float) -> str:
    """Red for growth, blue for shrinkage, near-white for no change; saturation ∝ |delta| / max."""
    strength = min(abs(delta) / max_abs_delta, 1.0) if max_abs_delta > 0 else 0.0
    target = GROWTH_RGB if delta > 0 else SHRINK_RGB
    rgb = (round(n + (t - n) * strength) for n, t in zip(NEUTRAL_RGB, target, strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def render_diff_svg(
    baseline: Stacks,
    comparison: Stacks,
    title: str = "CPU diff flame graph",
    subtitle: str = "",
    unit: str = "",
    names: Names = as_stored,
) -> str:
    """A differential flame graph: frames sized by their shares in both profiles together, red where the
    comparison spends a larger share than the baseline and blue where smaller."""
    tree = build_diff_tree(baseline, comparison, names)
    b_all, c_all = tree.base_total, tree.comp_total
    deltas: list[float] = []
    pending: list[DiffNode] = [tree]
    while pending:
        node = pending.pop()
        deltas.append(abs(node.delta(b_all, c_all)))
        pending.extend(node.children.values())
    max_delta = max(deltas[1:], default=0.0)

    def fill(node: Node, depth: int) -> str:
        assert isinstance(node, DiffNode)
        if depth == 0:
            return look()["plain"]
        return diff_colour(node.delta(b_all, c_all), max_delta)

    def tooltip(node: Node) -> str:
        assert isinstance(node, DiffNode)
        module = node.module or ("kernel" if node.kernel else "")
        if node.key == OTHER:
            module = "merged small frames"
        head = f"{node.display} ({module})" if module else node.display
        b_pct, c_pct = _pct(node.base_total, b_all), _pct(node.comp_total, c_all)
        u = f" {unit}" if unit else ""
        return (
            f"{head} — baseline {b_pct:.2f}% ({node.base_total}{u}), comparison {c_pct:.2f}% "
            f"({node.comp_total}{u}), Δ {c_pct - b_pct:+.2f} pp"
        )

    legend = "red: larger share in the comparison · blue: smaller"
    return render_tree_svg(
        tree,
        fill=fill,
        tooltip=tooltip,
        title=title,
        subtitle=f"{subtitle} · {legend}" if subtitle else legend,
    )
