"""The query stage: every question the readers (collector/serve/: the HTTP API and UI, Grafana's Pyroscope
API) ask of the store, answered as plain values for them to render. It reads the store through its
protocol (store/base.py) and speaks the model; parameters arrive parsed (query/selector.py,
query/timerange.py) and answers leave unrendered."""

from __future__ import annotations

from collections.abc import Sequence

from fleetprof.collector.model.profile import CUDA_CALLS, GPU_STATE_NAME, PROFILE_TYPE_NAME, SyscallAgg
from fleetprof.collector.model.rows import BUCKET_S, Selection
from fleetprof.collector.model.selector import DERIVED_LABELS, Matcher, Selector, SelectorError
from fleetprof.collector.query.answers import (
    CudaCallRow,
    Diff,
    Group,
    Groups,
    Listing,
    PodReport,
    QueryError,
    Scope,
    SeriesAnswer,
    SyscallRow,
)
from fleetprof.collector.query.labels import HOST_GROUP_PREFIX, POD, Notes, label_names, notes
from fleetprof.collector.query.limits import MAX_LABEL_VALUES, MAX_LISTED, MAX_SERIES_LABEL_SETS
from fleetprof.collector.query.series import top_lines
from fleetprof.collector.query.typed import TypedStore
from fleetprof.collector.query.types import (
    NAME_LABEL,
    PROFILE_TYPE_LABEL,
    PROFILE_TYPES,
    TYPES,
    ProfileType,
)
from fleetprof.collector.query.waits import Waits, blocked_where
from fleetprof.collector.store.base import GpuUsage, ProfileStore


def comparison(
    selector: Selector,
    span: tuple[float, float],
    other: Selector | None,
    other_span: tuple[float, float] | None,
) -> tuple[Selector, tuple[float, float]]:
    """A diff's comparison side: it takes the baseline's selector and range where it gives none; a
    comparison of the baseline with itself is refused."""
    other = selector if other is None else other
    other_span = span if other_span is None else other_span
    if str(other) == str(selector) and other_span == span:
        raise QueryError(
            "the comparison is the same selection as the baseline: give a different "
            '"query2", or a second time range with "from2"/"until2"/"since2"'
        )
    return other, other_span


class QueryService:
    """Answers over a ProfileStore (and the GPU usage log, for the per-pod GPU report)."""

    def __init__(self, store: ProfileStore, gpu_usage: GpuUsage | None = None):
        self._store = store
        self._gpu_usage = gpu_usage

    def typed(self, kind: str = "cpu", threads: str | None = None) -> TypedStore:
        return TypedStore(self._store, kind, threads)

    def notes(self, scope: Scope, total: int, by: Sequence[str] = ()) -> Notes:
        return notes(self._store, total, scope.selector, scope.start, scope.end, by)

    # -- profiles ----------------------------------------------------------------------------------------
    def profile(self, scope: Scope) -> Selection:
        """The merged stacks of the scope."""
        return self.typed(scope.kind, scope.threads).select(scope.selector, scope.start, scope.end)

    def blocked(self, scope: Scope) -> tuple[Selection, Waits]:
        """An off-CPU or wall scope's stacks, and their value by where each thread blocked in its own code
        and why (query/waits.py): what `top` ranks for these types."""
        if scope.kind == "cpu":
            raise QueryError("CPU samples did not block: rank them by frame (rank=frame)")
        running, waits = self.typed(scope.kind, scope.threads).select_apart(
            scope.selector, scope.start, scope.end
        )
        merged = dict(running.stacks)
        for stack, value in waits.stacks.items():
            merged[stack] = merged.get(stack, 0) + value
        return Selection(merged, waits.frequency_hz), blocked_where(waits.stacks, running.stacks)

    def diff(self, baseline: Scope, comparison: Scope) -> Diff:
        """Two scopes' stacks side by side (comparison() makes the second)."""
        return Diff(baseline, comparison, self.profile(baseline), self.profile(comparison))

    def diff_notes(self, diff: Diff) -> tuple[dict[str, Notes], list[str]]:
        """Each side's notes ("baseline", "comparison"), and their warnings together, each naming its side
        and said once."""
        sides = {"baseline": (diff.baseline, diff.base), "comparison": (diff.comparison, diff.comp)}
        per_side, warnings = {}, []
        for name, (scope, picked) in sides.items():
            per_side[name] = self.notes(scope, picked.total)
            for warning in per_side[name].warnings:
                text = warning.replace("the selector", f"the {name} selector", 1)
                if text not in warnings:
                    warnings.append(text)
        return per_side, warnings

    # -- groups and series -------------------------------------------------------------------------------
    def top_groups(self, scope: Scope, by: list[str], limit: int) -> Groups:
        """The label-value groups (e.g. pods) with the most samples, the `limit` largest. Grouped by pod, a
        process without one counts under "comm:NAME" in the pod column, not in one empty pod with every
        other host process."""
        typed = self.typed(scope.kind, scope.threads)
        if POD in by and "comm" not in by:
            grouped = typed.group(scope.selector, scope.start, scope.end, [*by, "comm"])
            totals = _host_processes_by_comm(grouped.totals, by)
        else:
            grouped = typed.group(scope.selector, scope.start, scope.end, by)
            totals = grouped.totals
        total = sum(totals.values())
        freq = grouped.frequency_hz
        rows = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        groups = [
            Group(
                dict(zip(by, values, strict=True)),
                n,
                round(n / freq, 3) if freq else None,
                round(100.0 * n / total, 2) if total else 0.0,
            )
            for values, n in rows
        ]
        return Groups(by, total, freq, groups)

    def series(self, scope: Scope, step: float, by: list[str], limit: int | None) -> SeriesAnswer:
        """Samples per step (query/series.py checks it) per group of `by`, the `limit` largest series."""
        ts = self.typed(scope.kind, scope.threads).series(scope.selector, scope.start, scope.end, step, by)
        return SeriesAnswer(by, step, ts.frequency_hz, top_lines(ts, limit))

    def profile_type_series(
        self, ptype: ProfileType, scope: Scope, step: float, by: list[str], limit: int | None, average: bool
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A profile type's series in its unit: (labels, [(step start, value)]) the largest first. With
        `average`, a point is the mean per stored bucket of its step rather than the step's sum."""
        answer = self.series(scope, step, by, limit)
        scale = ptype.scale(answer.frequency_hz)
        per = max(1.0, step / BUCKET_S) if average else 1.0
        return [(line.labels, [(t, n * scale / per) for t, n in line.points]) for line in answer.lines]

    def data_span(self, now: float) -> tuple[float, float] | None:
        """The first and the end of the last hour with CPU samples over the last 400 days (past any
        retention); None when there are none."""
        hour = 3600.0
        ts = self.typed().series(Selector(), now - 400 * 86400, now, hour, [])
        hours = sorted(ts.points.get((), {}))
        if not hours:
            return None
        return hours[0], min(now, hours[-1] + hour)

    # -- GPUs --------------------------------------------------------------------------------------------
    def gpu_report(self, scope: Scope, limit: int, functions: bool) -> list[PodReport]:
        """Per pod on a GPU (the pods whose GPUs idled most first, at most `limit`): utilization, memory,
        idle fraction (exact from the GPU activity where the pod loads the CUPTI library, else NVML's), its
        idle gaps, and CPU samples while its GPUs were idle and busy (one grouped query for all pods);
        with `functions`, the stacks of its idle time as the scope's type counts them and in wall time
        (active threads; without an off-CPU recorder, the CPU time in nanoseconds): one select grouped by
        pod for all of them (the store's select_groups). The scope's selector selects on node, namespace,
        pod, container and gpu."""
        if self._gpu_usage is None:
            return []
        selector, start, end = scope.selector, scope.start, scope.end
        tagged = Selector((*selector.matchers, Matcher(GPU_STATE_NAME, "=~", "idle|busy")))
        cpu = self.typed().group(tagged, start, end, ["namespace", "pod", GPU_STATE_NAME]).totals
        usage = self._gpu_usage.pods(selector, start, end)
        shown = usage[:limit]
        idle: dict[tuple[str, ...], tuple[Selection, Selection, Selection]] = {}
        if functions and shown:
            matchers = [*selector.matchers, Matcher(GPU_STATE_NAME, "=", "idle")]
            if len(shown) < len(usage):  # the pods past the limit need no stacks
                try:
                    matchers.append(_one_of("pod", {p.pod for p in shown}))
                except SelectorError:  # a regex too big for RE2: read them all, drop them below
                    pass
            idle = self.typed(scope.kind, scope.threads).select_with_wall_by(
                Selector(tuple(matchers)), start, end, ["namespace", "pod"]
            )
        out = []
        for p in shown:
            report = PodReport(
                p.namespace,
                p.pod,
                sorted(p.gpus),
                _round(p.utilization),
                p.memory_bytes,
                _round(p.idle_ratio),
                round(p.seconds, 3),
                cpu.get((p.namespace, p.pod, "idle"), 0),
                cpu.get((p.namespace, p.pod, "busy"), 0),
                0.0,
                idle_source=p.idle_source,
                nvml_idle_ratio=_round(p.nvml_idle_ratio),
                activity_seconds=round(p.activity_known_seconds, 6),
                idle_seconds=round(p.activity_idle_seconds, 6) if p.activity_known_seconds else None,
                gaps=p.gaps,
                gap_histogram=list(p.gap_histogram),
                longest_gap_seconds=round(p.longest_gap_seconds, 9) if p.gaps else None,
                records_lost=p.records_lost,
            )
            if functions:
                own, running, waits = idle.get((p.namespace, p.pod), _NO_STACKS)
                wall = dict(running.stacks)
                for stack, ns in waits.stacks.items():
                    wall[stack] = wall.get(stack, 0) + ns
                report.idle_stacks, report.idle_wall_stacks = own.stacks, wall
                report.idle_wall_waits = blocked_where(waits.stacks, running.stacks)
                report.idle_wall_seconds = round(sum(report.idle_wall_stacks.values()) / 1e9, 3)
            out.append(report)
        return out

    # -- syscalls and CUDA calls -------------------------------------------------------------------------
    def syscalls(self, scope: Scope, by: list[str], sort: str, limit: int) -> tuple[list[SyscallRow], int]:
        """Syscalls of the scope's series grouped by `by` ("syscall" is a group-by name too), the `limit`
        first by total time (sort="time") or calls ("count"); and the calls of all groups. CUDA calls,
        stored beside them under __type__="cuda", are left out."""
        start, end = scope.start, scope.end
        selector = Selector((*scope.selector.matchers, _UNTYPED))
        groups = self._store.syscalls(selector, start, end, by)
        duration = max(end - start, 1e-9)
        rows = []
        for values, agg in groups.items():
            p50, p99 = agg.quantile_ns(0.5), agg.quantile_ns(0.99)
            rows.append(
                SyscallRow(
                    dict(zip(by, values, strict=True)),
                    agg.count,
                    round(agg.count / duration, 3),
                    agg.timed,
                    round(agg.estimated_ns / 1e9, 6),
                    round(agg.timed_ns / agg.timed / 1e9, 9) if agg.timed else None,
                    round(p50 / 1e9, 9) if p50 is not None else None,
                    round(p99 / 1e9, 9) if p99 is not None else None,
                )
            )
        # Ties broken by the labels: which rows make the limit must not depend on the store's row order.
        if sort == "time":
            rows.sort(key=lambda r: (-r.total_seconds, -r.count, tuple(r.labels.values())))
        else:
            rows.sort(key=lambda r: (-r.count, tuple(r.labels.values())))
        return rows[:limit], sum(a.count for a in groups.values())

    def cuda_calls(self, scope: Scope, by: list[str], sort: str, limit: int) -> tuple[list[CudaCallRow], int]:
        """CUDA API calls of the scope's series grouped by `by` ("call" is a group-by name too), the `limit`
        first by total time (sort="time") or calls ("count"); and the calls of all groups."""
        start, end = scope.start, scope.end
        selector = Selector((*scope.selector.matchers, _CUDA_CALLS))
        # The store keeps a call's name where it keeps a syscall's: its group-by name is "syscall".
        groups = self._store.syscalls(selector, start, end, ["syscall" if b == "call" else b for b in by])
        duration = max(end - start, 1e-9)
        rows = [
            _cuda_row(dict(zip(by, values, strict=True)), agg, duration) for values, agg in groups.items()
        ]
        if sort == "time":
            rows.sort(key=lambda r: (-r.seconds, -r.count, tuple(r.labels.values())))
        else:
            rows.sort(key=lambda r: (-r.count, tuple(r.labels.values())))
        return rows[:limit], sum(a.count for a in groups.values())

    # -- labels ------------------------------------------------------------------------------------------
    def label_names(
        self, start: float | None, end: float | None, match: Sequence[Selector] = (), limit: int = MAX_LISTED
    ) -> Listing:
        """Label names with data in range (of the label sets `match` selects), the first `limit`."""
        names = label_names(self._store, start, end, match)
        return Listing(names[:limit], len(names) > limit)

    def label_values(
        self,
        name: str,
        start: float | None,
        end: float | None,
        match: Sequence[Selector] = (),
        limit: int = MAX_LISTED,
    ) -> Listing:
        """A label's values with data in range (of the label sets `match` selects), sorted, the first
        `limit`."""
        values = self._store.label_values(name, start, end, match)
        return Listing(values[:limit], len(values) > limit)

    def profile_label_names(
        self, start: float | None, end: float | None, match: Sequence[Selector]
    ) -> list[str]:
        """Pyroscope's label names: of the series `match` selects (less their profile-type matchers: no
        stored label set carries one), the derived labels and the profile-type labels besides, when there
        are any."""
        typeless = [
            Selector(tuple(m for m in sel.matchers if m.name not in (PROFILE_TYPE_LABEL, NAME_LABEL)))
            for sel in match
        ]
        names = set(label_names(self._store, start, end, typeless))
        if names:
            names.update(DERIVED_LABELS)
            names.update((PROFILE_TYPE_LABEL, NAME_LABEL))
        return sorted(names)[:MAX_LABEL_VALUES]

    @staticmethod
    def profile_type_label_values(name: str) -> list[str] | None:
        """The values of a profile-type label (None for any other label): what Pyroscope lists for them."""
        if name == PROFILE_TYPE_LABEL:
            return sorted(PROFILE_TYPES)
        if name == NAME_LABEL:
            return sorted({t.name for t in PROFILE_TYPES.values()})
        return None

    def profile_label_values(
        self, name: str, start: float, end: float, match: Sequence[Selector]
    ) -> list[str]:
        """Pyroscope's label values: the values `name` takes (derived labels too) in the CPU series some
        selector of `match` selects."""
        values: set[str] = set()
        for sel in match:
            values.update(k[0] for k in self.typed().group(sel, start, end, [name]).totals)
        values.discard("")
        return sorted(values)[:MAX_LABEL_VALUES]

    def profile_label_sets(
        self, start: float, end: float, match: Sequence[Selector], wanted: list[str]
    ) -> list[list[tuple[str, str]]]:
        """Pyroscope's series: the distinct sets of the `wanted` labels (all but the collector's own, and the
        derived ones, when none are named) among the series `match` selects, sorted; a profile type is
        listed for a set only where it has data (no off-CPU series for a node whose agent records none)."""
        wanted = wanted or [*label_names(self._store, start, end), *DERIVED_LABELS]
        by = [n for n in wanted if n not in (PROFILE_TYPE_LABEL, NAME_LABEL)]
        keys: dict[str, set[tuple[str, ...]]] = {kind: set() for kind in TYPES}
        for sel in match:
            for kind in ("cpu", "offcpu", "cuda_launch", "gpu"):
                keys[kind].update(self.typed(kind).group(sel, start, end, by).totals)
        keys["wall"] = keys["cpu"] | keys["offcpu"]
        typed = PROFILE_TYPE_LABEL in wanted or NAME_LABEL in wanted
        sets: set[tuple[tuple[str, str], ...]] = set()
        for t in PROFILE_TYPES.values():
            for key in keys[t.kind]:
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
        return [list(pairs) for pairs in sorted(sets)[:MAX_SERIES_LABEL_SETS]]


def _host_processes_by_comm(by_comm: dict[tuple[str, ...], int], by: list[str]) -> dict[tuple[str, ...], int]:
    """Totals grouped by `by` (which holds "pod") from totals grouped by `by` and then comm: a process
    without a pod counts under "comm:NAME" in the pod column; processes in pods are summed over their
    comms."""
    pod_at = by.index(POD)
    totals: dict[tuple[str, ...], int] = {}
    for values, n in by_comm.items():
        key = list(values[:-1])
        if not key[pod_at]:
            key[pod_at] = HOST_GROUP_PREFIX + values[-1]
        totals[tuple(key)] = totals.get(tuple(key), 0) + n
    return totals


def _one_of(name: str, values: set[str]) -> Matcher:
    """A matcher of exactly these values: an alternation of them as RE2 literals."""
    return Matcher(name, "=~", "|".join(_re2_literal(v) for v in sorted(values)))


def _re2_literal(text: str) -> str:
    """`text` as an RE2 pattern that matches only it: letters, digits and "_" as they are, every other
    character as \\x{hex} (RE2 reads that as the character, whatever it is)."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{{{ord(c):x}}}" for c in text)


_NO_STACKS = (Selection({}, None), Selection({}, None), Selection({}, None))
_UNTYPED = Matcher(PROFILE_TYPE_NAME, "=", "")
_CUDA_CALLS = Matcher(PROFILE_TYPE_NAME, "=", CUDA_CALLS)


def _cuda_row(labels: dict[str, str], agg: SyscallAgg, duration: float) -> CudaCallRow:
    p50, p99 = agg.quantile_ns(0.5), agg.quantile_ns(0.99)
    histogram = [(round((1 << (i + 1)) / 1e9, 9), n) for i, n in enumerate(agg.hist) if n]
    return CudaCallRow(
        labels,
        agg.count,
        round(agg.count / duration, 3),
        agg.timed,
        round(agg.estimated_ns / 1e9, 6),
        round(agg.timed_ns / agg.timed / 1e9, 9) if agg.timed else None,
        round(p50 / 1e9, 9) if p50 is not None else None,
        round(p99 / 1e9, 9) if p99 is not None else None,
        histogram,
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
