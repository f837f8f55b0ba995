"""Per-node quotas on the label index: how many label sets (series) one node may keep live, and how many
distinct values each of its labels may take, as Prometheus and Pyroscope bound series per tenant.

Why: every distinct label set costs the stores a few KB until retention (its labels, a dict to match
selectors against, an id), and every distinct value is listed by the label-values endpoints. Without a
bound one token holder filled the index: 10 batches of 20,000 processes, each with a unique 1,000-byte
`pod`, took the collector from 180 to 815 MiB, and `/api/v1/labels/pod/values` answered 200 MB.

What is counted: per tenant (the node a batch names, qualified by the credential that authenticated it,
collector/ingest/peer.py), the process label sets it sent within the last `horizon_s` (the in-memory
store's retention), and the values each label name takes in them. A batch that would take its tenant past a
cap, or all tenants together past `max_series_total`, is refused whole with a counted reason, before any
of it is kept (a refusal that dropped only some rows would disagree with the write-ahead log, which keeps
batches as they came). Live label sets are touched by every batch that uses them, so a steady node never
ages out of its own quota; sets unused for a horizon are forgotten a quarter-horizon at a time.

Not counted: the label sets ingest derives from a process's own (`gpu_state`, off-CPU `__type__` and
`__thread__`: at most 8 per process), and `pid`'s values (a process's pid makes its label set distinct,
so the label-set cap bounds them). Bounds this keeps, per tenant: label sets, label names x values per
name, and the bytes of distinct values; with a token shared by every agent (no per-node credential) a
token holder can still speak for many nodes, each with its own quota: `max_series_total` bounds them all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from fleetprof.collector.ingest.validate import IngestLimits, fail
from fleetprof.collector.model.profile import Labels

# Labels whose values are not capped per name: pid makes each process's label set distinct (the
# label-set cap bounds it), node is the tenant itself.
UNCAPPED_VALUES = frozenset({"pid", "node"})
_GENERATIONS = 4  # a label set unused for this many quarter-horizons is forgotten


@dataclass
class _Tenant:
    """One tenant's live label sets (label-set id -> generation last used, and its labels) and, per label
    name, each value's count of live sets holding it."""

    used: dict[int, int] = field(default_factory=dict)
    labels: dict[int, Labels] = field(default_factory=dict)
    values: dict[str, dict[str, int]] = field(default_factory=dict)
    value_bytes: int = 0
    swept: int = 0  # the generation of its last sweep


class SeriesQuota:
    """The live label sets of every tenant, checked and admitted a batch at a time. Thread-safe; `check`
    changes nothing (it raises BatchError naming the cap), `admit` records a checked batch's sets."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[Hashable, _Tenant] = {}
        self._total = 0  # live label sets over all tenants
        self._value_bytes = 0  # bytes of distinct values over all tenants
        self._swept = 0  # the generation of the last sweep of every tenant

    def _generation(self, limits: IngestLimits) -> int:
        """The current quarter-horizon; once per quarter every tenant is swept, so a node that stopped
        sending (gone, or renamed) leaves the quota within a horizon (lock held)."""
        generation = int(self._clock() // (limits.series_horizon_s / _GENERATIONS))
        if generation > self._swept:
            self._swept = generation
            for key in list(self._tenants):
                self._tenant(key, generation)
        return generation

    def _tenant(self, key: Hashable, generation: int) -> _Tenant | None:
        """The tenant's state with label sets past the horizon forgotten (lock held)."""
        tenant = self._tenants.get(key)
        if tenant is not None and tenant.swept < generation:
            tenant.swept = generation
            old = [lid for lid, g in tenant.used.items() if g <= generation - _GENERATIONS]
            for lid in old:
                del tenant.used[lid]
                self._forget_values(tenant, tenant.labels.pop(lid))
            self._total -= len(old)
            if not tenant.used:
                del self._tenants[key]
                return None
        return tenant

    def _forget_values(self, tenant: _Tenant, labels: Labels) -> None:
        for name, value in labels:
            if name in UNCAPPED_VALUES:
                continue
            values = tenant.values[name]
            n = values[value] - 1
            if n:
                values[value] = n
                continue
            del values[value]
            size = len(value.encode())
            tenant.value_bytes -= size
            self._value_bytes -= size
            if not values:
                del tenant.values[name]

    def check(
        self, seq: int, node: str, key: Hashable, sets: Sequence[tuple[int, Labels]], limits: IngestLimits
    ) -> None:
        """Raise BatchError when the batch's label sets `sets` ((id, labels) of each process) would take
        the tenant `key` (of node `node`) or all tenants past a cap of `limits`."""
        with self._lock:
            tenant = self._tenant(key, self._generation(limits))
            used = tenant.used if tenant is not None else {}
            new = {lid: labels for lid, labels in sets if lid not in used}
            if not new:
                return
            live = len(used) + len(new)
            if live > limits.max_series_per_node:
                fail(
                    seq,
                    "series_limit",
                    f"node {node!r} would have {live} label sets (processes) within "
                    f"{limits.series_horizon_s:.0f} s, over the limit of {limits.max_series_per_node} per "
                    "node (--max-series-per-node)",
                )
            if self._total + len(new) > limits.max_series_total:
                fail(
                    seq,
                    "series_limit_total",
                    f"the collector holds {self._total} label sets from all nodes; {len(new)} more from node "
                    f"{node!r} is over the limit of {limits.max_series_total} (--max-series-total)",
                )
            self._check_values(seq, node, tenant, new.values(), limits)

    def _check_values(
        self, seq: int, node: str, tenant: _Tenant | None, sets: Sequence[Labels], limits: IngestLimits
    ) -> None:
        known = tenant.values if tenant is not None else {}
        added: dict[str, set[str]] = {}
        added_bytes = 0
        for labels in sets:
            for name, value in labels:
                if name in UNCAPPED_VALUES or value in known.get(name, ()):
                    continue
                fresh = added.setdefault(name, set())
                if value not in fresh:
                    fresh.add(value)
                    added_bytes += len(value.encode())
        for name, fresh in added.items():
            n = len(known.get(name, ())) + len(fresh)
            if n > limits.max_values_per_label:
                fail(
                    seq,
                    "label_values_limit",
                    f"label {name!r} of node {node!r} would have {n} distinct values within "
                    f"{limits.series_horizon_s:.0f} s, over the limit of {limits.max_values_per_label} "
                    "(--max-label-values)",
                )
        names = len(known.keys() | added.keys())
        if names > limits.max_label_names_per_node:
            fail(
                seq,
                "label_values_limit",
                f"node {node!r} would use {names} label names, over the limit of "
                f"{limits.max_label_names_per_node}",
            )
        total = (tenant.value_bytes if tenant is not None else 0) + added_bytes
        if total > limits.max_label_value_bytes_per_node:
            fail(
                seq,
                "label_values_limit",
                f"node {node!r} would hold {total} bytes of distinct label values, over the limit of "
                f"{limits.max_label_value_bytes_per_node}",
            )
        if self._value_bytes + added_bytes > limits.max_label_value_bytes_total:
            fail(
                seq,
                "series_limit_total",
                f"the collector holds {self._value_bytes} bytes of distinct label values from all nodes; "
                f"{added_bytes} more from node {node!r} is over the limit of "
                f"{limits.max_label_value_bytes_total}",
            )

    def admit(self, key: Hashable, sets: Sequence[tuple[int, Labels]], limits: IngestLimits) -> None:
        """Record a checked batch's label sets as used now."""
        if not sets:
            return
        with self._lock:
            generation = self._generation(limits)
            tenant = self._tenant(key, generation)
            if tenant is None:
                tenant = self._tenants[key] = _Tenant(swept=generation)
            used = tenant.used
            for lid, labels in sets:
                if lid in used:
                    continue
                used[lid] = generation
                tenant.labels[lid] = labels
                self._total += 1
                for name, value in labels:
                    if name in UNCAPPED_VALUES:
                        continue
                    values = tenant.values.setdefault(name, {})
                    n = values.get(value, 0)
                    if not n:
                        size = len(value.encode())
                        tenant.value_bytes += size
                        self._value_bytes += size
                    values[value] = n + 1
            used.update(zip((lid for lid, _ in sets), repeat(generation)))

    def sizes(self) -> dict[str, int]:
        """What the quota holds: tenants, live label sets, distinct (tenant, label, value) entries."""
        with self._lock:
            return {
                "tenants": len(self._tenants),
                "label_sets": self._total,
                "values": sum(len(v) for t in self._tenants.values() for v in t.values.values()),
                "value_bytes": self._value_bytes,
            }
