"""Which (agent id, sequence) batches were already stored: the collector's deduplication state."""

from __future__ import annotations

from collections import OrderedDict


class SeenSequences:
    """Per agent id, the sequences already ingested (bounded: agents send them in increasing order)."""

    def __init__(self, window: int = 4096, max_agents: int = 100_000):
        self._window = window
        self._max_agents = max_agents
        self._agents: OrderedDict[str, set[int]] = OrderedDict()

    def seen(self, agent_id: str, seq: int) -> bool:
        s = self._agents.get(agent_id)
        return s is not None and seq in s

    def add(self, agent_id: str, seq: int) -> None:
        s = self._agents.setdefault(agent_id, set())
        self._agents.move_to_end(agent_id)
        s.add(seq)
        if len(s) > 2 * self._window:
            cutoff = max(s) - self._window
            s.difference_update([x for x in s if x < cutoff])
        while len(self._agents) > self._max_agents:
            self._agents.popitem(last=False)

    def snapshot(self) -> dict[str, list[int]]:
        """Every remembered sequence per agent id (what a checkpoint persists)."""
        return {agent: sorted(seqs) for agent, seqs in self._agents.items()}
