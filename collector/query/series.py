"""Profiles over time: the step a range gets, its bounds, and the top series of a TimeSeries, for the UI's
chart (/api/v1/series) and Grafana's SelectSeries alike."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleetprof.collector.model.rows import BUCKET_S, TimeSeries

MAX_POINTS = 11_000  # per series, as Prometheus' query_range
AUTO_POINTS = 240  # what a chart across a screen needs


class SeriesError(ValueError):
    """A step or a limit that cannot be served; the message names it."""


def auto_step(start: float, end: float) -> float:
    """About AUTO_POINTS points over the range, in whole buckets."""
    return float(max(BUCKET_S, math.ceil((end - start) / AUTO_POINTS / BUCKET_S) * BUCKET_S))


def check_step(step_s: float, start: float, end: float) -> float:
    """The step to serve: `step_s` rounded up to whole buckets, so every point sums as many buckets (a
    15 s step over 10 s buckets alternated one and two)."""
    if not math.isfinite(step_s) or step_s <= 0:
        raise SeriesError(f"step must be a positive number of seconds, got {step_s:g}")
    step_s = float(math.ceil(step_s / BUCKET_S) * BUCKET_S)
    if (end - start) / step_s > MAX_POINTS:
        raise SeriesError(
            f"step {step_s:g} s makes more than {MAX_POINTS:,} points over {end - start:g} s: "
            "use a longer step"
        )
    return step_s


@dataclass(frozen=True)
class Line:
    labels: dict[str, str]  # the group-by labels, those with a value
    total: int
    points: list[tuple[float, int]]  # (step start in seconds, samples), in time order


def top_lines(ts: TimeSeries, limit: int | None) -> list[Line]:
    """The series with the most samples first (ties by labels), at most `limit` of them (None: all)."""
    lines = [
        Line(
            {k: v for k, v in zip(ts.by, key, strict=True) if v},
            sum(points.values()),
            sorted(points.items()),
        )
        for key, points in ts.points.items()
    ]
    lines.sort(key=lambda line: (-line.total, sorted(line.labels.items())))
    return lines if limit is None else lines[:limit]
