"""Counters a stage keeps about itself, as plain values: what the self-metrics (collector/metrics/) read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IngestStats:
    """Ingest's counters; updated under the servicer's lock."""

    batches: int = 0
    samples: int = 0
    duplicates: int = 0
    deferred: int = 0  # not acknowledged because the store could not take them: the agent resends them
    rejected: dict[str, int] = field(default_factory=dict)
    sampler: dict[str, int] = field(default_factory=dict)  # SamplerStats fields summed over batches
