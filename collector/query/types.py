"""Profile types: what a query counts, in which unit, over which threads; and the ids Grafana's Pyroscope
datasource names them by.

`cpu` is CPU samples; `offcpu` is nanoseconds threads spent switched out, by the stack they left with;
`wall` is both in nanoseconds (CPU samples × the sampling period, plus off-CPU time): where a thread's time
went, running or waiting. Idle threads' off-CPU rows (pools waiting for work: the agent's verdict, per
window) count or not as `threads` says: `all` (the default for offcpu: where threads wait, all of them) or
`active` (the default for wall, so that a pod's sleeping pools do not drown where its working threads' time
went). query/typed.py applies them to a store."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof.collector.model.rows import period_ns

TYPES = ("cpu", "offcpu", "wall")
UNITS = {"cpu": "samples", "offcpu": "nanoseconds", "wall": "nanoseconds"}
THREADS = ("active", "all")
DEFAULT_THREADS = {"cpu": "all", "offcpu": "all", "wall": "active"}
# Nanoseconds read as samples at 1 GHz, so every renderer that turns samples into seconds with the
# frequency shows nanosecond profiles in seconds too.
NS_HZ = 1_000_000_000


# Grafana's Pyroscope datasource selects a profile type with these two labels (no stored series carries
# them: every type has the same series).
PROFILE_TYPE_LABEL = "__profile_type__"
NAME_LABEL = "__name__"


@dataclass(frozen=True)
class ProfileType:
    """A profile type as Pyroscope names it, and which of ours (`kind`, one of TYPES) it reads."""

    id: str
    name: str
    sample_type: str
    sample_unit: str
    period_type: str
    period_unit: str
    in_nanoseconds: bool  # values are nanoseconds, else samples
    kind: str = "cpu"

    def scale(self, frequency_hz: int | None) -> int:
        """What a stored count is worth in this type's unit: a CPU sample in nanoseconds is a period;
        off-CPU and wall views count nanoseconds already."""
        if self.kind != "cpu" or not self.in_nanoseconds:
            return 1
        return period_ns(frequency_hz)


PROFILE_TYPES = {
    t.id: t
    for t in (
        ProfileType(
            "process_cpu:cpu:nanoseconds:cpu:nanoseconds",
            "process_cpu",
            "cpu",
            "nanoseconds",
            "cpu",
            "nanoseconds",
            True,
        ),
        ProfileType(
            "process_cpu:samples:count:cpu:nanoseconds",
            "process_cpu",
            "samples",
            "count",
            "cpu",
            "nanoseconds",
            False,
        ),
        # Off-CPU time (threads switched out) and wall time (on-CPU plus off-CPU), both nanoseconds.
        ProfileType(
            "process_offcpu:offcpu:nanoseconds:offcpu:nanoseconds",
            "process_offcpu",
            "offcpu",
            "nanoseconds",
            "offcpu",
            "nanoseconds",
            True,
            "offcpu",
        ),
        ProfileType(
            "wall:wall:nanoseconds:wall:nanoseconds",
            "wall",
            "wall",
            "nanoseconds",
            "wall",
            "nanoseconds",
            True,
            "wall",
        ),
    )
}
