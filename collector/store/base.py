"""The store interface ingest writes to and queries read from, and the plain rows they exchange."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from collector.query.selector import Selector
from collector.render.tree import FrameKey

# Samples of processes on a GPU carry the GPU's state at sample time under this label ("idle" or "busy";
# absent for everything else). Set by ingest, selected by the API's gpu=idle|busy.
GPU_STATE_NAME = "gpu_state"

Labels = tuple[tuple[str, str], ...]
"""A label set, sorted by name, without empty values."""

Stack = tuple[FrameKey, ...]
"""Root first."""


@dataclass
class SyscallAgg:
    """Calls of one syscall: `count` is exact; latency was measured on `timed` of them.

    hist[i] counts timed calls with latency in [2^i, 2^(i+1)) ns (the last bucket is open-ended).
    Estimates for all calls scale by count / timed.
    """

    count: int = 0
    timed: int = 0
    timed_ns: int = 0
    hist: list[int] = field(default_factory=list)

    def add(self, other: SyscallAgg) -> None:
        self.count += other.count
        self.timed += other.timed
        self.timed_ns += other.timed_ns
        if len(self.hist) < len(other.hist):
            self.hist.extend([0] * (len(other.hist) - len(self.hist)))
        for i, n in enumerate(other.hist):
            self.hist[i] += n

    @property
    def estimated_ns(self) -> float:
        """Total time of all calls, scaled from the timed ones (0 when none was timed)."""
        return self.timed_ns * self.count / self.timed if self.timed else 0.0

    def quantile_ns(self, q: float) -> float | None:
        """Latency quantile from the log2 histogram, interpolated linearly inside the bucket."""
        if not self.timed:
            return None
        target = q * self.timed
        seen = 0
        for i, n in enumerate(self.hist):
            if n and seen + n >= target:
                lo = float(1 << i)
                return lo + (target - seen) / n * lo  # the bucket spans [2^i, 2^(i+1))
            seen += n
        return float(1 << max(len(self.hist) - 1, 0))


SyscallRow = tuple[Labels, str, SyscallAgg]
"""(process labels, syscall name, its calls in the window)."""


@dataclass(frozen=True)
class ProfileRows:
    """One ingested window: (labels, stack, count) rows at a time range, sampled at `frequency_hz`, and
    the window's syscall rows."""

    start: float  # unix seconds
    end: float
    frequency_hz: int
    rows: Sequence[tuple[Labels, Stack, int]]
    syscalls: Sequence[SyscallRow] = ()
    # Optional, parallel to `rows`: the stable content ids (collector/store/ids.py) of each row's label set
    # and stack. Ingest fills them from its caches so stores never hash a stack frame by frame; rows made
    # without them (tests, tools) get them computed by the store.
    keys: Sequence[tuple[int, int]] | None = None


@dataclass(frozen=True)
class Selection:
    """A merged profile: stack -> samples, and the sampling frequency of the data it came from."""

    stacks: dict[Stack, int]
    frequency_hz: int | None

    @property
    def total(self) -> int:
        return sum(self.stacks.values())


@dataclass(frozen=True)
class Grouped:
    """Samples per distinct value tuple of the group-by labels ("" where a series lacks a label)."""

    by: tuple[str, ...]
    totals: dict[tuple[str, ...], int]
    frequency_hz: int | None


class ProfileStore(Protocol):
    """What ingest and query need from storage. The in-memory store implements it; others may."""

    def write(self, profile: ProfileRows) -> None: ...

    def select(self, selector: Selector, start: float, end: float) -> Selection: ...

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped: ...

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        """Syscall aggregates grouped by labels; "syscall" is a valid group-by name."""
        ...

    def label_names(self, start: float | None = None, end: float | None = None) -> list[str]: ...

    def label_values(self, name: str, start: float | None = None, end: float | None = None) -> list[str]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None:
        """Make everything written so far durable (where the store is) and release its resources."""
        ...


@runtime_checkable
class DurableBatches(Protocol):
    """A store that owns deduplication and durability of whole batches: ingest hands it each batch's wire
    bytes with its rows and acknowledges only after `write_logged` returns (the batch is then safe)."""

    def seen(self, source: str, sequence: int) -> bool: ...

    def write_logged(self, source: str, sequence: int, payload: bytes, profile: ProfileRows) -> bool:
        """Log and store one batch; False (and nothing stored) if (source, sequence) was stored before."""
        ...
