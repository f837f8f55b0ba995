"""The collector's HTTP API and web UI: parse query parameters, select from the store, render."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from collector.query.selector import Selector, SelectorError, parse_selector
from collector.query.timerange import TimeRangeError, resolve_range
from collector.render.svg import render_svg
from collector.render.tree import to_folded, to_json, top_functions, truncate
from collector.store.base import ProfileStore, Selection
from fleetprof.httpserve import HttpError, Request, Response, json_response, text_response

WEB_DIR = Path(__file__).parent / "web"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}
DEFAULT_MAX_NODES = 8192
FORMATS = ("json", "folded", "svg")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class QueryApi:
    """Handlers for /api/v1/*; each turns bad input into HTTP 400 with a message that names it."""

    def __init__(
        self, store: ProfileStore, registry: CollectorRegistry, clock: Callable[[], float] = time.time
    ):
        self._store = store
        self._registry = registry
        self._clock = clock

    def routes(self) -> dict[str, Callable[[Request], Response]]:
        return {
            "/api/v1/profile": self.profile,
            "/api/v1/top": self.top,
            "/api/v1/labels": self.labels,
            "/api/v1/syscalls": self.syscalls,
            "/metrics": self.metrics,
            "/healthz": lambda _r: json_response({"status": "ok"}),
            "/": self.static,
            "/ui": self.static,
            "/ui/": self.static,
        }

    def prefixes(self) -> dict[str, Callable[[Request], Response]]:
        return {"/api/v1/labels/": self.label_values, "/ui/": self.static, "/app.": self.static}

    # -- parameters ------------------------------------------------------------------------------
    def _selector(self, req: Request) -> Selector:
        try:
            return parse_selector(req.param("query", "{}") or "{}")
        except SelectorError as err:
            raise HttpError(400, str(err)) from err

    def _range(self, req: Request) -> tuple[float, float]:
        try:
            return resolve_range(req.param("from"), req.param("until"), req.param("since"), self._clock())
        except TimeRangeError as err:
            raise HttpError(400, str(err)) from err

    @staticmethod
    def _int(req: Request, name: str, default: int, lo: int, hi: int) -> int:
        raw = req.param(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise HttpError(400, f'"{name}" must be a whole number, got {raw!r}') from None
        if not lo <= value <= hi:
            raise HttpError(400, f'"{name}" must be between {lo} and {hi}, got {value}')
        return value

    def _select(self, req: Request) -> tuple[Selection, Selector, float, float]:
        selector = self._selector(req)
        start, end = self._range(req)
        return self._store.select(selector, start, end), selector, start, end

    # -- endpoints -------------------------------------------------------------------------------
    def profile(self, req: Request) -> Response:
        fmt = req.param("format", "json")
        if fmt not in FORMATS:
            raise HttpError(400, f'"format" must be one of {", ".join(FORMATS)}, got {fmt!r}')
        max_nodes = self._int(req, "max_nodes", DEFAULT_MAX_NODES, 1, 1_000_000)
        sel, selector, start, end = self._select(req)
        stacks = sel.stacks
        if fmt == "folded":
            return text_response(to_folded(stacks))
        total = sel.total
        if len(stacks) > max_nodes:
            stacks = truncate(stacks, max_nodes)
        if fmt == "svg":
            subtitle = f"{selector} · {_fmt_time(start)} – {_fmt_time(end)} · {total} samples"
            svg = render_svg(stacks, subtitle=subtitle, frequency_hz=sel.frequency_hz)
            return Response(svg.encode(), "image/svg+xml")
        body = to_json(stacks, total_samples=total, frequency_hz=sel.frequency_hz)
        body["from"], body["until"], body["query"] = start, end, str(selector)
        return json_response(body)

    def top(self, req: Request) -> Response:
        limit = self._int(req, "limit", 20, 1, 10_000)
        if req.param("by") is not None:
            return self._top_groups(req, limit)
        sel, selector, start, end = self._select(req)
        return json_response(
            {
                "total": sel.total,
                "frequency_hz": sel.frequency_hz,
                "from": start,
                "until": end,
                "query": str(selector),
                "functions": top_functions(sel.stacks, limit),
            }
        )

    def _top_groups(self, req: Request, limit: int) -> Response:
        """The label-value groups (e.g. pods) burning the most CPU: /api/v1/top?by=namespace,pod."""
        by = [b.strip() for b in (req.param("by") or "").split(",")]
        bad = [b for b in by if not _LABEL_NAME.fullmatch(b)]
        if bad or not by:
            raise HttpError(
                400, f'"by" must be a comma-separated list of label names, got {req.param("by")!r}'
            )
        selector = self._selector(req)
        start, end = self._range(req)
        grouped = self._store.group(selector, start, end, by)
        total = sum(grouped.totals.values())
        freq = grouped.frequency_hz
        rows = sorted(grouped.totals.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        return json_response(
            {
                "by": by,
                "total": total,
                "frequency_hz": freq,
                "from": start,
                "until": end,
                "query": str(selector),
                "groups": [
                    {
                        "labels": dict(zip(by, values, strict=True)),
                        "samples": n,
                        "pct": round(100.0 * n / total, 2) if total else 0.0,
                        "cpu_seconds": round(n / freq, 3) if freq else None,
                    }
                    for values, n in rows
                ],
            }
        )

    def syscalls(self, req: Request) -> Response:
        """Syscalls for a selection grouped by `by` (default syscall; e.g. by=pod or by=pod,syscall)."""
        limit = self._int(req, "limit", 50, 1, 10_000)
        by = self._by(req, default="syscall")
        sort = req.param("sort", "time")
        if sort not in ("time", "count"):
            raise HttpError(400, f'"sort" must be "time" or "count", got {sort!r}')
        selector = self._selector(req)
        start, end = self._range(req)
        groups = self._store.syscalls(selector, start, end, by)
        duration = max(end - start, 1e-9)
        rows = []
        for values, agg in groups.items():
            p50, p99 = agg.quantile_ns(0.5), agg.quantile_ns(0.99)
            rows.append(
                {
                    "labels": dict(zip(by, values, strict=True)),
                    "count": agg.count,
                    "rate_per_second": round(agg.count / duration, 3),
                    "timed": agg.timed,
                    "total_seconds": round(agg.estimated_ns / 1e9, 6),
                    "mean_seconds": round(agg.timed_ns / agg.timed / 1e9, 9) if agg.timed else None,
                    "p50_seconds": round(p50 / 1e9, 9) if p50 is not None else None,
                    "p99_seconds": round(p99 / 1e9, 9) if p99 is not None else None,
                }
            )
        key = (lambda r: (-r["total_seconds"], -r["count"])) if sort == "time" else (lambda r: (-r["count"],))
        rows.sort(key=key)
        body = {"by": by, "from": start, "until": end, "query": str(selector), "syscalls": rows[:limit]}
        body["total_count"] = sum(a.count for a in groups.values())
        return json_response(body)

    def _by(self, req: Request, default: str) -> list[str]:
        by = [b.strip() for b in (req.param("by") or default).split(",")]
        if not by or any(not _LABEL_NAME.fullmatch(b) for b in by):
            raise HttpError(
                400, f'"by" must be a comma-separated list of label names, got {req.param("by")!r}'
            )
        return by

    def labels(self, req: Request) -> Response:
        start, end = self._optional_range(req)
        return json_response({"labels": self._store.label_names(start, end)})

    def label_values(self, req: Request) -> Response:
        rest = req.path[len("/api/v1/labels/") :]
        name, sep, tail = rest.partition("/")
        if not sep or tail != "values" or not name:
            raise HttpError(404, f"no such endpoint: {req.path} (use /api/v1/labels/NAME/values)")
        start, end = self._optional_range(req)
        return json_response({"name": name, "values": self._store.label_values(name, start, end)})

    def _optional_range(self, req: Request) -> tuple[float | None, float | None]:
        if req.param("from") is None and req.param("until") is None and req.param("since") is None:
            return None, None
        return self._range(req)

    def metrics(self, _req: Request) -> Response:
        return Response(generate_latest(self._registry), CONTENT_TYPE_LATEST)

    def static(self, req: Request) -> Response:
        name = req.path.rsplit("/", 1)[-1] or "index.html"
        if req.path in ("/ui",):
            name = "index.html"
        path = WEB_DIR / name
        if "/" in name or name.startswith(".") or not path.is_file() or path.suffix not in _CONTENT_TYPES:
            raise HttpError(404, f"no such page: {req.path}")
        return Response(path.read_bytes(), _CONTENT_TYPES[path.suffix])


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
