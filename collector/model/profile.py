"""The plain values every stage of the collector exchanges: frames, stacks, label sets and syscall
aggregates. Nothing here knows about the wire, a store or a renderer."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

# Samples of processes on a GPU carry the GPU's state at sample time under this label ("idle" or "busy";
# absent for everything else). Set by ingest, selected by the API's gpu=idle|busy.
GPU_STATE_NAME = "gpu_state"

# Off-CPU time (nanoseconds a thread was switched out, by the stack it left with) is stored beside the CPU
# samples under label sets carrying this label; CPU label sets have none. Set by ingest; the API's
# type=cpu|offcpu|wall selects on it, so no query mixes samples with nanoseconds.
PROFILE_TYPE_NAME = "__type__"
OFFCPU = "offcpu"

# Off-CPU rows of threads that were idle in their window (the agent's verdict: they ran under 1% of the
# time they ran or waited, e.g. a pool waiting for work) carry this label too, valued IDLE_THREAD. Wall
# views leave them out unless asked for every thread (the API's threads=active|all).
THREAD_STATE_NAME = "__thread__"
IDLE_THREAD = "idle"


def internal_label(name: str) -> bool:
    """Labels the collector sets for its own selections (__type__, __thread__): no label to list or pick;
    agents may not send them (ingest refuses `__*` names)."""
    return name.startswith("__")


# How old a batch's window may be when it arrives. An agent keeps at most its 64 newest unacknowledged
# batches (about 11 minutes at its default 10 s windows), so anything older is a broken clock or a replayed
# capture, not a resend: ingest rejects it, and so dedupe state older than this is never needed.
MAX_BATCH_AGE_S = 2 * 3600.0


class FrameKey(NamedTuple):
    """One frame as the collector knows it; two frames are the same node only if all three fields match.
    A named tuple: hashing and comparing run in C, and ingest and every renderer do both per frame."""

    function: str
    module: str = ""
    kernel: bool = False


# A Python frame's name carries the line it was running: "qualname (file.py:LINE)", with the file's name as
# its module (agent/python/codes.py); a code object the agent could not name has the module "[python]".
# Rankings merge a function's lines (render/tree.py) and look for a thread's own code (query/waits.py).
PYTHON_LINE = re.compile(r"(?P<function>.*) \((?P<file>[^()]*):(?P<line>\d+)\)")
UNNAMED_PYTHON_MODULE = "[python]"


Labels = tuple[tuple[str, str], ...]
"""A label set, sorted by name, without empty values."""

Stack = tuple[FrameKey, ...]
"""Root first."""

Stacks = Mapping[Stack, int]
"""Root-first stack -> sample count: a merged profile, what every renderer reads."""


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
