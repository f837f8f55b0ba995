"""What the query stage answers: plain values that the readers (collector/serve/) render."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetprof.collector.model.profile import Stacks
from fleetprof.collector.model.rows import Selection
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.query.series import Line
from fleetprof.collector.query.types import UNITS


class QueryError(ValueError):
    """A query that cannot be answered as asked; the message says why, in the API's terms."""


@dataclass(frozen=True)
class Scope:
    """What a query reads: the series its selector matches in [start, end), as one profile type counts
    them (`threads`: None for the type's default)."""

    selector: Selector
    start: float
    end: float
    kind: str = "cpu"
    threads: str | None = None

    @property
    def unit(self) -> str:
        return UNITS[self.kind]


@dataclass(frozen=True)
class Group:
    labels: dict[str, str]
    value: int  # samples (cpu) or nanoseconds (offcpu, wall)
    seconds: float | None
    pct: float


@dataclass(frozen=True)
class Groups:
    by: list[str]
    total: int
    frequency_hz: int | None
    groups: list[Group]  # the largest first


@dataclass(frozen=True)
class SeriesAnswer:
    by: list[str]
    step: float
    frequency_hz: int | None
    lines: list[Line]  # the largest first

    @property
    def total(self) -> int:
        return sum(line.total for line in self.lines)


@dataclass(frozen=True)
class Diff:
    baseline: Scope
    comparison: Scope
    base: Selection
    comp: Selection


@dataclass
class PodReport:
    """One pod on a GPU over the range: its GPU use, its CPU samples while its GPUs were idle and busy, and
    where its threads spent the idle time (as the scope's type counts it, and in wall time)."""

    namespace: str
    pod: str
    gpus: list[str]
    utilization_ratio: float | None
    memory_used_bytes: int | None
    idle_ratio: float | None
    seconds: float
    cpu_samples_gpu_idle: int
    cpu_samples_gpu_busy: int
    idle_wall_seconds: float
    idle_stacks: Stacks = field(default_factory=dict)
    idle_wall_stacks: Stacks = field(default_factory=dict)


@dataclass(frozen=True)
class SyscallRow:
    labels: dict[str, str]
    count: int
    rate_per_second: float
    timed: int
    total_seconds: float
    mean_seconds: float | None
    p50_seconds: float | None
    p99_seconds: float | None


@dataclass(frozen=True)
class Listing:
    values: list[str]
    truncated: bool
