"""Per GPU, a bounded timeline of utilization at poll resolution and who ran on it: answers "was the GPU
of process P busy or idle at time T?" (the GPU-idle tagging of CPU samples asks exactly that)."""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Literal

from fleetprof.agent.model import IDLE_BELOW_PERCENT

State = Literal["busy", "idle"]


class _GpuLine:
    """One GPU's polls, oldest first: times, utilization (None: unknown) and the pids on it."""

    def __init__(self, max_points: int):
        self.times: deque[float] = deque(maxlen=max_points)
        self.util: deque[int | None] = deque(maxlen=max_points)
        self.pids: deque[frozenset[int]] = deque(maxlen=max_points)

    def add(self, t: float, util: int | None, pids: frozenset[int]) -> None:
        if self.times and t <= self.times[-1]:
            return  # polls arrive in order; a clock step backwards must not break bisection
        if self.pids and self.pids[-1] == pids:
            pids = self.pids[-1]  # share the set: most polls see the same processes
        self.times.append(t)
        self.util.append(util)
        self.pids.append(pids)

    def point_for(self, t: float, max_gap: float) -> int | None:
        """The poll describing time t. NVML's utilization covers the sample period *before* a poll, so
        that is the first poll at or after t; past the last poll, the last one. None if it is further
        than max_gap from t."""
        i = bisect.bisect_left(self.times, t)
        if i == len(self.times):
            i -= 1
        if i < 0 or abs(self.times[i] - t) > max_gap:
            return None
        return i

    def drop_before(self, t: float) -> None:
        while self.times and self.times[0] < t:
            self.times.popleft()
            self.util.popleft()
            self.pids.popleft()


class GpuTimeline:
    """Thread-safe. Times are in the poller's clock (unix seconds by default). A GPU is **busy** in a
    poll when its utilization is >= `idle_below_percent` (default 5%, see model.IDLE_BELOW_PERCENT),
    **idle** below it. MIG instances have no utilization in NVML, so their state is unknown (None)."""

    def __init__(
        self,
        max_gap_s: float = 2.0,
        horizon_s: float = 300.0,
        max_points: int = 4096,
        idle_below_percent: int = IDLE_BELOW_PERCENT,
    ):
        self.max_gap_s = max_gap_s  # how far a poll may be from a queried time and still describe it
        self.horizon_s = horizon_s
        self.idle_below_percent = idle_below_percent
        self._max_points = max_points
        self._lock = threading.Lock()
        self._lines: dict[str, _GpuLine] = {}
        self._latest: dict[str, frozenset[int]] = {}  # uuid -> pids at its last poll

    def record(self, t: float, utilization: dict[str, int | None], pids: dict[str, set[int]]) -> None:
        """One poll: utilization % per GPU UUID (None: not reported) and the pids running on each."""
        with self._lock:
            for uuid, util in utilization.items():
                line = self._lines.get(uuid)
                if line is None:
                    line = self._lines[uuid] = _GpuLine(self._max_points)
                on = frozenset(pids.get(uuid, ()))
                line.add(t, util, on)
                self._latest[uuid] = on
            for uuid in [u for u in self._lines if u not in utilization]:
                self._latest.pop(uuid, None)  # not seen this poll (lost, or MIG reconfigured)
            cutoff = t - self.horizon_s
            for uuid, line in list(self._lines.items()):
                line.drop_before(cutoff)
                if not line.times:
                    del self._lines[uuid]

    def gpu_state(self, uuid: str, t: float) -> State | None:
        with self._lock:
            line = self._lines.get(uuid)
            i = line.point_for(t, self.max_gap_s) if line else None
            return None if i is None else self._state_of(line.util[i])

    def state(self, pid: int, t: float) -> State | None:
        """ "busy" if any GPU the process was on at t was busy, "idle" if every such GPU with a known
        utilization was idle, None if it was on no GPU at t (or none of its GPUs' state is known)."""
        seen_idle = False
        with self._lock:
            for line in self._lines.values():
                i = line.point_for(t, self.max_gap_s)
                if i is None or pid not in line.pids[i]:
                    continue
                st = self._state_of(line.util[i])
                if st == "busy":
                    return "busy"
                seen_idle = seen_idle or st == "idle"
        return "idle" if seen_idle else None

    def gpu_pids(self) -> set[int]:
        """Pids running on any GPU at its latest poll."""
        with self._lock:
            return set().union(*self._latest.values()) if self._latest else set()

    def gpus_of(self, pid: int) -> set[str]:
        """UUIDs of the GPUs the process was on at their latest poll."""
        with self._lock:
            return {uuid for uuid, pids in self._latest.items() if pid in pids}

    def current_states(self) -> dict[int, State]:
        """pid → its state at the latest poll, for every pid on a GPU with a known utilization (what a
        BPF map of GPU state per pid would be refreshed from after each poll)."""
        out: dict[int, State] = {}
        with self._lock:
            for uuid, pids in self._latest.items():
                line = self._lines.get(uuid)
                st = self._state_of(line.util[-1]) if line and line.times else None
                if st is None:
                    continue
                for pid in pids:
                    if out.get(pid) != "busy":
                        out[pid] = st
        return out

    def _state_of(self, util: int | None) -> State | None:
        if util is None:
            return None
        return "busy" if util >= self.idle_below_percent else "idle"
