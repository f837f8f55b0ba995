"""Grafana Pyroscope's query API (querier.v1.QuerierService) over the query stage, so Grafana's stock
Pyroscope datasource and Profiles Drilldown draw fleetprof's flame graphs and CPU series.

Times on this API are milliseconds; selectors are ours (every label we keep, `gpu_state` included, and
the derived `service_name`); values are CPU nanoseconds (samples × 10⁹ / frequency) or samples
(query/types.py names the profile types)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2, types_pb2
from fleetprof.collector.model.selector import Selector, SelectorError
from fleetprof.collector.query.answers import Scope
from fleetprof.collector.query.limits import PYROSCOPE_MAX_NODES, LimitError, check_max_nodes
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.series import SeriesError, check_step
from fleetprof.collector.query.service import QueryService
from fleetprof.collector.query.types import PROFILE_TYPES, ProfileType
from fleetprof.collector.render.flamebearer import to_flamebearer
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.pprof import pprof_message
from fleetprof.collector.render.tree import truncate
from fleetprof.collector.serve.connect import ConnectError, ConnectService, Encoded, Method

SERVICE = "querier.v1.QuerierService"
# Pyroscope's other QuerierService methods: a client calling one learns it is not served here.
NOT_SERVED = ("Diff", "SelectMergeSpanProfile", "SelectHeatmap", "AnalyzeQuery", "SelectMergeProfileStats")
RECENT_S = 3600.0  # the range of a label or series listing that names none


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


class Querier:
    def __init__(self, query: QueryService, names: Names = as_stored, clock: Callable[[], float] = time.time):
        self._query = query
        self._names = names  # the collector's Demangler's display_name
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
        names = self._query.profile_label_names(start, end, self._selectors(req.matchers))
        return types_pb2.LabelNamesResponse(names=names)

    def label_values(self, req: types_pb2.LabelValuesRequest) -> types_pb2.LabelValuesResponse:
        if not req.name:
            raise _bad("name is empty: say which label's values to list")
        start, end = self._range_or_recent(req.start, req.end)
        values = self._query.profile_type_label_values(req.name)
        if values is None:
            values = self._query.profile_label_values(req.name, start, end, self._selectors(req.matchers))
        return types_pb2.LabelValuesResponse(names=values)

    def series(self, req: querier_pb2.SeriesRequest) -> querier_pb2.SeriesResponse:
        start, end = self._range_or_recent(req.start, req.end)
        sets = self._query.profile_label_sets(
            start, end, self._selectors(req.matchers), list(req.label_names)
        )
        out = querier_pb2.SeriesResponse()
        for pairs in sets:
            out.labels_set.append(
                types_pb2.Labels(labels=[types_pb2.LabelPair(name=k, value=v) for k, v in pairs])
            )
        return out

    def get_profile_stats(self, _req: types_pb2.GetProfileStatsRequest) -> types_pb2.GetProfileStatsResponse:
        span = self._query.data_span(self._clock())
        if span is None:
            return types_pb2.GetProfileStatsResponse(data_ingested=False)
        return types_pb2.GetProfileStatsResponse(
            data_ingested=True,
            oldest_profile_time=int(span[0] * 1000),
            newest_profile_time=int(span[1] * 1000),
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
    @staticmethod
    def _max_nodes(
        req: querier_pb2.SelectMergeStacktracesRequest | querier_pb2.SelectMergeProfileRequest,
    ) -> int:
        if not req.HasField("max_nodes") or req.max_nodes == 0:
            return PYROSCOPE_MAX_NODES
        try:
            return check_max_nodes(req.max_nodes)
        except LimitError as err:
            raise _bad(str(err)) from None

    def select_merge_stacktraces(
        self, req: querier_pb2.SelectMergeStacktracesRequest
    ) -> querier_pb2.SelectMergeStacktracesResponse:
        kind = _profile_type(req.profile_typeID)
        selector = _selector(req.label_selector)
        start, end = _range_ms(req.start, req.end)
        max_nodes = self._max_nodes(req)
        sel = self._query.profile(Scope(selector, start, end, kind.kind))
        fb = to_flamebearer(sel.stacks, max_nodes, kind.scale(sel.frequency_hz), self._names)
        return querier_pb2.SelectMergeStacktracesResponse(
            flamegraph=querier_pb2.FlameGraph(
                names=fb.names,
                levels=[querier_pb2.Level(values=v) for v in fb.levels],
                total=fb.total,
                max_self=fb.max_self,
            )
        )

    def select_merge_profile(self, req: querier_pb2.SelectMergeProfileRequest) -> Encoded:
        kind = _profile_type(req.profile_typeID)
        selector = _selector(req.label_selector)
        start, end = _range_ms(req.start, req.end)
        max_nodes = self._max_nodes(req)
        sel = self._query.profile(Scope(selector, start, end, kind.kind))
        ns = None if kind.kind == "cpu" else kind.sample_type
        stacks = truncate(sel.stacks, max_nodes)
        body = pprof_message(stacks, sel.frequency_hz, start, end, nanoseconds=ns, names=self._names)
        return Encoded(profile_pb2.Profile, body)

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
        limit = req.limit if req.HasField("limit") and req.limit > 0 else None
        scope = Scope(selector, start, end, kind.kind)
        out = querier_pb2.SelectSeriesResponse()
        for labels, points in self._query.profile_type_series(
            kind, scope, step, list(req.group_by), limit, average
        ):
            out.series.append(
                types_pb2.Series(
                    labels=[types_pb2.LabelPair(name=k, value=v) for k, v in sorted(labels.items())],
                    points=[
                        types_pb2.Point(value=value, timestamp=int(math.floor(t * 1000)))
                        for t, value in points
                    ],
                )
            )
        return out
