"""The collector's HTTP API and web UI: parse query parameters, select from the store, render."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetprof.collector.model.profile import GPU_STATE_NAME, Stacks, internal_label
from fleetprof.collector.model.rows import Selection
from fleetprof.collector.model.selector import Matcher, Selector, SelectorError
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.series import SeriesError, auto_step, check_step, top_lines
from fleetprof.collector.query.timerange import TimeRangeError, resolve_range
from fleetprof.collector.query.typed import DEFAULT_THREADS, THREADS, TYPES, UNITS, TypedStore
from fleetprof.collector.render.diff import SORTS, function_diff, limit_pair, render_diff_svg
from fleetprof.collector.render.grafana import diff_flamegraph_frame, flamegraph_frame
from fleetprof.collector.render.html import render_html
from fleetprof.collector.render.pprof import to_pprof
from fleetprof.collector.render.speedscope import to_speedscope
from fleetprof.collector.render.svg import render_svg
from fleetprof.collector.render.tree import to_folded, to_json, top_functions, tree_json_text, truncate
from fleetprof.collector.store.base import ProfileStore
from fleetprof.collector.store.gpu_usage import GpuUsageLog
from fleetprof.httpserve import HttpError, Request, Response, json_response, text_response

WEB_DIR = Path(__file__).parent.parent / "web"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}
# Enough for every frame wider than ~0.5 px of a 1200 px graph in practice, small enough that a browser
# draws it at once; the long tail of each kept frame is merged into one "other" frame.
DEFAULT_MAX_NODES = 2048
FORMATS = ("json", "folded", "svg", "html", "pprof", "speedscope", "grafana")
DIFF_FORMATS = ("json", "svg", "grafana")
TITLES = {"cpu": "CPU", "offcpu": "Off-CPU", "wall": "Wall-clock"}
# Label names and values listed per request unless `limit` asks for more (at most MAX_LISTED): one node's
# labels are capped at ingest (ingest/quota.py), a fleet's are not, and a listing answered 200 MB once.
DEFAULT_LISTED = 1_000
MAX_LISTED = 10_000
MAX_MATCH = 16  # match[] selectors per listing
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Grouped by pod, a process without one (a host process: no Kubernetes, or outside any pod) is grouped by
# its comm, as "comm:NAME" in the pod column, rather than all of them as one empty pod.
POD = "pod"
HOST_GROUP_PREFIX = "comm:"


class QueryApi:
    """Handlers for /api/v1/*; each turns bad input into HTTP 400 with a message that names it."""

    def __init__(
        self,
        store: ProfileStore,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
        gpu_usage: GpuUsageLog | None = None,
    ):
        self._store = store
        self._registry = registry
        self._clock = clock
        self._gpu_usage = gpu_usage or GpuUsageLog()

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
            "/": self.static,
            "/ui": self.static,
            "/ui/": self.static,
        }

    def prefixes(self) -> dict[str, Callable[[Request], Response]]:
        return {"/api/v1/labels/": self.label_values, "/ui/": self.static, "/app.": self.static}

    # -- parameters ------------------------------------------------------------------------------
    def _selector(self, req: Request, name: str = "query") -> Selector:
        try:
            selector = parse_selector(req.param(name, "{}") or "{}")
        except SelectorError as err:
            raise HttpError(400, f'bad "{name}": {err}' if name != "query" else str(err)) from err
        # gpu=idle|busy: only CPU samples taken while the process's GPUs were idle (busy). The same
        # parameter (gpu2 for a diff's comparison side) works wherever a selector does.
        gpu_param = "gpu" if name == "query" else f"gpu{name.removeprefix('query')}"
        gpu = req.param(gpu_param)
        if gpu:
            if gpu not in ("idle", "busy"):
                raise HttpError(400, f'"{gpu_param}" must be "idle" or "busy", got {gpu!r}')
            selector = Selector((*selector.matchers, Matcher(GPU_STATE_NAME, "=", gpu)))
        return selector

    def _range(self, req: Request, suffix: str = "", now: float | None = None) -> tuple[float, float]:
        """from/until/since, or from2/until2/since2 with suffix "2" (the diff's comparison); `now`: the
        clock reading both of a diff's ranges are resolved against, so "now-15m" means one time."""
        names = [f"{p}{suffix}" for p in ("from", "until", "since")]
        try:
            start, end = resolve_range(*(req.param(n) for n in names), self._clock() if now is None else now)
        except TimeRangeError as err:
            message = str(err)
            if suffix:  # name the parameters as the user spelled them
                for plain, named in zip(("from", "until", "since"), names, strict=True):
                    message = message.replace(f'"{plain}"', f'"{named}"')
            raise HttpError(400, message) from err
        return start, end

    @staticmethod
    def _choice(req: Request, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = req.param(name, default)
        if value not in allowed:
            raise HttpError(400, f'"{name}" must be one of {", ".join(allowed)}, got {value!r}')
        return value

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

    @staticmethod
    def _lines(req: Request) -> bool:
        """lines=1: rank a Python function's lines apart (by default they are one function's row)."""
        raw = req.param("lines", "0")
        if raw not in ("0", "1", "true", "false"):
            raise HttpError(400, f'"lines" must be 0 or 1, got {raw!r}')
        return raw in ("1", "true")

    def _labels_known(self, start: float, end: float) -> list[str]:
        return [n for n in self._store.label_names(start, end) if not internal_label(n)]

    @staticmethod
    def _label_warnings(names: list[str], by: tuple[str, ...], known: list[str]) -> list[str]:
        """Warnings for the label names a query uses (its selectors', then `by`) that no series in the range
        has, naming the labels there are (`known`: empty when the range holds nothing, then none)."""
        there = f"the labels in this range: {', '.join(known)}"
        out = []
        for name in dict.fromkeys(names):
            if not known or name in known:
                continue
            if name == GPU_STATE_NAME:
                out.append(f"no series in this range has a GPU state (gpu= needs processes on GPUs); {there}")
            elif name == POD and name in by:
                out.append(
                    'no series in this range has the label "pod" (no Kubernetes metadata?): processes'
                    f" without a pod are grouped as {HOST_GROUP_PREFIX}NAME; {there}"
                )
            else:
                out.append(f'no series in this range has the label "{name}"; {there}')
        return out

    def _answer_notes(
        self, total: int, selector: Selector, start: float, end: float, by: tuple[str, ...] = ()
    ) -> dict:
        """The "warnings" and "empty_reason" fields of a JSON answer: label names the selector or `by` use
        that no series in the range has (a typo, or a label this fleet lacks: no Kubernetes metadata), and
        why an empty answer is empty: "no_match" (the range holds data, the selector matched none of it)
        or "no_data" (nothing stored in the range). The range's labels are read only when the answer is
        empty or grouped: a selector that matched something needs no check (a missing label can match
        only with `!=`, `!~` or an empty value), and most queries pay nothing."""
        names = [m.name for m in selector.matchers if not internal_label(m.name)]
        if not by and (total or not names):
            return {"warnings": [], "empty_reason": None if total else "no_data"}
        known = self._labels_known(start, end)
        warnings = self._label_warnings(names + list(by), by, known)
        reason = None if total else "no_match" if names and known else "no_data"
        if reason == "no_match":
            warnings.append(f"the selector {selector} matched nothing in this range, which holds other data")
        return {"warnings": warnings, "empty_reason": reason}

    def _typed(self, req: Request) -> TypedStore:
        """The store as the request's `type` (cpu, offcpu, wall) and `threads` (active, all; the type's
        default when absent) count it."""
        kind = self._choice(req, "type", TYPES, "cpu")
        return TypedStore(self._store, kind, self._choice(req, "threads", THREADS, DEFAULT_THREADS[kind]))

    def _select(self, req: Request) -> tuple[Selection, Selector, float, float]:
        typed = self._typed(req)
        selector = self._selector(req)
        start, end = self._range(req)
        return typed.select(selector, start, end), selector, start, end

    # -- endpoints -------------------------------------------------------------------------------
    def profile(self, req: Request) -> Response:
        fmt = self._choice(req, "format", FORMATS, "json")
        max_nodes = self._int(req, "max_nodes", DEFAULT_MAX_NODES, 1, 1_000_000)
        kind = self._choice(req, "type", TYPES, "cpu")
        sel, selector, start, end = self._select(req)
        stacks: Stacks = sel.stacks
        if fmt == "folded":  # the raw interface: never truncated (offcpu and wall count nanoseconds)
            return text_response(to_folded(stacks))
        total, freq = sel.total, sel.frequency_hz
        stacks = truncate(stacks, max_nodes)
        amount = f"{total} samples" if kind == "cpu" else f"{total / 1e9:.3f} s {kind}"
        description = f"{selector} · {_fmt_time(start)} – {_fmt_time(end)} · {amount}"
        look = {"title": f"{TITLES[kind]} flame graph", "unit": "samples" if kind == "cpu" else "ns"}
        if fmt == "svg":
            svg = render_svg(stacks, subtitle=description, frequency_hz=freq, **look)
            return Response(svg.encode(), "image/svg+xml")
        if fmt == "html":
            html = render_html(stacks, subtitle=description, frequency_hz=freq, **look)
            return text_response(html, "text/html; charset=utf-8")
        if fmt == "pprof":
            ns = None if kind == "cpu" else kind
            body = to_pprof(stacks, freq, start, end, comments=(f"fleetprof {description}",), nanoseconds=ns)
            headers = {"Content-Disposition": 'attachment; filename="profile.pb.gz"'}
            return Response(body, "application/octet-stream", headers=headers)
        if fmt == "speedscope":
            return json_response(to_speedscope(stacks, freq, name=f"fleetprof {description}"))
        if fmt == "grafana":
            return json_response(flamegraph_frame(stacks, name=str(selector)))
        body = to_json(stacks, total_samples=total, frequency_hz=freq)
        body["from"], body["until"], body["query"] = start, end, str(selector)
        body["type"], body["unit"] = kind, UNITS[kind]
        body.update(self._answer_notes(total, selector, start, end))
        return Response(tree_json_text(body).encode(), "application/json")

    def diff(self, req: Request) -> Response:
        """Baseline (query, from/until/since) against comparison (query2, from2/until2/since2).

        Each comparison parameter left out takes the baseline's: query2 defaults to query, and without
        any of from2/until2/since2 the comparison covers the baseline's time range.
        """
        fmt = self._choice(req, "format", DIFF_FORMATS, "json")
        sort = self._choice(req, "sort", SORTS, "self")
        lines = self._lines(req)
        limit = self._int(req, "limit", 50, 1, 10_000)
        max_nodes = self._int(req, "max_nodes", DEFAULT_MAX_NODES, 1, 1_000_000)
        selector = self._selector(req)
        now = self._clock()
        start, end = self._range(req, now=now)
        selector2 = self._selector(req, "query2") if req.param("query2") is not None else selector
        if any(req.param(p) is not None for p in ("from2", "until2", "since2")):
            start2, end2 = self._range(req, "2", now=now)
        else:
            start2, end2 = start, end
        if str(selector2) == str(selector) and (start2, end2) == (start, end):
            raise HttpError(
                400,
                "the comparison is the same selection as the baseline: give a different "
                '"query2", or a second time range with "from2"/"until2"/"since2"',
            )
        typed = self._typed(req)
        base = typed.select(selector, start, end)
        comp = typed.select(selector2, start2, end2)
        sides = {
            "baseline": (selector, start, end, base),
            "comparison": (selector2, start2, end2, comp),
        }
        if fmt == "json":
            body: dict = {
                name: {
                    "query": str(sel_),
                    "from": s_,
                    "until": e_,
                    "total": picked.total,
                    "frequency_hz": picked.frequency_hz,
                }
                for name, (sel_, s_, e_, picked) in sides.items()
            }
            body["sort"], body["lines"] = sort, lines
            body["type"], body["unit"] = typed.kind, typed.unit
            body["warnings"] = []
            for name, (sel_, s_, e_, picked) in sides.items():
                notes = self._answer_notes(picked.total, sel_, s_, e_)
                body[name]["empty_reason"] = notes["empty_reason"]
                for warning in notes["warnings"]:
                    text = warning.replace("the selector", f"the {name} selector", 1)
                    if text not in body["warnings"]:
                        body["warnings"].append(text)
            body["functions"] = function_diff(base.stacks, comp.stacks, limit, sort, lines)
            return json_response(body)
        base_stacks, comp_stacks = limit_pair(base.stacks, comp.stacks, max_nodes)
        if fmt == "grafana":
            return json_response(
                diff_flamegraph_frame(base_stacks, comp_stacks, name=f"{selector} vs {selector2}")
            )
        subtitle = (
            f"baseline {selector} {_fmt_time(start)} – {_fmt_time(end)} ({base.total}) vs "
            f"{selector2} {_fmt_time(start2)} – {_fmt_time(end2)} ({comp.total})"
        )
        svg = render_diff_svg(
            base_stacks,
            comp_stacks,
            title=f"{TITLES[typed.kind]} diff flame graph",
            subtitle=subtitle,
            unit="" if typed.kind == "cpu" else "ns",
        )
        return Response(svg.encode(), "image/svg+xml")

    def top(self, req: Request) -> Response:
        limit = self._int(req, "limit", 20, 1, 10_000)
        if req.param("by") is not None:
            return self._top_groups(req, limit)
        sort = self._choice(req, "sort", SORTS, "self")
        lines = self._lines(req)
        kind = self._choice(req, "type", TYPES, "cpu")
        sel, selector, start, end = self._select(req)
        return json_response(
            {
                "sort": sort,
                "lines": lines,
                "type": kind,
                "unit": UNITS[kind],
                "total": sel.total,
                "frequency_hz": sel.frequency_hz,
                "from": start,
                "until": end,
                "query": str(selector),
                "functions": top_functions(sel.stacks, limit, sort, lines),
                **self._answer_notes(sel.total, selector, start, end),
            }
        )

    def series(self, req: Request) -> Response:
        """Samples over time per group (`by`, default none: one line): the chart above the flame graph.
        `step` in seconds (default: about 240 points over the range); the `limit` largest series."""
        selector = self._selector(req)
        start, end = self._range(req)
        by = self._by(req, "") if req.param("by") else []
        limit = self._int(req, "limit", 10, 1, 1_000)
        raw = req.param("step")
        try:
            step = check_step(float(raw), start, end) if raw else auto_step(start, end)
        except ValueError as err:
            message = str(err) if isinstance(err, SeriesError) else f'"step" must be a number, got {raw!r}'
            raise HttpError(400, message) from None
        typed = self._typed(req)
        ts = typed.series(selector, start, end, step, by)
        lines = top_lines(ts, limit)
        total = sum(line.total for line in lines)
        body = {
            **self._answer_notes(total, selector, start, end, tuple(by)),
            "type": typed.kind,
            "unit": typed.unit,
            "query": str(selector),
            "from": start,
            "until": end,
            "step": step,
            "by": by,
            "frequency_hz": ts.frequency_hz,
            "series": [
                {"labels": line.labels, "total": line.total, "points": [[t, n] for t, n in line.points]}
                for line in lines
            ],
        }
        return json_response(body)

    def gpus(self, req: Request) -> Response:
        """Per pod on a GPU: utilization, memory, idle fraction, and the hottest functions while its GPUs
        sat idle: as `type` counts them (cpu by default), and in wall time (active threads). `query`
        selects on node, namespace, pod, container and gpu."""
        limit = self._int(req, "limit", 50, 1, 10_000)
        functions = self._int(req, "functions", 5, 0, 100)
        selector = self._selector(req)
        start, end = self._range(req)
        typed, wall = self._typed(req), TypedStore(self._store, "wall")
        tagged = Selector((*selector.matchers, Matcher(GPU_STATE_NAME, "=~", "idle|busy")))
        cpu = TypedStore(self._store).group(tagged, start, end, ["namespace", "pod", GPU_STATE_NAME]).totals
        pods = []
        for p in self._gpu_usage.pods(selector, start, end)[:limit]:
            idle_stacks: Stacks = {}
            wall_stacks: Stacks = {}
            if functions:
                pod_idle = (Matcher("namespace", "=", p.namespace), Matcher("pod", "=", p.pod))
                idle = Selector((*selector.matchers, *pod_idle, Matcher(GPU_STATE_NAME, "=", "idle")))
                idle_stacks = typed.select(idle, start, end).stacks
                # Where the pod's threads spent the idle time, running or waiting (empty without an
                # off-CPU recorder: then it is the CPU time in nanoseconds).
                wall_stacks = wall.select(idle, start, end).stacks
            pods.append(
                {
                    "namespace": p.namespace,
                    "pod": p.pod,
                    "gpus": sorted(p.gpus),
                    "utilization_ratio": _round(p.utilization),
                    "memory_used_bytes": p.memory_bytes,
                    "idle_ratio": _round(p.idle_ratio),
                    "seconds": round(p.seconds, 3),
                    "cpu_samples_gpu_idle": cpu.get((p.namespace, p.pod, "idle"), 0),
                    "cpu_samples_gpu_busy": cpu.get((p.namespace, p.pod, "busy"), 0),
                    "idle_top_functions": top_functions(idle_stacks, functions) if functions else [],
                    "idle_wall_seconds": round(sum(wall_stacks.values()) / 1e9, 3),
                    "idle_wall_top_functions": top_functions(wall_stacks, functions) if functions else [],
                }
            )
        body = {"from": start, "until": end, "query": str(selector), "type": typed.kind, "unit": typed.unit}
        return json_response({**body, "pods": pods})

    def _top_groups(self, req: Request, limit: int) -> Response:
        """The label-value groups (e.g. pods) burning the most CPU: /api/v1/top?by=namespace,pod."""
        by = [b.strip() for b in (req.param("by") or "").split(",")]
        bad = [b for b in by if not _LABEL_NAME.fullmatch(b)]
        if bad or not by:
            raise HttpError(
                400, f'"by" must be a comma-separated list of label names, got {req.param("by")!r}'
            )
        typed = self._typed(req)
        selector = self._selector(req)
        start, end = self._range(req)
        if POD in by and "comm" not in by:
            grouped = typed.group(selector, start, end, [*by, "comm"])
            totals = _host_processes_by_comm(grouped.totals, by)
        else:
            grouped = typed.group(selector, start, end, by)
            totals = grouped.totals
        total = sum(totals.values())
        freq = grouped.frequency_hz
        rows = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        return json_response(
            {
                **self._answer_notes(total, selector, start, end, tuple(by)),
                "type": typed.kind,
                "unit": typed.unit,
                "by": by,
                "total": total,
                "frequency_hz": freq,
                "from": start,
                "until": end,
                "query": str(selector),
                "groups": [
                    {
                        "labels": dict(zip(by, values, strict=True)),
                        # samples (type=cpu) or nanoseconds (offcpu, wall): see "unit"
                        "value": n,
                        "seconds": round(n / freq, 3) if freq else None,
                        "pct": round(100.0 * n / total, 2) if total else 0.0,
                        # the CPU view's names, kept for its readers
                        **(
                            {"samples": n, "cpu_seconds": round(n / freq, 3) if freq else None}
                            if typed.kind == "cpu"
                            else {}
                        ),
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

    def _match(self, req: Request) -> list[Selector]:
        """The `match[]` selectors of a listing (any of them: Prometheus's meaning); none means all."""
        texts = req.params("match[]")
        if len(texts) > MAX_MATCH:
            raise HttpError(400, f'at most {MAX_MATCH} "match[]" selectors, got {len(texts)}')
        try:
            return [parse_selector(t) for t in texts]
        except SelectorError as err:
            raise HttpError(400, f'bad "match[]": {err}') from err

    def labels(self, req: Request) -> Response:
        """Label names with data (in range; of the label sets `match[]` selects), at most `limit`."""
        start, end = self._optional_range(req)
        limit = self._int(req, "limit", DEFAULT_LISTED, 1, MAX_LISTED)
        # __type__ and __thread__ mark off-CPU rows: the API's `type` and `threads` select on them.
        names = [n for n in self._store.label_names(start, end, self._match(req)) if not internal_label(n)]
        return json_response({"labels": names[:limit], "truncated": len(names) > limit})

    def label_values(self, req: Request) -> Response:
        """A label's values (in range; of the label sets `match[]` selects), sorted, the first `limit`;
        `truncated` says there were more."""
        rest = req.path[len("/api/v1/labels/") :]
        name, sep, tail = rest.partition("/")
        if not sep or tail != "values" or not name:
            raise HttpError(404, f"no such endpoint: {req.path} (use /api/v1/labels/NAME/values)")
        start, end = self._optional_range(req)
        limit = self._int(req, "limit", DEFAULT_LISTED, 1, MAX_LISTED)
        values = self._store.label_values(name, start, end, self._match(req))
        return json_response({"name": name, "values": values[:limit], "truncated": len(values) > limit})

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


def _host_processes_by_comm(by_comm: dict[tuple[str, ...], int], by: list[str]) -> dict[tuple[str, ...], int]:
    """Totals grouped by `by` (which holds "pod") from totals grouped by `by` and then comm: a process
    without a pod counts under "comm:NAME" in the pod column, not in one empty pod with every other host
    process; processes in pods are summed over their comms."""
    pod_at = by.index(POD)
    totals: dict[tuple[str, ...], int] = {}
    for values, n in by_comm.items():
        key = list(values[:-1])
        if not key[pod_at]:
            key[pod_at] = HOST_GROUP_PREFIX + values[-1]
        totals[tuple(key)] = totals.get(tuple(key), 0) + n
    return totals


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt_time(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a time the platform's calendar cannot show
        return f"{t:.0f} unix seconds"
