"""A window of samples in columns (ProfileRows, what ingest hands the stores) and the merged answers stores
give queries (Selection, Grouped)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import Labels, Stack, SyscallRow
from fleetprof.collector.model.selector import label_value

# The stores' finest time bucket, in seconds: a window's rows count in the bucket of its midpoint, and a
# query's step is a whole number of buckets (a shorter one gives no more points).
BUCKET_S = 10

_EMPTY = np.zeros(0, dtype=np.int64)


def period_ns(frequency_hz: int | None) -> int:
    """The nanoseconds one sample at `frequency_hz` stands for (0 when the frequency is unknown)."""
    return round(1e9 / frequency_hz) if frequency_hz else 0


_FIRST = itemgetter(0)


class DecodedStacks(NamedTuple):
    """The stacks a window decoded (new to ingest's cache, or to the agent that sent them), as columns:
    stack i is `ids[i]` with `lengths[i]` frames, one stack after another in `frame_ids` (their content
    ids), and its frames `stacks[i]` (the tuple ingest's cache holds anyway: a reference each, not a
    second list of every frame). Ingest computes the frame ids to compute the stacks' ids, so the durable
    store's flush takes the new stacks' definitions from here instead of flattening their frames and
    looking every frame's id up again."""

    ids: np.ndarray  # int64, the stacks' ids in the window's table
    lengths: np.ndarray  # int64
    frame_ids: np.ndarray  # int64
    stacks: Sequence[Stack]


class StackTable(Sequence[tuple[int, Stack]]):
    """A window's stack table as a column of content ids plus slots into a shared list of frames: entry i
    is (ids[i], frames[slots[i]]). Ingest hands a store thousands of known stacks this way without making
    a tuple per stack; a store reads `ids` as a column and the frames of only the stacks new to it. The
    frames list is only ever appended to by its owner (ingest's decoder), so entries never change.
    `decoded`: the stacks this window decoded, as columns (None when all were known)."""

    __slots__ = ("ids", "_slots", "_frames", "decoded")

    def __init__(
        self,
        ids: np.ndarray,
        slots: np.ndarray,
        frames: Sequence[Stack],
        decoded: DecodedStacks | None = None,
    ) -> None:
        self.ids = ids
        self._slots = slots
        self._frames = frames
        self.decoded = decoded

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):  # Sequence's int and slice overloads
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return int(self.ids[i]), self._frames[self._slots[i]]

    def __iter__(self):
        return zip(self.ids.tolist(), map(self._frames.__getitem__, self._slots.tolist()), strict=True)

    def stacks_at(self, indexes: np.ndarray) -> list[Stack]:
        """The frames of the entries at `indexes`, in one pass (no (id, frames) tuple per entry)."""
        return list(map(self._frames.__getitem__, self._slots[indexes].tolist()))


def contents_at(table: Sequence[tuple[int, object]], indexes: np.ndarray) -> list:
    """The contents (second halves) of a definition table's entries at `indexes`: a StackTable's in one
    pass, any other table's one by one."""
    if isinstance(table, StackTable):
        return table.stacks_at(indexes)
    return [table[i][1] for i in indexes.tolist()]


@dataclass(frozen=True, eq=False)
class ProfileRows:
    """One ingested window, in columns: row i is `counts[i]` samples of the label set
    `label_sets[label_index[i]]` with the stack `stacks[stack_index[i]]`, sampled at `frequency_hz`; and
    the window's syscall rows.

    `label_sets` and `stacks` are the window's definition tables, each entry (content id under the
    collector's key (collector/model/ids.py), content); the same content may appear twice. Every syscall
    row's label set is in `label_sets`, so no store computes an id. Ingest builds the tables from its
    caches and the index columns straight from the batch's sample columns, so no store does per-row Python
    work. `from_rows` builds one from (labels, stack, count) rows (tests, tools).
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
    # The last `typed_rows` rows are other profile types than CPU samples: off-CPU nanoseconds, CUDA
    # launches, GPU kernel nanoseconds, under label sets carrying __type__ (collector/model/profile.py).
    typed_rows: int = 0
    # The last `cuda_call_rows` of `syscalls` are CUDA API calls, under label sets carrying __type__="cuda".
    cuda_call_rows: int = 0

    @classmethod
    def from_rows(
        cls,
        start: float,
        end: float,
        frequency_hz: int,
        rows: Iterable[tuple[Labels, Stack, int]],
        syscalls: Sequence[SyscallRow] = (),
        *,
        ids: ContentIds,
    ) -> ProfileRows:
        label_pos: dict[Labels, int] = {}
        stack_pos: dict[Stack, int] = {}
        li, si, counts = [], [], []
        for labels, stack, count in rows:
            li.append(label_pos.setdefault(labels, len(label_pos)))
            si.append(stack_pos.setdefault(stack, len(stack_pos)))
            counts.append(count)
        for labels, _, _ in syscalls:
            label_pos.setdefault(labels, len(label_pos))
        return cls(
            start,
            end,
            frequency_hz,
            [(ids.labels_id(lb), lb) for lb in label_pos],
            [(ids.stack_id(st), st) for st in stack_pos],
            np.array(li, dtype=np.int64),
            np.array(si, dtype=np.int64),
            np.array(counts, dtype=np.int64),
            syscalls,
        )

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        """CPU samples (rows of other profile types left out)."""
        return int(self.counts[: len(self.counts) - self.typed_rows].sum())

    @property
    def syscall_rows(self) -> Sequence[SyscallRow]:
        """The syscall rows, CUDA calls left out."""
        return self.syscalls[: len(self.syscalls) - self.cuda_call_rows]

    @property
    def cuda_calls(self) -> Sequence[SyscallRow]:
        """The CUDA API call rows."""
        return self.syscalls[len(self.syscalls) - self.cuda_call_rows :]

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
class TimeSeries:
    """Samples per distinct value tuple of the group-by labels, per step: `points[key][t]` is the samples
    of the step starting at `t` (seconds, a multiple of `step_s`). Steps without samples are left out."""

    by: tuple[str, ...]
    step_s: float
    points: dict[tuple[str, ...], dict[float, int]]
    frequency_hz: int | None


@dataclass(frozen=True)
class Grouped:
    """Samples per distinct value tuple of the group-by labels ("" where a series lacks a label)."""

    by: tuple[str, ...]
    totals: dict[tuple[str, ...], int]
    frequency_hz: int | None


def selections_by_group(
    rows: Iterable[tuple[int, int, int, int]],
    labels: Mapping[int, Labels],
    stacks: Mapping[int, Stack],
    by: Sequence[str],
) -> dict[tuple[str, ...], Selection]:
    """The stores' select_groups from their sums (label id, stack id, frequency, samples): per group of `by`,
    samples merged by stack content (a stack stored under two ids counts once) and the frequency most of
    the group's samples came at."""
    keys: dict[int, tuple[str, ...]] = {}
    merged: dict[tuple[str, ...], dict[Stack, int]] = {}
    freqs: dict[tuple[str, ...], dict[int, int]] = {}
    for lid, sid, freq, n in rows:
        key = keys.get(lid)
        if key is None:
            lb = dict(labels.get(lid, ()))
            key = keys[lid] = tuple(label_value(lb, name) for name in by)
        group = merged.setdefault(key, {})
        st = stacks[sid]
        group[st] = group.get(st, 0) + n
        per_freq = freqs.setdefault(key, {})
        per_freq[freq] = per_freq.get(freq, 0) + n
    return {
        key: Selection(group, max(freqs[key], key=freqs[key].__getitem__) or None)
        for key, group in merged.items()
    }
