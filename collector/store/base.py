"""The store interface ingest writes to and queries read from, and the plain rows they exchange."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from collector.query.selector import Selector
from collector.render.tree import FrameKey

Labels = tuple[tuple[str, str], ...]
"""A label set, sorted by name, without empty values."""

Stack = tuple[FrameKey, ...]
"""Root first."""


@dataclass(frozen=True)
class ProfileRows:
    """One ingested window: (labels, stack, count) rows at a time range, sampled at `frequency_hz`."""

    start: float  # unix seconds
    end: float
    frequency_hz: int
    rows: Sequence[tuple[Labels, Stack, int]]


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

    def label_names(self, start: float | None = None, end: float | None = None) -> list[str]: ...

    def label_values(self, name: str, start: float | None = None, end: float | None = None) -> list[str]: ...

    def stats(self) -> dict[str, int]: ...
