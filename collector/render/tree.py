"""The profile model all renderers share: merged stacks, their call tree, and folded/JSON/top views.

Frames are shown by what a `names` function (render/names.py) makes of their raw names: the collector
passes its Demangler's; the default shows them as stored."""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetprof.collector.model.profile import FrameKey, Stacks
from fleetprof.collector.render.names import Names, as_stored

KERNEL_SUFFIX = "_[k]"
# The frame that truncate() folds a parent's light children into. The module marks it as ours, so a real
# function called "other" (which always has a module or none) is not silently merged with it in tooltips.
OTHER = FrameKey(function="other", module="[truncated]")
# Folded text cannot say "no frames"; an empty stack is written as this one frame so its samples survive.
UNKNOWN_FRAME = "[unknown]"


@dataclass
class Node:
    """A call-tree node: total = samples in its subtree, self_count = samples where it was the leaf.
    `name` is the frame's raw name (its identity, with module and kernel); renderers show `display`, the
    name as the tree's `names` show it (demangled, for the collector's)."""

    name: str
    module: str
    kernel: bool
    total: int = 0
    self_count: int = 0
    children: dict[FrameKey, Node] = field(default_factory=dict)
    display: str = ""

    @property
    def key(self) -> FrameKey:
        return FrameKey(self.name, self.module, self.kernel)


def by_name(node: Node) -> tuple[str, str, str, bool]:
    """Sort key of siblings in name order: the shown name, then the rest of the frame's identity (two raw
    names can demangle alike)."""
    return (node.display, node.name, node.module, node.kernel)


def _checked_count(stack: tuple[FrameKey, ...], count: int) -> int:
    if count < 0:
        raise ValueError(f"negative sample count {count} for a stack of {len(stack)} frames")
    return count


def build_tree(stacks: Stacks, root_name: str = "all", names: Names = as_stored) -> Node:
    """Merge root-first stacks into one call tree under a synthetic root; zero-count stacks add nothing.
    Each node's `display` is names(its raw name)."""
    shown = None if names is as_stored else names  # as stored: no call per node (truncate's trees)
    root = Node(name=root_name, module="", kernel=False, display=root_name)
    for stack, count in stacks.items():
        if not _checked_count(stack, count):
            continue
        root.total += count
        node = root
        for frame in stack:
            child = node.children.get(frame)
            if child is None:
                display = frame.function if shown is None else shown(frame.function)
                child = Node(frame.function, frame.module, frame.kernel, display=display)
                node.children[frame] = child
            child.total += count
            node = child
        node.self_count += count
    return root


def folded_frame(frame: FrameKey, names: Names = as_stored) -> str:
    """One frame as folded text: its shown (demangled) name, "_[k]" appended for a kernel frame.

    ';' separates frames and '\\n' separates lines, so inside a name ';' becomes ',' and CR/LF become a
    space; the count is split off at the last space, so other spaces are safe. An empty name becomes
    "[unknown]" (an empty field would read as a missing frame). The module is not written: folded text
    has no place for it, so frames that differ only by module, or by raw names that demangle alike, merge.
    """
    name = names(frame.function).replace(";", ",").replace("\r", " ").replace("\n", " ") or UNKNOWN_FRAME
    return name + KERNEL_SUFFIX if frame.kernel else name


def to_folded(stacks: Stacks, names: Names = as_stored) -> str:
    """Brendan Gregg's folded format, "a;b;c 42" per line, root first, sorted by stack text."""
    lines: dict[str, int] = {}
    frames: dict[FrameKey, str] = {}  # each distinct frame written once: stacks share most of theirs
    for stack, count in stacks.items():
        if not _checked_count(stack, count):
            continue
        parts = []
        for f in stack:
            part = frames.get(f)
            if part is None:
                part = frames[f] = folded_frame(f, names)
            parts.append(part)
        text = ";".join(parts) if stack else UNKNOWN_FRAME
        # Distinct stacks can fold to the same text (module dropped, names escaped): their counts add up.
        lines[text] = lines.get(text, 0) + count
    return "".join(f"{text} {lines[text]}\n" for text in sorted(lines))


def parse_folded(text: str) -> dict[tuple[FrameKey, ...], int]:
    r"""Read folded lines back into stacks; a "_[k]" suffix marks a kernel frame. Blank lines are skipped.

    Lines end at "\n" (or "\r\n"), as to_folded writes them, and are read as written: the other breaks
    str.splitlines knows (\x0b, \x1c, \x85, \u2028, ...) and leading blanks are part of a name (only
    blanks after the count are dropped).
    """
    stacks: dict[tuple[FrameKey, ...], int] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip(" \t\r")
        if not line.strip():
            continue
        stack_text, sep, count_text = line.rpartition(" ")
        if not sep or not stack_text:
            raise ValueError(f"folded line {lineno}: expected 'frame;frame;... COUNT', got {raw!r}")
        try:
            count = int(count_text)
        except ValueError:
            raise ValueError(f"folded line {lineno}: count {count_text!r} is not an integer") from None
        frames = []
        for name in stack_text.split(";"):
            kernel = name.endswith(KERNEL_SUFFIX)
            frames.append(FrameKey(name[: -len(KERNEL_SUFFIX)] if kernel else name, kernel=kernel))
        stack = tuple(frames)
        stacks[stack] = stacks.get(stack, 0) + _checked_count(stack, count)
    return stacks


def by_weight(node: Node) -> tuple[int, str, str, str, bool]:
    """Sort key of siblings heaviest first, then in name order."""
    return (-node.total, *by_name(node))


def function_fields(frame: FrameKey, names: Names = as_stored) -> dict[str, str]:
    """A function's name in a JSON row: "function" as shown, and "system_name" the raw name (as the agent
    sent it) where the two differ."""
    shown = names(frame.function)
    return (
        {"function": shown} if shown == frame.function else {"function": shown, "system_name": frame.function}
    )


def to_json(
    stacks: Stacks,
    total_samples: int | None = None,
    frequency_hz: int | None = None,
    names: Names = as_stored,
) -> dict:
    """The tree as plain dicts for the web UI.

    "total" is total_samples when given (the caller may know of samples not in these stacks), otherwise the
    sum of the stacks; the root's "value" is always the sum of the stacks. Children are sorted by value
    descending, then name. "name" is the shown (demangled) name; a node whose raw name differs has it as
    "system_name".
    """
    tree = build_tree(stacks, names=names)

    def as_dict(node: Node) -> dict:
        shown = node.display
        out = {"name": shown, "module": node.module, "kernel": node.kernel}
        if shown != node.name:
            out["system_name"] = node.name
        return {**out, "value": node.total, "self": node.self_count, "children": []}

    root = as_dict(tree)
    # Iterative on purpose: deep stacks (long Python or recursive call chains) must not hit the recursion
    # limit.
    pending = [(tree, root)]
    while pending:
        node, out = pending.pop()
        for child in sorted(node.children.values(), key=by_weight):
            child_out = as_dict(child)
            out["children"].append(child_out)
            pending.append((child, child_out))
    return {
        "total": tree.total if total_samples is None else total_samples,
        "frequency_hz": frequency_hz,
        "root": root,
    }


def tree_json_text(body: dict) -> str:
    """json.dumps(body) (compact) for a body whose "root" is to_json's tree, written without recursion: the
    tree is as deep as the deepest stack (up to ingest's 4096 frames), past what json.dumps recurses into
    (Python's recursion limit, 1000: a stack of ~500 frames)."""
    # Outside a string, '"root":null' is the key itself (a quote inside a string is written \").
    text = json.dumps({**body, "root": None}, separators=(",", ":"))
    at = text.index('"root":null') + len('"root":')
    parts = [text[:at]]
    work: list = [text[at + len("null") :], body["root"]]  # nodes to write, and the text after them
    while work:
        item = work.pop()
        if isinstance(item, str):
            parts.append(item)
            continue
        fields = json.dumps({k: v for k, v in item.items() if k != "children"}, separators=(",", ":"))
        parts.append(fields[:-1] + ',"children":[')
        work.append("]}")
        children = item["children"]
        for i in range(len(children) - 1, -1, -1):
            work.append(children[i])
            if i:
                work.append(",")
    return "".join(parts)


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


# A Python frame's name carries the line it was running: "qualname (file.py:LINE)", with the file's path as
# its module (agent/python/codes.py). The line is part of the frame's identity in flame graphs; a ranking of
# functions merges a function's lines into one row named "qualname (file.py)".
_PYTHON_LINE = re.compile(r"(?P<function>.*) \((?P<file>[^()]*):(?P<line>\d+)\)")


class PythonFunctions:
    """frame -> the function it belongs to: a Python frame without its line (where its name's file is its
    module's file name), any other frame as it is. Remembers the lines merged into each function."""

    def __init__(self) -> None:
        self._of: dict[FrameKey, FrameKey] = {}
        self.lines: dict[FrameKey, set[int]] = {}

    def __call__(self, frame: FrameKey) -> FrameKey:
        function = self._of.get(frame)
        if function is None:
            function = self._of[frame] = self._function(frame)
        return function

    def moved(self, frames: Iterable[FrameKey]) -> dict[FrameKey, FrameKey]:
        """The frames among `frames` that belong to a function other than themselves, and that function."""
        out = {}
        for frame in frames:
            if frame.function[-1:] == ")" and not frame.kernel:  # most frames are not Python's: no lookup
                function = self(frame)
                if function is not frame:
                    out[frame] = function
        return out

    def _function(self, frame: FrameKey) -> FrameKey:
        if frame.kernel or not frame.function.endswith(")"):
            return frame
        match = _PYTHON_LINE.fullmatch(frame.function)
        if match is None or match["file"] != os.path.basename(frame.module):
            return frame
        function = FrameKey(f"{match['function']} ({match['file']})", frame.module, False)
        self.lines.setdefault(function, set()).add(int(match["line"]))
        return function


def function_counts(
    stacks: Stacks, functions: PythonFunctions | None = None
) -> tuple[dict[FrameKey, int], dict[FrameKey, int], int]:
    """(self samples per function, total samples per function, all samples): self = samples as the leaf,
    total = samples of the stacks it appears in, counted once per stack. Each frame is its own function
    unless `functions` maps it to another (PythonFunctions: a Python function's lines are one)."""
    self_counts: dict[FrameKey, int] = {}
    totals: dict[FrameKey, int] = {}
    all_samples = 0
    for stack, count in stacks.items():
        if not _checked_count(stack, count):
            continue
        all_samples += count
        if stack:
            leaf = stack[-1]
            self_counts[leaf] = self_counts.get(leaf, 0) + count
        # A set, so a recursive function is counted once per stack rather than once per frame.
        for frame in set(stack):
            totals[frame] = totals.get(frame, 0) + count
    if functions is None:
        return self_counts, totals, all_samples
    return (*_merged(stacks, self_counts, totals, functions), all_samples)


def _merged(
    stacks: Stacks, self_counts: dict[FrameKey, int], totals: dict[FrameKey, int], functions: PythonFunctions
) -> tuple[dict[FrameKey, int], dict[FrameKey, int]]:
    """Per-frame counts summed per function. Only the distinct frames that move are touched, not every
    frame of every stack (mapped per frame, top took 2.5x as long; bench/top_functions.py). Totals add up
    exactly except where one stack holds two frames of one function (two of its lines: recursion): those
    stacks are found in a second pass, over the frames of such functions only, and counted once."""
    moved = functions.moved(totals)
    if not moved:
        return self_counts, totals
    merged_self, merged_totals = dict(self_counts), dict(totals)
    frames_of: dict[FrameKey, list[FrameKey]] = {}
    for frame, function in moved.items():
        frames_of.setdefault(function, []).append(frame)
        own = merged_self.pop(frame, 0)
        if own:
            merged_self[function] = merged_self.get(function, 0) + own
        merged_totals[function] = merged_totals.get(function, 0) + merged_totals.pop(frame)
    several = {f for frames in frames_of.values() if len(frames) > 1 for f in frames}
    if several:
        for stack, count in stacks.items():
            hits = several.intersection(stack)
            if len(hits) > 1 and count > 0:
                per_function: dict[FrameKey, int] = {}
                for frame in hits:
                    per_function[moved[frame]] = per_function.get(moved[frame], 0) + 1
                for function, k in per_function.items():
                    merged_totals[function] -= (k - 1) * count
    return merged_self, merged_totals


def top_functions(
    stacks: Stacks, limit: int = 20, sort: str = "self", lines: bool = False, names: Names = as_stored
) -> list[dict]:
    """The heaviest functions by self samples (or by total samples with sort="total"): one row per function
    (raw name, module, kernel), named by function_fields(). A Python function's lines are one row unless
    `lines`; such a row lists the lines it holds as "lines"."""
    if sort not in ("self", "total"):
        raise ValueError(f'sort must be "self" or "total", got {sort!r}')
    functions = None if lines else PythonFunctions()
    self_counts, totals, all_samples = function_counts(stacks, functions)
    ranked = sorted(
        totals,
        key=lambda f: (
            (-self_counts.get(f, 0), -totals[f]) if sort == "self" else (-totals[f], -self_counts.get(f, 0)),
            names(f.function),
            f.function,
            f.module,
            f.kernel,
        ),
    )
    rows = []
    for frame in ranked[: max(limit, 0)]:
        own = self_counts.get(frame, 0)
        rows.append(
            {
                **function_fields(frame, names),
                "module": frame.module,
                "kernel": frame.kernel,
                "self": own,
                "total": totals[frame],
                "self_pct": _pct(own, all_samples),
                "total_pct": _pct(totals[frame], all_samples),
                **(
                    {"lines": sorted(functions.lines[frame])}
                    if functions and frame in functions.lines
                    else {}
                ),
            }
        )
    return rows


def truncate(stacks: Stacks, max_nodes: int) -> dict[tuple[FrameKey, ...], int]:
    """Keep the heaviest nodes so the tree has at most max_nodes nodes (the root not counted).

    Nodes are kept heaviest first, always together with their parent (a child never outweighs its parent,
    so this is a heaviest-first walk down the tree). Each kept node whose children were not all kept gets
    one OTHER child holding their whole weight, and OTHER nodes count towards max_nodes. The sum of the
    counts is unchanged.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    tree = build_tree(stacks)

    # Nodes by id: Node is a mutable dataclass and so not hashable.
    kept_children: dict[int, list[tuple[FrameKey, Node]]] = {id(tree): []}
    unkept_left: dict[int, int] = {id(tree): len(tree.children)}
    # Output size = kept nodes + one OTHER per kept node (root included) that still has unkept children.
    with_other = 1 if tree.children else 0
    kept = 0
    frontier: list[tuple[int, int, Node, Node, FrameKey]] = []
    order = 0  # tie-breaker so the heap never compares Nodes

    def offer(parent: Node) -> None:
        nonlocal order
        # Children in frame order, so that among equal weights the same nodes are kept whatever order the
        # store returned the stacks in (two stores must answer a max_nodes profile alike).
        for key, child in sorted(parent.children.items(), key=lambda kv: kv[0]):
            heapq.heappush(frontier, (-child.total, order, child, parent, key))
            order += 1

    offer(tree)
    while frontier:
        _, _, node, parent, key = frontier[0]
        gains_other = 1 if node.children else 0
        frees_other = 1 if unkept_left[id(parent)] == 1 else 0
        if kept + 1 + with_other + gains_other - frees_other > max_nodes:
            break
        heapq.heappop(frontier)
        kept += 1
        with_other += gains_other - frees_other
        unkept_left[id(parent)] -= 1
        kept_children[id(parent)].append((key, node))
        kept_children[id(node)] = []
        unkept_left[id(node)] = len(node.children)
        offer(node)

    out: dict[tuple[FrameKey, ...], int] = {}

    def add(stack: tuple[FrameKey, ...], count: int) -> None:
        if count:
            out[stack] = out.get(stack, 0) + count

    walk: list[tuple[Node, tuple[FrameKey, ...]]] = [(tree, ())]
    while walk:
        node, path = walk.pop()
        add(path, node.self_count)
        kept_weight = 0
        for key, child in kept_children[id(node)]:
            kept_weight += child.total
            walk.append((child, path + (key,)))
        add(path + (OTHER,), node.total - node.self_count - kept_weight)
    return out


def truncate_onto(stacks: Stacks, shape: Stacks) -> dict[tuple[FrameKey, ...], int]:
    """Cut each stack to the tree of `shape` (truncate()'s output for a profile that covers these stacks).

    A stack that leaves the shape's tree is cut at the last frame still in it and the rest becomes one
    OTHER frame, as truncate() does; the sum of the counts is unchanged. Two profiles cut onto the shape of
    their combined profile stay node-for-node comparable (the diff flame graph needs that).
    """
    trie: dict = {}
    for stack in shape:
        frames = stack[:-1] if stack and stack[-1] == OTHER else stack
        node = trie
        for frame in frames:
            node = node.setdefault(frame, {})
    out: dict[tuple[FrameKey, ...], int] = {}
    for stack, count in stacks.items():
        if not _checked_count(stack, count):
            continue
        node, depth = trie, 0
        for frame in stack:
            nxt = node.get(frame)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        cut = stack if depth == len(stack) else stack[:depth] + (OTHER,)
        out[cut] = out.get(cut, 0) + count
    return out
