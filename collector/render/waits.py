"""The ranking of waits as rows: where threads blocked in their own code and why (query/waits.py reads
each stack), for /api/v1/top's off-CPU and wall answers."""

from __future__ import annotations

from collections.abc import Mapping

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import PythonFunctions, function_fields


def top_waits(
    waits: Mapping[tuple[FrameKey, str], int], limit: int = 20, lines: bool = False, names: Names = as_stored
) -> list[dict]:
    """The heaviest (frame, reason) pairs: one row per function and reason, its value and share of all.
    A Python function's lines are one row unless `lines` (the row lists them as "lines"), as in
    top_functions()."""
    functions = None if lines else PythonFunctions()
    merged: dict[tuple[FrameKey, str], int] = {}
    for (frame, reason), value in waits.items():
        key = (functions(frame) if functions else frame, reason)
        merged[key] = merged.get(key, 0) + value
    total = sum(merged.values())
    ranked = sorted(
        merged,
        key=lambda k: (-merged[k], names(k[0].function), k[0].function, k[0].module, k[0].kernel, k[1]),
    )
    rows = []
    for frame, reason in ranked[: max(limit, 0)]:
        value = merged[frame, reason]
        rows.append(
            {
                **function_fields(frame, names),
                "module": frame.module,
                "kernel": frame.kernel,
                "reason": reason,
                "value": value,
                "pct": round(100.0 * value / total, 2) if total else 0.0,
                **(
                    {"lines": sorted(functions.lines[frame])}
                    if functions and frame in functions.lines
                    else {}
                ),
            }
        )
    return rows
