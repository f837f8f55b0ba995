"""Which (agent id, sequence) batches were already stored: the collector's deduplication state.

Bounded two ways. Per agent, only the newest `window` sequences are kept (agents send in increasing order
and resend at most their queue). In time, an entry whose batch window started before the resend horizon
is dropped: ingest rejects a batch that old as stale (MAX_BATCH_AGE_S), so a resend of it can never
be stored again and its entry can never be needed. Every agent restart makes a new agent id; the horizon
is what makes the ids of agents gone for good disappear.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from fleetprof.collector.model.profile import MAX_BATCH_AGE_S


class SeenSequences:
    """Per agent id, the sequences already ingested, each with its batch's window start (unix seconds).
    Entries past `horizon_s` on `clock` are swept every `sweep_every` additions, and by `sweep()`."""

    def __init__(
        self,
        window: int = 4096,
        max_agents: int = 100_000,
        horizon_s: float = MAX_BATCH_AGE_S,
        clock: Callable[[], float] = time.time,
        sweep_every: int = 4096,
    ):
        self._window = window
        self._max_agents = max_agents
        self._horizon_s = horizon_s
        self._clock = clock
        self._agents: OrderedDict[str, dict[int, float]] = OrderedDict()
        self._sweep_every = sweep_every
        self._adds = 0

    def seen(self, agent_id: str, seq: int) -> bool:
        s = self._agents.get(agent_id)
        return s is not None and seq in s

    def add(self, agent_id: str, seq: int, start: float = 0.0) -> None:
        s = self._agents.setdefault(agent_id, {})
        self._agents.move_to_end(agent_id)
        s[seq] = start
        if len(s) > 2 * self._window:
            cutoff = max(s) - self._window
            for old in [x for x in s if x < cutoff]:
                del s[old]
        while len(self._agents) > self._max_agents:
            self._agents.popitem(last=False)
        self._adds += 1
        if self._adds >= self._sweep_every:  # an O(entries) pass, so only once per this many additions
            self.sweep()

    def sweep(self) -> None:
        """Drop entries whose window started before the horizon, and agents left with none. Entries with
        start 0 (written before windows were kept) go too."""
        self._adds = 0
        horizon = self._clock() - self._horizon_s
        for agent in list(self._agents):
            s = self._agents[agent]
            for seq in [seq for seq, start in s.items() if start < horizon]:
                del s[seq]
            if not s:
                del self._agents[agent]

    def __len__(self) -> int:
        return sum(len(s) for s in self._agents.values())

    @property
    def agents(self) -> int:
        return len(self._agents)
