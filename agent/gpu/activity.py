"""What a process's GPU activity records (agent/gpu/cupti_ring.py) say: when each of its GPUs was busy or
idle at µs resolution, its idle gaps, kernel time per kernel name, and kernel time under the CPU stacks that
launched the kernels. Pure Python over plain data: no BPF, no /proc.

Definitions kept here:
  * A device is **busy** while any kernel, memcpy or memset of the process runs on it (the union of their
    [start, end) intervals), **idle** otherwise. Idle stretches shorter than MIN_GAP_NS (1 µs) count as busy:
    the records' own resolution, and what "µs resolution" promises.
  * What is known: from the first record's start (or the start of what the bounds below kept) to the
    header's `flushed_ns`, the time up to which the library has handed over every record CUPTI had
    complete (once the reader has read every record published before it: RingBatch.complete_until),
    less the spans where the reader lost records. Past `flushed_ns` a kernel may still be running or
    waiting in CUPTI's buffers, so `state()` answers None there rather than "idle".
  * Kernel time under a stack is apportioned per kernel name, so each name's total stays exact when only
    some launches are sampled: ns(K, S) = sampled ns of K under S x (total ns of K / sampled ns of K).
    A name none of whose launches was sampled stays whole under the stack key None.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fleetprof.agent.gpu.cupti_ring import KIND_KERNEL, KernelRecord, LaunchRecord, RingBatch
from fleetprof.agent.model import Gap, GapStats

MIN_GAP_NS = 1_000
MAX_INTERVALS = 1_000_000  # per device: 16 MB; older intervals are dropped first
HORIZON_NS = 300 * 1_000_000_000  # intervals that ended longer ago than this before the newest are dropped
MAX_LAUNCHES = 1_000_000  # sampled launches remembered for joining kernels that arrive later
MAX_HOLES = 1024  # spans left unknown by lost records; past that, what is known starts after the oldest

State = str  # "busy" or "idle"


def merge_intervals(
    starts: np.ndarray, ends: np.ndarray, min_gap: int = MIN_GAP_NS
) -> tuple[np.ndarray, np.ndarray]:
    """The union of [start, end) intervals as sorted, disjoint intervals at least `min_gap` apart. Empty
    intervals are left out: an instant is not busy time, and must not bridge a gap."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    e = np.maximum.accumulate(ends[order])
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] - e[:-1] >= min_gap
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], e[last]


class BusyTimeline:
    """One device's busy intervals: sorted, disjoint, >= MIN_GAP_NS apart; bounded by MAX_INTERVALS."""

    def __init__(self, max_intervals: int = MAX_INTERVALS) -> None:
        self.starts = np.empty(0, np.int64)
        self.ends = np.empty(0, np.int64)
        self.max_intervals = max_intervals
        self.dropped_before = 0  # intervals that ended before this were dropped (bounds)

    def add(self, starts: np.ndarray, ends: np.ndarray) -> None:
        s, e = merge_intervals(starts, ends)
        if len(s) == 0:
            return
        # Records arrive out of order (streams, buffers): only the tail that could touch them is re-merged.
        i = int(np.searchsorted(self.ends, s[0] - MIN_GAP_NS, side="left"))
        ms, me = merge_intervals(np.concatenate([self.starts[i:], s]), np.concatenate([self.ends[i:], e]))
        self.starts = np.concatenate([self.starts[:i], ms])
        self.ends = np.concatenate([self.ends[:i], me])
        if len(self.starts) > self.max_intervals:
            cut = len(self.starts) - self.max_intervals
            self.dropped_before = int(self.ends[cut - 1])
            self.starts, self.ends = self.starts[cut:], self.ends[cut:]

    def drop_before(self, t: int) -> None:
        i = int(np.searchsorted(self.ends, t, side="left"))
        if i:
            self.dropped_before = max(self.dropped_before, int(self.ends[i - 1]))
            self.starts, self.ends = self.starts[i:], self.ends[i:]

    def busy_at(self, t: int) -> bool:
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        return i >= 0 and t < int(self.ends[i])

    def busy_ns(self, t0: int, t1: int) -> int:
        if t1 <= t0:
            return 0
        lo = int(np.searchsorted(self.ends, t0, side="right"))
        hi = int(np.searchsorted(self.starts, t1, side="left"))
        if hi <= lo:
            return 0
        s = np.maximum(self.starts[lo:hi], t0)
        e = np.minimum(self.ends[lo:hi], t1)
        return int((e - s).sum())

    def gaps(self, t0: int, t1: int) -> list[Gap]:
        """The idle stretches within [t0, t1)."""
        if t1 <= t0:
            return []
        lo = int(np.searchsorted(self.ends, t0, side="right"))
        hi = int(np.searchsorted(self.starts, t1, side="left"))
        out = []
        cursor = t0
        for s, e in zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist(), strict=True):
            if s > cursor:
                out.append(Gap(cursor, s, clipped=cursor == t0))
            cursor = max(cursor, e)
        if cursor < t1:
            out.append(Gap(cursor, t1, clipped=True))
        return out


@dataclass(frozen=True)
class KernelTotal:
    count: int
    ns: int


class ProcessActivity:
    """The GPU activity of one process, fed batch after batch by its ring reader.

    A batch that comes with records lost or torn leaves a hole: from where the records were complete
    before it to the newest end it holds, nothing is claimed idle (state None, no gaps, no idle time). The
    surviving records still count as busy time and kernel time: what they say is true, only incomplete."""

    def __init__(self, max_intervals: int = MAX_INTERVALS, horizon_ns: int = HORIZON_NS) -> None:
        self.devices: dict[int, BusyTimeline] = {}
        self.known_from: int | None = None
        self.complete_until = 0
        self.kernels: dict[str, KernelTotal] = {}  # cumulative, by name ("" for unnamed)
        self.holes: deque[tuple[int, int]] = deque()  # [start, end), oldest first, at most MAX_HOLES
        self._max_intervals = max_intervals
        self._horizon = horizon_ns
        self._latest = 0

    def add(self, batch: RingBatch) -> None:
        acts = batch.activities
        before = self.complete_until
        if len(acts):
            start = acts["start_ns"].astype(np.int64)
            end = np.maximum(acts["end_ns"].astype(np.int64), start)
            if self.known_from is None:
                self.known_from = int(start.min())
            for dev in np.unique(acts["device_id"]).tolist():
                sel = acts["device_id"] == dev
                line = self.devices.setdefault(int(dev), BusyTimeline(self._max_intervals))
                line.add(start[sel], end[sel])
            self._latest = max(self._latest, int(end.max()))
            kern = acts["kind"] == KIND_KERNEL
            refs, inverse = np.unique(acts["name_ref"][kern], return_inverse=True)
            ns = np.bincount(inverse, weights=(end - start)[kern], minlength=len(refs))
            counts = np.bincount(inverse, minlength=len(refs))
            for ref, n, c in zip(refs.tolist(), ns.tolist(), counts.tolist(), strict=True):
                name = batch.names.get(ref, "")
                old = self.kernels.get(name, KernelTotal(0, 0))
                self.kernels[name] = KernelTotal(old.count + c, old.ns + int(n))
        self.complete_until = max(self.complete_until, batch.complete_until)
        if (batch.lost or batch.torn) and self.known_from is not None:
            # The missing records ended before the flush that delivered this batch, and (written in order)
            # after what an earlier poll saw complete: somewhere in this span.
            lo = before if before else self.known_from
            self.holes.append((lo, max(self.complete_until, self._latest)))
            if len(self.holes) > MAX_HOLES:
                self.known_from = max(self.known_from, self.holes.popleft()[1])
        if self._latest and self._horizon:
            cutoff = self._latest - self._horizon
            for line in self.devices.values():
                line.drop_before(cutoff)
            while self.holes and self.holes[0][1] < cutoff:
                self.holes.popleft()
        if self.known_from is not None:
            dropped = max((line.dropped_before for line in self.devices.values()), default=0)
            self.known_from = max(self.known_from, dropped)

    def _known(self, t0: int, t1: int) -> list[tuple[int, int]]:
        """[t0, t1) ∩ what the records cover: after known_from, before complete_until, outside holes."""
        lo = max(t0, self.known_from if self.known_from is not None else t1)
        hi = min(t1, self.complete_until)
        spans = []
        for h0, h1 in self.holes:
            if h1 <= lo or h0 >= hi:
                continue
            if h0 > lo:
                spans.append((lo, h0))
            lo = max(lo, h1)
        if lo < hi:
            spans.append((lo, hi))
        return spans

    def device_state(self, device: int, t: int) -> State | None:
        if not self._known(t, t + 1) or device not in self.devices:
            return None
        return "busy" if self.devices[device].busy_at(t) else "idle"

    def state(self, t: int) -> State | None:
        """ "busy" if a kernel or copy of the process ran on any of its GPUs at CLOCK_MONOTONIC time t,
        "idle" if none did, None where the records do not cover t."""
        if not self._known(t, t + 1) or not self.devices:
            return None
        return "busy" if any(line.busy_at(t) for line in self.devices.values()) else "idle"

    def is_idle(self, t: int) -> bool | None:
        state = self.state(t)
        return None if state is None else state == "idle"

    def _timeline(self, device: int | None) -> BusyTimeline | None:
        if device is not None:
            return self.devices.get(device)
        if len(self.devices) == 1:
            return next(iter(self.devices.values()))
        union = BusyTimeline(max_intervals=1 << 62)
        for line in self.devices.values():
            union.add(line.starts, line.ends)
        return union

    def gaps(self, t0: int, t1: int, device: int | None = None) -> list[Gap]:
        """Idle stretches within [t0, t1) ∩ what is known: of `device`, or when no device of the process
        was busy (device None). A gap cut by an edge of the window or of what is known is `clipped`."""
        line = self._timeline(device)
        if line is None:
            return []
        out = []
        for lo, hi in self._known(t0, t1):
            for g in line.gaps(lo, hi):
                out.append(Gap(g.start_ns, g.end_ns, g.clipped or g.start_ns == lo or g.end_ns == hi))
        return out

    def gap_stats(self, t0: int, t1: int, device: int | None = None) -> GapStats:
        return GapStats.of(self.gaps(t0, t1, device))

    def known_ns(self, t0: int, t1: int) -> int:
        """Nanoseconds of [t0, t1) the records cover."""
        return sum(hi - lo for lo, hi in self._known(t0, t1))

    def ended_gaps(self, t0: int, t1: int, device: int) -> list[Gap]:
        """The device's gaps that end in [t0, t1), each whole (it may start before t0): an idle stretch
        between two busy intervals, all of it known. Each gap is in exactly one of a run of adjoining
        windows, so summed over them nothing is counted twice; one cut by a hole is not a gap we know."""
        line = self.devices.get(device)
        if line is None or self.known_from is None:
            return []
        lo = int(np.searchsorted(line.starts, t0, side="left"))
        hi = int(np.searchsorted(line.starts, t1, side="left"))
        out = []
        for i in range(lo, hi):
            if i > 0:
                start = int(line.ends[i - 1])
            elif line.dropped_before:  # the interval before it fell out of the bounds; its end is kept
                start = line.dropped_before
            else:
                continue  # the device's first busy interval: nothing before it is known
            end = int(line.starts[i])
            if end - start >= MIN_GAP_NS and self._known(start, end) == [(start, end)]:
                out.append(Gap(start, end, clipped=False))
        return out

    def idle_ns(self, t0: int, t1: int, device: int | None = None) -> int:
        """Idle nanoseconds within [t0, t1) ∩ what is known."""
        line = self._timeline(device)
        if line is None:
            return 0
        return sum((hi - lo) - line.busy_ns(lo, hi) for lo, hi in self._known(t0, t1))


# ---- kernel time under launching stacks -------------------------------------------------------------------


class LaunchIndex:
    """Sampled launches by correlation id, both ids of each (a kernel record may carry the runtime call's
    or the driver call's); the oldest are forgotten past `max_launches`."""

    def __init__(self, max_launches: int = MAX_LAUNCHES) -> None:
        self._by_id: OrderedDict[int, LaunchRecord] = OrderedDict()
        self._max = max_launches

    def add(self, launches: Iterable[LaunchRecord]) -> None:
        for launch in launches:
            for cid in (launch.correlation_id, launch.inner_correlation_id):
                if cid:
                    self._by_id[cid] = launch
                    self._by_id.move_to_end(cid)
        while len(self._by_id) > 2 * self._max:
            self._by_id.popitem(last=False)

    def get(self, correlation_id: int) -> LaunchRecord | None:
        return self._by_id.get(correlation_id)

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(frozen=True)
class KernelTime:
    """GPU time of a set of kernels: exact per kernel name, apportioned per (stack, name)."""

    by_stack: dict[tuple[Hashable | None, str], int]  # (stack key or None, kernel name) -> ns
    by_name: dict[str, KernelTotal]
    sampled_kernels: int  # kernels whose launch was sampled and whose stack is known
    kernels: int


def kernel_time(
    kernels: Iterable[KernelRecord], launches: LaunchIndex, stacks: Mapping[int, Hashable]
) -> KernelTime:
    """Kernel time under the launching stacks. `stacks` maps a sampled launch's correlation id (the one the
    marker passes: LaunchRecord.correlation_id) to an opaque stack key (the agent's stack id)."""
    totals: dict[str, list[int]] = {}
    sampled: dict[str, dict[Hashable, int]] = {}
    n = n_sampled = 0
    for k in kernels:
        name = k.name or f"[kernel {k.name_hash:08x}]"
        dur = max(0, k.end_ns - k.start_ns)
        t = totals.setdefault(name, [0, 0])
        t[0] += 1
        t[1] += dur
        n += 1
        launch = launches.get(k.correlation_id)
        stack = stacks.get(launch.correlation_id) if launch is not None else None
        if stack is not None:
            per = sampled.setdefault(name, {})
            per[stack] = per.get(stack, 0) + dur
            n_sampled += 1
    by_stack: dict[tuple[Hashable | None, str], int] = {}
    for name, (_count, total) in totals.items():
        per = sampled.get(name)
        seen = sum(per.values()) if per else 0
        if not seen:
            by_stack[(None, name)] = by_stack.get((None, name), 0) + total
            continue
        # Largest remainder: the apportioned parts add up to the exact total.
        exact = {s: ns * total / seen for s, ns in per.items()}
        parts = {s: int(v) for s, v in exact.items()}
        short = total - sum(parts.values())
        for s in sorted(exact, key=lambda s: exact[s] - parts[s], reverse=True)[:short]:
            parts[s] += 1
        for s, ns in parts.items():
            by_stack[(s, name)] = ns
    by_name = {name: KernelTotal(c, ns) for name, (c, ns) in totals.items()}
    return KernelTime(by_stack, by_name, n_sampled, n)


def launch_counts(
    launches: Iterable[LaunchRecord], stacks: Mapping[int, Hashable]
) -> dict[Hashable | None, int]:
    """Launches under each stack: the sampled launches' weights (each stands for `weight` launches of its
    thread), under None when the stack is unknown."""
    out: dict[Hashable | None, int] = {}
    for launch in launches:
        key = stacks.get(launch.correlation_id)
        out[key] = out.get(key, 0) + launch.weight
    return out
