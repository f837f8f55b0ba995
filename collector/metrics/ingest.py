"""The collector's own metrics: batches ingested, refused and deferred, stacks decoded, the agents' sampler
outcomes, and the store's state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetprof.collector.model.counters import IngestStats
from fleetprof.collector.store.base import ProfileStore


class IngestCounters(Protocol):
    """What these metrics read of ingest (collector/ingest/service.py, IngestService)."""

    stats: IngestStats

    @property
    def stack_counts(self) -> dict[str, int]:
        """Stacks received: "known" (found by wire id), "decoded", and "collisions" among those."""
        ...

    def cache_sizes(self) -> dict[str, int]:
        """Entries of each table ingest keeps across batches."""
        ...


class IngestMetrics:
    def __init__(self, ingest: IngestCounters, store: ProfileStore):
        self._ingest = ingest
        self._store = store

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._ingest.stats
        yield CounterMetricFamily("fleetprof_ingest_batches", "Batches ingested", value=s.batches)
        yield CounterMetricFamily("fleetprof_ingest_samples", "Samples ingested", value=s.samples)
        yield CounterMetricFamily(
            "fleetprof_ingest_duplicate_batches", "Resent batches dropped as duplicates", value=s.duplicates
        )
        yield CounterMetricFamily(
            "fleetprof_ingest_deferred_batches",
            "Batches not acknowledged because the store could not log them (disk full or failing); the "
            "agents keep them and resend them",
            value=s.deferred,
        )
        stacks = CounterMetricFamily(
            "fleetprof_ingest_stacks",
            "Stacks in the batches received: found by the agent's wire id (known), or checked and decoded "
            "(new to that agent, or sent without an id); the decoded share is what ingest CPU follows",
            labels=["how"],
        )
        counts = self._ingest.stack_counts
        for how in ("known", "decoded"):
            stacks.add_metric([how], counts.get(how, 0))
        yield stacks
        yield CounterMetricFamily(
            "fleetprof_ingest_stack_id_collisions",
            "New stacks whose content id named a different stack already held (kept apart under a stand-in"
            " id); with keyed ids this stays 0 unless the collector's content-id key leaked",
            value=counts.get("collisions", 0),
        )
        cache = GaugeMetricFamily(
            "fleetprof_ingest_cache_entries",
            "Entries of the tables ingest keeps across batches (stacks, frames, frame strings and their"
            " characters, wire ids, label sets, the per-node label quota); a refused batch leaves them as"
            " they were",
            labels=["table"],
        )
        for table, n in sorted(self._ingest.cache_sizes().items()):
            cache.add_metric([table], n)
        yield cache
        rej = CounterMetricFamily(
            "fleetprof_ingest_rejected_batches", "Batches refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(s.rejected.items()):
            rej.add_metric([reason], n)
        yield rej
        samp = CounterMetricFamily(
            "fleetprof_agent_sampler_events",
            "Sampler outcomes reported by agents (SamplerStats)",
            labels=["outcome"],
        )
        for name, n in sorted(s.sampler.items()):
            samp.add_metric([name], n)
        yield samp
        for name, value in self._store.stats().items():
            help_text = f"Store: {name.replace('_', ' ')}" + ("" if name.endswith("bytes") else " (count)")
            yield GaugeMetricFamily(f"fleetprof_store_{name}", help_text, value=value)
