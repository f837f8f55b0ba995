"""The collector's HTTP API and web UI: parse the parameters (params.py), ask the query stage, render."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetprof.collector.query.answers import QueryError, Scope
from fleetprof.collector.query.labels import Notes
from fleetprof.collector.query.limits import DEFAULT_LISTED, DEFAULT_MAX_NODES, MAX_LISTED, MAX_NODES
from fleetprof.collector.query.series import SeriesError, auto_step, check_step
from fleetprof.collector.query.service import QueryService, comparison
from fleetprof.collector.render.diff import SORTS, function_diff, limit_pair, render_diff_svg
from fleetprof.collector.render.grafana import diff_flamegraph_frame, flamegraph_frame
from fleetprof.collector.render.html import render_html
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.pprof import to_pprof
from fleetprof.collector.render.speedscope import to_speedscope
from fleetprof.collector.render.svg import render_svg
from fleetprof.collector.render.tree import to_folded, to_json, top_functions, tree_json_text, truncate
from fleetprof.collector.serve.params import Params
from fleetprof.collector.serve.web import static
from fleetprof.httpserve import HttpError, Request, Response, json_response, text_response

FORMATS = ("json", "folded", "svg", "html", "pprof", "speedscope", "grafana")
DIFF_FORMATS = ("json", "svg", "grafana")
TITLES = {"cpu": "CPU", "offcpu": "Off-CPU", "wall": "Wall-clock"}


class HttpApi:
    """Handlers for /api/v1/*, /metrics and the UI; each turns bad input into HTTP 400 with a message that
    names it."""

    def __init__(
        self,
        query: QueryService,
        registry: CollectorRegistry,
        names: Names = as_stored,
        clock: Callable[[], float] = time.time,
    ):
        self._query = query
        self._registry = registry
        self._names = names  # the collector's Demangler's display_name
        self._clock = clock

    def routes(self) -> dict[str, Callable[[Request], Response]]:
        return {
            "/api/v1/profile": self.profile,
            "/api/v1/top": self.top,
            "/api/v1/diff": self.diff,
            "/api/v1/labels": self.labels,
            "/api/v1/syscalls": self.syscalls,
            "/api/v1/gpus": self.gpus,
            "/api/v1/series": self.series,
            "/metrics": self.metrics,
            "/healthz": lambda _r: json_response({"status": "ok"}),
            "/": static,
            "/ui": static,
            "/ui/": static,
        }

    def prefixes(self) -> dict[str, Callable[[Request], Response]]:
        return {"/api/v1/labels/": self.label_values, "/ui/": static, "/app.": static}

    def _params(self, req: Request) -> Params:
        return Params(req, self._clock())

    # -- profiles ------------------------------------------------------------------------------------
    def profile(self, req: Request) -> Response:
        p = self._params(req)
        fmt = p.choice("format", FORMATS, "json")
        max_nodes = p.whole_number("max_nodes", DEFAULT_MAX_NODES, 1, MAX_NODES)
        scope = p.scope()
        sel = self._query.profile(scope)
        if fmt == "folded":  # the raw interface: never truncated (offcpu and wall count nanoseconds)
            return text_response(to_folded(sel.stacks, self._names))
        kind, total, freq = scope.kind, sel.total, sel.frequency_hz
        stacks = truncate(sel.stacks, max_nodes)
        amount = f"{total} samples" if kind == "cpu" else f"{total / 1e9:.3f} s {kind}"
        description = f"{scope.selector} · {_fmt_time(scope.start)} – {_fmt_time(scope.end)} · {amount}"
        look = {"title": f"{TITLES[kind]} flame graph", "unit": "samples" if kind == "cpu" else "ns"}
        look["names"] = self._names
        if fmt == "svg":
            svg = render_svg(stacks, subtitle=description, frequency_hz=freq, **look)
            return Response(svg.encode(), "image/svg+xml")
        if fmt == "html":
            html = render_html(stacks, subtitle=description, frequency_hz=freq, **look)
            return text_response(html, "text/html; charset=utf-8")
        if fmt == "pprof":
            ns = None if kind == "cpu" else kind
            comments = (f"fleetprof {description}",)
            body = to_pprof(stacks, freq, scope.start, scope.end, comments, ns, self._names)
            headers = {"Content-Disposition": 'attachment; filename="profile.pb.gz"'}
            return Response(body, "application/octet-stream", headers=headers)
        if fmt == "speedscope":
            return json_response(to_speedscope(stacks, freq, f"fleetprof {description}", self._names))
        if fmt == "grafana":
            return json_response(flamegraph_frame(stacks, str(scope.selector), self._names))
        body = to_json(stacks, total_samples=total, frequency_hz=freq, names=self._names)
        body["from"], body["until"], body["query"] = scope.start, scope.end, str(scope.selector)
        body["type"], body["unit"] = kind, scope.unit
        body.update(_notes(self._query.notes(scope, total)))
        return Response(tree_json_text(body).encode(), "application/json")

    def diff(self, req: Request) -> Response:
        """Baseline (query, from/until/since) against comparison (query2, from2/until2/since2).

        Each comparison parameter left out takes the baseline's: query2 defaults to query, and without
        any of from2/until2/since2 the comparison covers the baseline's time range.
        """
        p = self._params(req)
        fmt = p.choice("format", DIFF_FORMATS, "json")
        sort = p.choice("sort", SORTS, "self")
        lines = p.lines()
        limit = p.whole_number("limit", 50, 1, 10_000)
        max_nodes = p.whole_number("max_nodes", DEFAULT_MAX_NODES, 1, MAX_NODES)
        selector = p.selector()
        start, end = p.time_range()
        selector2 = p.selector("query2") if p.given("query2") else None
        span2 = p.time_range("2") if p.given("from2", "until2", "since2") else None
        try:
            selector2, (start2, end2) = comparison(selector, (start, end), selector2, span2)
        except QueryError as err:
            raise HttpError(400, str(err)) from None
        kind, threads = p.typed()
        d = self._query.diff(
            Scope(selector, start, end, kind, threads), Scope(selector2, start2, end2, kind, threads)
        )
        base, comp = d.base, d.comp
        if fmt == "json":
            body: dict = {
                name: {
                    "query": str(scope.selector),
                    "from": scope.start,
                    "until": scope.end,
                    "total": picked.total,
                    "frequency_hz": picked.frequency_hz,
                }
                for name, scope, picked in (
                    ("baseline", d.baseline, base),
                    ("comparison", d.comparison, comp),
                )
            }
            body["sort"], body["lines"] = sort, lines
            body["type"], body["unit"] = kind, d.baseline.unit
            per_side, body["warnings"] = self._query.diff_notes(d)
            for name, side_notes in per_side.items():
                body[name]["empty_reason"] = side_notes.empty_reason
            body["functions"] = function_diff(base.stacks, comp.stacks, limit, sort, lines, self._names)
            return json_response(body)
        base_stacks, comp_stacks = limit_pair(base.stacks, comp.stacks, max_nodes)
        b, c = d.baseline, d.comparison
        if fmt == "grafana":
            return json_response(
                diff_flamegraph_frame(base_stacks, comp_stacks, f"{b.selector} vs {c.selector}", self._names)
            )
        subtitle = (
            f"baseline {b.selector} {_fmt_time(b.start)} – {_fmt_time(b.end)} ({base.total}) vs "
            f"{c.selector} {_fmt_time(c.start)} – {_fmt_time(c.end)} ({comp.total})"
        )
        svg = render_diff_svg(
            base_stacks,
            comp_stacks,
            title=f"{TITLES[kind]} diff flame graph",
            subtitle=subtitle,
            unit="" if kind == "cpu" else "ns",
            names=self._names,
        )
        return Response(svg.encode(), "image/svg+xml")

    def top(self, req: Request) -> Response:
        p = self._params(req)
        limit = p.whole_number("limit", 20, 1, 10_000)
        if p.given("by"):
            return self._top_groups(p, limit)
        sort = p.choice("sort", SORTS, "self")
        lines = p.lines()
        scope = p.scope()
        sel = self._query.profile(scope)
        return json_response(
            {
                "sort": sort,
                "lines": lines,
                "type": scope.kind,
                "unit": scope.unit,
                "total": sel.total,
                "frequency_hz": sel.frequency_hz,
                "from": scope.start,
                "until": scope.end,
                "query": str(scope.selector),
                "functions": top_functions(sel.stacks, limit, sort, lines, self._names),
                **_notes(self._query.notes(scope, sel.total)),
            }
        )

    def _top_groups(self, p: Params, limit: int) -> Response:
        """The label-value groups (e.g. pods) burning the most CPU: /api/v1/top?by=namespace,pod."""
        by = p.by()
        scope = p.scope()
        answer = self._query.top_groups(scope, by, limit)
        freq = answer.frequency_hz
        return json_response(
            {
                **_notes(self._query.notes(scope, answer.total, by)),
                "type": scope.kind,
                "unit": scope.unit,
                "by": by,
                "total": answer.total,
                "frequency_hz": freq,
                "from": scope.start,
                "until": scope.end,
                "query": str(scope.selector),
                "groups": [
                    {
                        "labels": g.labels,
                        # samples (type=cpu) or nanoseconds (offcpu, wall): see "unit"
                        "value": g.value,
                        "seconds": g.seconds,
                        "pct": g.pct,
                        # the CPU view's names, kept for its readers
                        **({"samples": g.value, "cpu_seconds": g.seconds} if scope.kind == "cpu" else {}),
                    }
                    for g in answer.groups
                ],
            }
        )

    def series(self, req: Request) -> Response:
        """Samples over time per group (`by`, default none: one line): the chart above the flame graph.
        `step` in seconds (default: about 240 points over the range); the `limit` largest series."""
        p = self._params(req)
        selector = p.selector()
        start, end = p.time_range()
        by = p.by() if p.get("by") else []
        limit = p.whole_number("limit", 10, 1, 1_000)
        raw = p.get("step")
        try:
            step = check_step(float(raw), start, end) if raw else auto_step(start, end)
        except ValueError as err:
            message = str(err) if isinstance(err, SeriesError) else f'"step" must be a number, got {raw!r}'
            raise HttpError(400, message) from None
        scope = Scope(selector, start, end, *p.typed())
        answer = self._query.series(scope, step, by, limit)
        body = {
            **_notes(self._query.notes(scope, answer.total, by)),
            "type": scope.kind,
            "unit": scope.unit,
            "query": str(selector),
            "from": start,
            "until": end,
            "step": step,
            "by": by,
            "frequency_hz": answer.frequency_hz,
            "series": [
                {"labels": line.labels, "total": line.total, "points": [[t, n] for t, n in line.points]}
                for line in answer.lines
            ],
        }
        return json_response(body)

    # -- GPUs and syscalls ---------------------------------------------------------------------------
    def gpus(self, req: Request) -> Response:
        """Per pod on a GPU: utilization, memory, idle fraction, and the hottest functions while its GPUs
        sat idle: as `type` counts them (cpu by default), and in wall time (active threads). `query`
        selects on node, namespace, pod, container and gpu."""
        p = self._params(req)
        limit = p.whole_number("limit", 50, 1, 10_000)
        functions = p.whole_number("functions", 5, 0, 100)
        selector = p.selector()
        start, end = p.time_range()
        scope = Scope(selector, start, end, *p.typed())
        pods = []
        for r in self._query.gpu_report(scope, limit, functions > 0):
            pods.append(
                {
                    "namespace": r.namespace,
                    "pod": r.pod,
                    "gpus": r.gpus,
                    "utilization_ratio": r.utilization_ratio,
                    "memory_used_bytes": r.memory_used_bytes,
                    "idle_ratio": r.idle_ratio,
                    "seconds": r.seconds,
                    "cpu_samples_gpu_idle": r.cpu_samples_gpu_idle,
                    "cpu_samples_gpu_busy": r.cpu_samples_gpu_busy,
                    # without `functions` the stacks are empty, and so are their lists
                    "idle_top_functions": top_functions(r.idle_stacks, functions, names=self._names),
                    "idle_wall_seconds": r.idle_wall_seconds,
                    "idle_wall_top_functions": top_functions(
                        r.idle_wall_stacks, functions, names=self._names
                    ),
                }
            )
        body = {"from": start, "until": end, "query": str(selector), "type": scope.kind, "unit": scope.unit}
        return json_response({**body, "pods": pods})

    def syscalls(self, req: Request) -> Response:
        """Syscalls for a selection grouped by `by` (default syscall; e.g. by=pod or by=pod,syscall)."""
        p = self._params(req)
        limit = p.whole_number("limit", 50, 1, 10_000)
        by = p.by(default="syscall")
        sort = p.get("sort", "time")
        if sort not in ("time", "count"):
            raise HttpError(400, f'"sort" must be "time" or "count", got {sort!r}')
        selector = p.selector()
        start, end = p.time_range()
        rows, total = self._query.syscalls(Scope(selector, start, end), by, sort, limit)
        body = {"by": by, "from": start, "until": end, "query": str(selector)}
        return json_response({**body, "syscalls": [asdict(r) for r in rows], "total_count": total})

    # -- labels --------------------------------------------------------------------------------------
    def labels(self, req: Request) -> Response:
        """Label names with data (in range; of the label sets `match[]` selects), at most `limit`."""
        p = self._params(req)
        start, end = p.optional_range()
        limit = p.whole_number("limit", DEFAULT_LISTED, 1, MAX_LISTED)
        names = self._query.label_names(start, end, p.match(), limit)
        return json_response({"labels": names.values, "truncated": names.truncated})

    def label_values(self, req: Request) -> Response:
        """A label's values (in range; of the label sets `match[]` selects), sorted, the first `limit`;
        `truncated` says there were more."""
        rest = req.path[len("/api/v1/labels/") :]
        name, sep, tail = rest.partition("/")
        if not sep or tail != "values" or not name:
            raise HttpError(404, f"no such endpoint: {req.path} (use /api/v1/labels/NAME/values)")
        p = self._params(req)
        start, end = p.optional_range()
        limit = p.whole_number("limit", DEFAULT_LISTED, 1, MAX_LISTED)
        values = self._query.label_values(name, start, end, p.match(), limit)
        return json_response({"name": name, "values": values.values, "truncated": values.truncated})

    def metrics(self, _req: Request) -> Response:
        return Response(generate_latest(self._registry), CONTENT_TYPE_LATEST)


def _notes(notes: Notes) -> dict:
    return {"warnings": notes.warnings, "empty_reason": notes.empty_reason}


def _fmt_time(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a time the platform's calendar cannot show
        return f"{t:.0f} unix seconds"
