"""Prometheus CPU and off-CPU time per pod (`fleetprof_cpu_seconds_total`, `fleetprof_offcpu_seconds_total`)
from ingested rows, with a cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np
from prometheus_client.core import CounterMetricFamily, Metric

from fleetprof.collector.model.profile import OFFCPU, PROFILE_TYPE_NAME
from fleetprof.collector.model.rows import ProfileRows

SERIES_LABELS = ("node", "namespace", "pod", "container")
OTHER = "other"


class CpuMetrics:
    """Cumulative since the collector started: samples ÷ sampling frequency per (node, namespace, pod,
    container); host processes count under empty pod labels. Each node gets its own series for its first
    `per_node_limit` containers; later ones are summed into pod="other", container="other" (namespace
    kept). Series never change name, so counters stay monotonic; series idle for `expire_s` are dropped.

    Counts are kept as integers (samples per sampling frequency, off-CPU nanoseconds) and turned into
    seconds once, when scraped: summing n / frequency per batch in floats drifted (119.00000000000098
    for 119 s), so the exported value is the sum's exact fraction rounded once."""

    MAX_CACHED = 200_000  # label set ids whose series key is remembered

    def __init__(
        self, per_node_limit: int = 500, expire_s: float = 3600.0, clock: Callable[[], float] = time.time
    ):
        self._limit = per_node_limit
        self._expire_s = expire_s
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: dict[tuple[str, ...], dict[int, int]] = {}  # series -> frequency -> samples
        self._last_update: dict[tuple[str, ...], float] = {}
        self._named: dict[str, set[tuple[str, ...]]] = {}  # node -> series keys with their own name
        self._series_of: dict[int, tuple[str, ...]] = {}  # label set id -> its series key
        # Off-CPU nanoseconds' seconds, per the same series keys (the cap is the CPU series'; a pod's
        # off-CPU time goes where its CPU time goes).
        self._offcpu_ns: dict[tuple[str, ...], int] = {}
        self._offcpu_sets: set[int] = set()  # label set ids of off-CPU rows
        # Label set ids of rows that are neither (CUDA launches, GPU kernel time): no CPU series' business.
        self._other_sets: set[int] = set()

    def observe(self, rows: ProfileRows) -> None:
        # Sum per label set first, in numpy: a batch has thousands of rows but only hundreds of processes.
        if not len(rows.counts):
            return
        # Weights make bincount count in float64, exact for integers up to 2^53 (a batch holds far fewer).
        per_set = np.bincount(rows.label_index, weights=rows.counts, minlength=len(rows.label_sets)).tolist()
        freq = rows.frequency_hz
        now = self._clock()
        series_of = self._series_of
        with self._lock:
            if len(series_of) > self.MAX_CACHED or len(self._other_sets) > self.MAX_CACHED:
                series_of.clear()
                self._offcpu_sets.clear()
                self._other_sets.clear()
            for (lid, labels), n in zip(rows.label_sets, per_set, strict=True):
                if not n or lid in self._other_sets:
                    continue
                key = series_of.get(lid)
                if key is None:
                    lb = dict(labels)
                    kind = lb.get(PROFILE_TYPE_NAME)
                    if kind not in (None, OFFCPU):
                        self._other_sets.add(lid)
                        continue
                    key = series_of[lid] = tuple(lb.get(name, "") for name in SERIES_LABELS)
                    if kind == OFFCPU:
                        self._offcpu_sets.add(lid)
                named = self._named.setdefault(key[0], set())
                if key not in named:
                    if len(named) < self._limit:
                        named.add(key)
                    else:
                        key = (key[0], key[1], OTHER, OTHER)
                if lid in self._offcpu_sets:
                    self._offcpu_ns[key] = self._offcpu_ns.get(key, 0) + int(n)
                else:
                    by_freq = self._samples.setdefault(key, {})
                    by_freq[freq] = by_freq.get(freq, 0) + int(n)
                self._last_update[key] = now
            self._expire(now)

    def _expire(self, now: float) -> None:
        stale = [k for k, t in self._last_update.items() if now - t > self._expire_s]
        for k in stale:
            self._samples.pop(k, None)
            self._offcpu_ns.pop(k, None)
            del self._last_update[k]
            named = self._named.get(k[0])
            if named is not None:
                named.discard(k)
                if not named:
                    del self._named[k[0]]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = sorted((k, _seconds(by_freq)) for k, by_freq in self._samples.items())
            offcpu = sorted((k, ns / 1e9) for k, ns in self._offcpu_ns.items())
        fam = CounterMetricFamily(
            "fleetprof_cpu_seconds",
            "CPU time sampled by the agents (samples / sampling frequency)",
            labels=list(SERIES_LABELS),
        )
        for key, seconds in items:
            fam.add_metric(list(key), seconds)
        yield fam
        if offcpu:
            fam = CounterMetricFamily(
                "fleetprof_offcpu_seconds",
                "Time threads spent switched out (blocked or waiting to run), per the agents",
                labels=list(SERIES_LABELS),
            )
            for key, seconds in offcpu:
                fam.add_metric(list(key), seconds)
            yield fam


def _seconds(samples_by_frequency: dict[int, int]) -> float:
    """Σ samples / frequency, exactly, rounded once to a float."""
    return float(sum(Fraction(n, hz) for hz, n in samples_by_frequency.items() if hz))
