"""The store interfaces: what ingest writes to and queries read from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from fleetprof.collector.model.gpu import PodGpuSummary
from fleetprof.collector.model.profile import SyscallAgg
from fleetprof.collector.model.rows import Grouped, ProfileRows, Selection, TimeSeries
from fleetprof.collector.model.selector import Selector


class ProfileStore(Protocol):
    """What ingest and query need from storage. The in-memory store implements it; others may."""

    def write(self, profile: ProfileRows) -> None: ...

    def select(self, selector: Selector, start: float, end: float) -> Selection: ...

    def select_groups(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], Selection]:
        """select() per distinct value tuple of the group-by labels ("" where a series lacks one), in one
        pass over the rows: each group's merged stacks and the frequency most of its samples came at, as
        select() with a `name="value"` matcher per group-by label would answer. Groups without samples are
        left out."""
        ...

    def group(self, selector: Selector, start: float, end: float, by: Sequence[str]) -> Grouped: ...

    def series(
        self, selector: Selector, start: float, end: float, step_s: float, by: Sequence[str]
    ) -> TimeSeries:
        """Samples per group per step. A step holds the storage buckets (10 s, or a rollup's width) that
        start in it, so a step shorter than a bucket gives one point per bucket."""
        ...

    def syscalls(
        self, selector: Selector, start: float, end: float, by: Sequence[str]
    ) -> dict[tuple[str, ...], SyscallAgg]:
        """Syscall aggregates grouped by labels; "syscall" is a valid group-by name."""
        ...

    def label_names(
        self, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        """Label names of the label sets with data in range, sorted; with `match`, of the sets some of
        those selectors match."""
        ...

    def label_values(
        self, name: str, start: float | None = None, end: float | None = None, match: Sequence[Selector] = ()
    ) -> list[str]:
        """The values `name` takes in the label sets with data in range (matched by some of `match`, when
        given), sorted."""
        ...

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


class GpuUsage(Protocol):
    """Per-pod GPU use over time (store/gpu_usage.py keeps it in memory, fed by ingest)."""

    def pods(self, selector: Selector, start: float, end: float) -> list[PodGpuSummary]:
        """Per pod (namespace, pod), its use of the GPUs whose labels the selector matches in [start, end),
        the pods whose GPUs idled most first."""
        ...


class StoreUnavailable(Exception):
    """The store cannot take a batch now (its disk is full or failing, or its flush backlog is at its
    bound). Nothing of the batch was kept: ingest does not acknowledge it, and the agent resends it."""
