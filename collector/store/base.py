"""The store interface ingest writes to and queries read from, and the plain rows they exchange."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Protocol, runtime_checkable

import numpy as np

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


_EMPTY = np.zeros(0, dtype=np.int64)
_FIRST = itemgetter(0)


class StackTable(Sequence[tuple[int, Stack]]):
    """A window's stack table as a column of content ids plus slots into a shared list of frames: entry i
    is (ids[i], frames[slots[i]]). Ingest hands a store thousands of known stacks this way without making
    a tuple per stack; a store reads `ids` as a column and the frames of only the stacks new to it. The
    frames list is only ever appended to by its owner (collector/decode.py), so entries never change."""

    __slots__ = ("ids", "_slots", "_frames")

    def __init__(self, ids: np.ndarray, slots: np.ndarray, frames: Sequence[Stack]) -> None:
        self.ids = ids
        self._slots = slots
        self._frames = frames

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):  # noqa: ANN001, ANN204 (Sequence's int and slice overloads)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return int(self.ids[i]), self._frames[self._slots[i]]

    def __iter__(self):  # noqa: ANN204
        return zip(self.ids.tolist(), map(self._frames.__getitem__, self._slots.tolist()), strict=True)


@dataclass(frozen=True, eq=False)
class ProfileRows:
    """One ingested window, in columns: row i is `counts[i]` samples of the label set
    `label_sets[label_index[i]]` with the stack `stacks[stack_index[i]]`, sampled at `frequency_hz`; and
    the window's syscall rows.

    `label_sets` and `stacks` are the window's definition tables, each entry (stable content id
    (collector/store/ids.py), content); the same content may appear twice. Ingest builds the tables from
    its caches and the index columns straight from the batch's sample columns, so no store does per-row
    Python work. `from_rows` builds one from (labels, stack, count) rows (tests, tools).
    """

    start: float  # unix seconds
    end: float
    frequency_hz: int
    label_sets: Sequence[tuple[int, Labels]] = ()
    stacks: Sequence[tuple[int, Stack]] = ()
    label_index: np.ndarray = field(default_factory=lambda: _EMPTY)  # int64, per row
    stack_index: np.ndarray = field(default_factory=lambda: _EMPTY)  # int64, per row
    counts: np.ndarray = field(default_factory=lambda: _EMPTY)  # int64, per row, > 0
    syscalls: Sequence[SyscallRow] = ()

    @classmethod
    def from_rows(
        cls,
        start: float,
        end: float,
        frequency_hz: int,
        rows: Iterable[tuple[Labels, Stack, int]],
        syscalls: Sequence[SyscallRow] = (),
    ) -> ProfileRows:
        from collector.store.ids import labels_id, stack_id  # ids imports this module

        label_pos: dict[Labels, int] = {}
        stack_pos: dict[Stack, int] = {}
        li, si, counts = [], [], []
        for labels, stack, count in rows:
            li.append(label_pos.setdefault(labels, len(label_pos)))
            si.append(stack_pos.setdefault(stack, len(stack_pos)))
            counts.append(count)
        return cls(
            start,
            end,
            frequency_hz,
            [(labels_id(lb), lb) for lb in label_pos],
            [(stack_id(st), st) for st in stack_pos],
            np.array(li, dtype=np.int64),
            np.array(si, dtype=np.int64),
            np.array(counts, dtype=np.int64),
            syscalls,
        )

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def rows(self) -> list[tuple[Labels, Stack, int]]:
        """The rows as (labels, stack, count) tuples: for tests and tools, not for hot paths."""
        return [
            (self.label_sets[li][1], self.stacks[si][1], c)
            for li, si, c in zip(
                self.label_index.tolist(), self.stack_index.tolist(), self.counts.tolist(), strict=True
            )
        ]

    @cached_property
    def label_table_ids(self) -> np.ndarray:
        """The content ids of `label_sets`, in order."""
        return np.fromiter(map(_FIRST, self.label_sets), dtype=np.int64, count=len(self.label_sets))

    @cached_property
    def stack_table_ids(self) -> np.ndarray:
        """The content ids of `stacks`, in order."""
        if isinstance(self.stacks, StackTable):
            return self.stacks.ids
        return np.fromiter(map(_FIRST, self.stacks), dtype=np.int64, count=len(self.stacks))

    def label_ids(self) -> np.ndarray:
        """Per row, the content id of its label set."""
        return self.label_table_ids[self.label_index]

    def stack_ids(self) -> np.ndarray:
        """Per row, the content id of its stack."""
        return self.stack_table_ids[self.stack_index]


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
        """Log and store one batch; False (and nothing stored) if (source, sequence) was stored before.
        Raises StoreUnavailable (and stores nothing) when the batch cannot be logged now."""
        ...


class StoreUnavailable(Exception):
    """The store cannot take a batch now (its disk is full or failing, or its flush backlog is at its
    bound). Nothing of the batch was kept: ingest does not acknowledge it, and the agent resends it."""
