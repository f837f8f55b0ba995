"""Grafana Pyroscope's query API (querier.v1.QuerierService) over the collector's store, so Grafana's
stock Pyroscope datasource and Profiles Drilldown draw fleetprof's flame graphs and CPU series.

Times on this API are milliseconds; selectors are ours (every label we keep, `gpu_state` included, and
the derived `service_name`); values are CPU nanoseconds (samples × 10⁹ / frequency) or samples."""

from __future__ import annotations

import gzip
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2, types_pb2
from fleetprof.collector.model.profile import internal_label
from fleetprof.collector.model.selector import DERIVED_LABELS, Selector, SelectorError
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.series import BUCKET_S, SeriesError, check_step, top_lines
from fleetprof.collector.query.typed import TYPES, TypedStore
from fleetprof.collector.render.flamebearer import to_flamebearer
from fleetprof.collector.render.pprof import to_pprof
from fleetprof.collector.render.tree import truncate
from fleetprof.collector.serve.connect import ConnectError, ConnectService, Method
from fleetprof.collector.store.base import ProfileStore

SERVICE = "querier.v1.QuerierService"
# Pyroscope's other QuerierService methods: a client calling one learns it is not served here.
NOT_SERVED = ("Diff", "SelectMergeSpanProfile", "SelectHeatmap", "AnalyzeQuery", "SelectMergeProfileStats")
DEFAULT_MAX_NODES = 8192  # as Pyroscope
MAX_NODES = 1_000_000
PROFILE_TYPE_LABEL = "__profile_type__"
NAME_LABEL = "__name__"
MAX_SERIES_LABEL_SETS = 10_000
# Label names and values per answer: Pyroscope's requests have no limit, so the first this many, sorted
# (the HTTP API's listings take `limit` and `match[]`).
MAX_LABEL_VALUES = 10_000
RECENT_S = 3600.0  # the range of a label or series listing that names none


@dataclass(frozen=True)
class ProfileType:
    id: str
    name: str
    sample_type: str
    sample_unit: str
    period_type: str
    period_unit: str
    in_nanoseconds: bool  # values are nanoseconds, else samples
    store_type: str = "cpu"  # what it counts (collector/query/typed.py)


PROFILE_TYPES = {
    t.id: t
    for t in (
        ProfileType(
            "process_cpu:cpu:nanoseconds:cpu:nanoseconds",
            "process_cpu",
            "cpu",
            "nanoseconds",
            "cpu",
            "nanoseconds",
            True,
        ),
        ProfileType(
            "process_cpu:samples:count:cpu:nanoseconds",
            "process_cpu",
            "samples",
            "count",
            "cpu",
            "nanoseconds",
            False,
        ),
        # Off-CPU time (threads switched out) and wall time (on-CPU plus off-CPU), both nanoseconds.
        ProfileType(
            "process_offcpu:offcpu:nanoseconds:offcpu:nanoseconds",
            "process_offcpu",
            "offcpu",
            "nanoseconds",
            "offcpu",
            "nanoseconds",
            True,
            "offcpu",
        ),
        ProfileType(
            "wall:wall:nanoseconds:wall:nanoseconds",
            "wall",
            "wall",
            "nanoseconds",
            "wall",
            "nanoseconds",
            True,
            "wall",
        ),
    )
}


def _bad(message: str) -> ConnectError:
    return ConnectError("invalid_argument", message)


def _selector(text: str, what: str = "label_selector") -> Selector:
    try:
        return parse_selector(text or "{}")
    except SelectorError as err:
        raise _bad(f"{what}: {err}") from None


def _range_ms(start_ms: int, end_ms: int) -> tuple[float, float]:
    if end_ms <= start_ms:
        raise _bad(f"end ({end_ms} ms) must be after start ({start_ms} ms)")
    return start_ms / 1000.0, end_ms / 1000.0


def _profile_type(type_id: str) -> ProfileType:
    found = PROFILE_TYPES.get(type_id)
    if found is None:
        raise _bad(f"unknown profile type {type_id!r}: use one of {', '.join(PROFILE_TYPES)}")
    return found


def _period_ns(frequency_hz: int | None) -> int:
    return round(1e9 / frequency_hz) if frequency_hz else 0


class Querier:
    def __init__(self, store: ProfileStore, clock: Callable[[], float] = time.time):
        self._labels = store  # label names: every row's
        # Listings and stats look at CPU samples; each profile type selects through its own view.
        self._store = TypedStore(store, "cpu")
        self._typed = {kind: TypedStore(store, kind) for kind in TYPES}
        self._clock = clock

    def service(self) -> ConnectService:
        q = querier_pb2
        return ConnectService(
            SERVICE,
            {
                "ProfileTypes": Method(q.ProfileTypesRequest, self.profile_types),
                "LabelNames": Method(types_pb2.LabelNamesRequest, self.label_names),
                "LabelValues": Method(types_pb2.LabelValuesRequest, self.label_values),
                "Series": Method(q.SeriesRequest, self.series),
                "SelectMergeStacktraces": Method(
                    q.SelectMergeStacktracesRequest, self.select_merge_stacktraces
                ),
                "SelectMergeProfile": Method(q.SelectMergeProfileRequest, self.select_merge_profile),
                "SelectSeries": Method(q.SelectSeriesRequest, self.select_series),
                "GetProfileStats": Method(types_pb2.GetProfileStatsRequest, self.get_profile_stats),
            },
            pending=NOT_SERVED,
        )

    # -- metadata ----------------------------------------------------------------------------------
    def profile_types(self, _req: querier_pb2.ProfileTypesRequest) -> querier_pb2.ProfileTypesResponse:
        return querier_pb2.ProfileTypesResponse(
            profile_types=[
                types_pb2.ProfileType(
                    ID=t.id,
                    name=t.name,
                    sample_type=t.sample_type,
                    sample_unit=t.sample_unit,
                    period_type=t.period_type,
                    period_unit=t.period_unit,
                )
                for t in PROFILE_TYPES.values()
            ]
        )

    def _selectors(self, matchers: Iterable[str]) -> list[Selector]:
        return [_selector(m, "matchers") for m in matchers] or [Selector()]

    def label_names(self, req: types_pb2.LabelNamesRequest) -> types_pb2.LabelNamesResponse:
        start, end = self._optional_range(req.start, req.end)
        # Names of the series the matchers select, less their __profile_type__ and __name__ matchers
        # (Grafana sends them; no stored label set carries either: every type has the same series).
        typeless = [
            Selector(tuple(m for m in sel.matchers if m.name not in (PROFILE_TYPE_LABEL, NAME_LABEL)))
            for sel in self._selectors(req.matchers)
        ]
        names = {n for n in self._labels.label_names(start, end, typeless) if not internal_label(n)}
        if names:
            names.update(DERIVED_LABELS)
            names.update((PROFILE_TYPE_LABEL, NAME_LABEL))
        return types_pb2.LabelNamesResponse(names=sorted(names)[:MAX_LABEL_VALUES])

    def label_values(self, req: types_pb2.LabelValuesRequest) -> types_pb2.LabelValuesResponse:
        if not req.name:
            raise _bad("name is empty: say which label's values to list")
        start, end = self._range_or_recent(req.start, req.end)
        if req.name == PROFILE_TYPE_LABEL:
            return types_pb2.LabelValuesResponse(names=sorted(PROFILE_TYPES))
        if req.name == NAME_LABEL:
            return types_pb2.LabelValuesResponse(names=sorted({t.name for t in PROFILE_TYPES.values()}))
        values: set[str] = set()
        for sel in self._selectors(req.matchers):
            values.update(k[0] for k in self._store.group(sel, start, end, [req.name]).totals)
        values.discard("")
        return types_pb2.LabelValuesResponse(names=sorted(values)[:MAX_LABEL_VALUES])

    def series(self, req: querier_pb2.SeriesRequest) -> querier_pb2.SeriesResponse:
        start, end = self._range_or_recent(req.start, req.end)
        wanted = list(req.label_names) or [
            *sorted(n for n in self._labels.label_names(start, end) if not internal_label(n)),
            *DERIVED_LABELS,
        ]
        by = [n for n in wanted if n not in (PROFILE_TYPE_LABEL, NAME_LABEL)]
        # The groups with data, per what the types count: a profile type is listed for a group only
        # where it has some (no off-CPU series for a node whose agent does not record it).
        keys: dict[str, set[tuple[str, ...]]] = {kind: set() for kind in TYPES}
        for sel in self._selectors(req.matchers):
            for kind in ("cpu", "offcpu"):
                keys[kind].update(self._typed[kind].group(sel, start, end, by).totals)
        keys["wall"] = keys["cpu"] | keys["offcpu"]
        typed = PROFILE_TYPE_LABEL in wanted or NAME_LABEL in wanted
        sets: set[tuple[tuple[str, str], ...]] = set()
        for t in PROFILE_TYPES.values():
            for key in keys[t.store_type]:
                labels = {n: v for n, v in zip(by, key, strict=True) if v}
                if PROFILE_TYPE_LABEL in wanted:
                    labels[PROFILE_TYPE_LABEL] = t.id
                if NAME_LABEL in wanted:
                    labels[NAME_LABEL] = t.name
                sets.add(tuple(sorted(labels.items())))
            if not typed:
                sets.update(
                    tuple(sorted((n, v) for n, v in zip(by, k, strict=True) if v)) for k in keys["wall"]
                )
                break
        out = querier_pb2.SeriesResponse()
        for pairs in sorted(sets)[:MAX_SERIES_LABEL_SETS]:
            out.labels_set.append(
                types_pb2.Labels(labels=[types_pb2.LabelPair(name=k, value=v) for k, v in pairs])
            )
        return out

    def get_profile_stats(self, _req: types_pb2.GetProfileStatsRequest) -> types_pb2.GetProfileStatsResponse:
        now = self._clock()
        hour = 3600.0
        # Hours with samples over the last 400 days (past any retention): the oldest and the newest.
        ts = self._store.series(Selector(), now - 400 * 86400, now, hour, [])
        hours = sorted(ts.points.get((), {}))
        if not hours:
            return types_pb2.GetProfileStatsResponse(data_ingested=False)
        return types_pb2.GetProfileStatsResponse(
            data_ingested=True,
            oldest_profile_time=int(hours[0] * 1000),
            newest_profile_time=int(min(now, hours[-1] + hour) * 1000),
        )

    def _optional_range(self, start_ms: int, end_ms: int) -> tuple[float | None, float | None]:
        if not start_ms and not end_ms:
            return None, None
        return _range_ms(start_ms, end_ms or int(self._clock() * 1000))

    def _range_or_recent(self, start_ms: int, end_ms: int) -> tuple[float, float]:
        """The range asked for, or the last hour where the request names none (as Pyroscope does)."""
        if not start_ms and not end_ms:
            now = self._clock()
            return now - RECENT_S, now
        return _range_ms(start_ms, end_ms or int(self._clock() * 1000))

    # -- profiles ----------------------------------------------------------------------------------
    def _max_nodes(
        self, req: querier_pb2.SelectMergeStacktracesRequest | querier_pb2.SelectMergeProfileRequest
    ) -> int:
        if not req.HasField("max_nodes") or req.max_nodes == 0:
            return DEFAULT_MAX_NODES
        if not 0 < req.max_nodes <= MAX_NODES:
            raise _bad(f"max_nodes must be between 1 and {MAX_NODES}, got {req.max_nodes}")
        return req.max_nodes

    def select_merge_stacktraces(
        self, req: querier_pb2.SelectMergeStacktracesRequest
    ) -> querier_pb2.SelectMergeStacktracesResponse:
        kind = _profile_type(req.profile_typeID)
        selector = _selector(req.label_selector)
        start, end = _range_ms(req.start, req.end)
        max_nodes = self._max_nodes(req)
        sel = self._typed[kind.store_type].select(selector, start, end)
        fb = to_flamebearer(sel.stacks, max_nodes, self._scale(kind, sel.frequency_hz))
        return querier_pb2.SelectMergeStacktracesResponse(
            flamegraph=querier_pb2.FlameGraph(
                names=fb.names,
                levels=[querier_pb2.Level(values=v) for v in fb.levels],
                total=fb.total,
                max_self=fb.max_self,
            )
        )

    @staticmethod
    def _scale(kind: ProfileType, frequency_hz: int | None) -> int:
        """What a stored count is worth in the type's unit: CPU samples in nanoseconds are a period each;
        off-CPU and wall views count nanoseconds already."""
        if kind.store_type != "cpu" or not kind.in_nanoseconds:
            return 1
        return _period_ns(frequency_hz)

    def select_merge_profile(self, req: querier_pb2.SelectMergeProfileRequest) -> profile_pb2.Profile:
        kind = _profile_type(req.profile_typeID)
        selector = _selector(req.label_selector)
        start, end = _range_ms(req.start, req.end)
        max_nodes = self._max_nodes(req)
        sel = self._typed[kind.store_type].select(selector, start, end)
        ns = None if kind.store_type == "cpu" else kind.sample_type
        body = to_pprof(truncate(sel.stacks, max_nodes), sel.frequency_hz, start, end, nanoseconds=ns)
        return profile_pb2.Profile.FromString(gzip.decompress(body))

    def select_series(self, req: querier_pb2.SelectSeriesRequest) -> querier_pb2.SelectSeriesResponse:
        kind = _profile_type(req.profile_typeID)
        selector = _selector(req.label_selector)
        start, end = _range_ms(req.start, req.end)
        try:
            step = check_step(req.step, start, end)
        except SeriesError as err:
            raise _bad(str(err)) from None
        for name in req.group_by:
            if not name:
                raise _bad("group_by has an empty label name")
        if req.HasField("limit") and req.limit < 0:
            raise _bad(f"limit must not be negative, got {req.limit}")
        average = (
            req.HasField("aggregation") and req.aggregation == types_pb2.TIME_SERIES_AGGREGATION_TYPE_AVERAGE
        )
        ts = self._typed[kind.store_type].series(selector, start, end, step, list(req.group_by))
        scale = self._scale(kind, ts.frequency_hz)
        # Average: per stored window (10 s) of the step, rather than the step's sum.
        per = max(1.0, step / BUCKET_S) if average else 1.0
        limit = req.limit if req.HasField("limit") and req.limit > 0 else None
        out = querier_pb2.SelectSeriesResponse()
        for line in top_lines(ts, limit):
            out.series.append(
                types_pb2.Series(
                    labels=[types_pb2.LabelPair(name=k, value=v) for k, v in sorted(line.labels.items())],
                    points=[
                        types_pb2.Point(value=n * scale / per, timestamp=int(math.floor(t * 1000)))
                        for t, n in line.points
                    ],
                )
            )
        return out
