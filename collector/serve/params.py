"""The HTTP API's query parameters, parsed into the query stage's terms; bad input is an HTTP 400 whose
message names the parameter as the user spelled it."""

from __future__ import annotations

from fleetprof.collector.model.selector import LABEL_NAME, Selector, SelectorError
from fleetprof.collector.query.answers import Scope
from fleetprof.collector.query.labels import GPU_STATES, with_gpu_state
from fleetprof.collector.query.limits import MAX_MATCH
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.timerange import TimeRangeError, resolve_range
from fleetprof.collector.query.types import DEFAULT_THREADS, THREADS, TYPES
from fleetprof.httpserve import HttpError, Request


class Params:
    """One request's parameters; times are resolved against one clock reading (`now`), so both of a
    diff's ranges mean the same "now"."""

    def __init__(self, req: Request, now: float):
        self.req = req
        self.now = now

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.req.param(name, default)

    def given(self, *names: str) -> bool:
        return any(self.req.param(n) is not None for n in names)

    def selector(self, name: str = "query") -> Selector:
        """The selector in `name` (default {}), with gpu=idle|busy (gpu2 for query2) as a matcher."""
        try:
            selector = parse_selector(self.req.param(name, "{}") or "{}")
        except SelectorError as err:
            raise HttpError(400, f'bad "{name}": {err}' if name != "query" else str(err)) from err
        gpu_param = "gpu" if name == "query" else f"gpu{name.removeprefix('query')}"
        gpu = self.req.param(gpu_param)
        if gpu:
            if gpu not in GPU_STATES:
                raise HttpError(400, f'"{gpu_param}" must be "idle" or "busy", got {gpu!r}')
            selector = with_gpu_state(selector, gpu)
        return selector

    def time_range(self, suffix: str = "") -> tuple[float, float]:
        """from/until/since, or from2/until2/since2 with suffix "2" (a diff's comparison)."""
        names = [f"{p}{suffix}" for p in ("from", "until", "since")]
        try:
            return resolve_range(*(self.req.param(n) for n in names), self.now)
        except TimeRangeError as err:
            message = str(err)
            if suffix:  # name the parameters as the user spelled them
                for plain, named in zip(("from", "until", "since"), names, strict=True):
                    message = message.replace(f'"{plain}"', f'"{named}"')
            raise HttpError(400, message) from err

    def optional_range(self) -> tuple[float | None, float | None]:
        if not self.given("from", "until", "since"):
            return None, None
        return self.time_range()

    def kind(self) -> str:
        return self.choice("type", TYPES, "cpu")

    def scope(self) -> Scope:
        """`type` and `threads` (see typed), query (with gpu) and the time range."""
        kind, threads = self.typed()
        return Scope(self.selector(), *self.time_range(), kind, threads)

    def typed(self) -> tuple[str, str]:
        """`type` (cpu, offcpu, wall) and `threads` (active, all; the type's default when absent)."""
        kind = self.kind()
        return kind, self.choice("threads", THREADS, DEFAULT_THREADS[kind])

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.req.param(name, default)
        if value not in allowed:
            raise HttpError(400, f'"{name}" must be one of {", ".join(allowed)}, got {value!r}')
        return value

    def whole_number(self, name: str, default: int, lo: int, hi: int) -> int:
        raw = self.req.param(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise HttpError(400, f'"{name}" must be a whole number, got {raw!r}') from None
        if not lo <= value <= hi:
            raise HttpError(400, f'"{name}" must be between {lo} and {hi}, got {value}')
        return value

    def lines(self) -> bool:
        """lines=1: rank a Python function's lines apart (by default they are one function's row)."""
        raw = self.req.param("lines", "0")
        if raw not in ("0", "1", "true", "false"):
            raise HttpError(400, f'"lines" must be 0 or 1, got {raw!r}')
        return raw in ("1", "true")

    def by(self, default: str = "") -> list[str]:
        """`by`: a comma-separated list of label names."""
        by = [b.strip() for b in (self.req.param("by") or default).split(",")]
        if not by or any(not LABEL_NAME.fullmatch(b) for b in by):
            raise HttpError(
                400, f'"by" must be a comma-separated list of label names, got {self.req.param("by")!r}'
            )
        return by

    def match(self) -> list[Selector]:
        """The `match[]` selectors of a listing (any of them: Prometheus's meaning); none means all."""
        texts = self.req.params("match[]")
        if len(texts) > MAX_MATCH:
            raise HttpError(400, f'at most {MAX_MATCH} "match[]" selectors, got {len(texts)}')
        try:
            return [parse_selector(t) for t in texts]
        except SelectorError as err:
            raise HttpError(400, f'bad "match[]": {err}') from err
