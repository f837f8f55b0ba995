"""Encodes one resolved window into the wire Batch: strings, stacks and processes interned once."""

from __future__ import annotations

from agent.attribution import Attributor
from agent.process.table import ProcessInfo
from agent.resolver import Window
from fleetprof.v1 import ingest_pb2 as pb


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self._ids: dict[str, int] = {"": 0}

    def id(self, s: str) -> int:
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.table)
            self.table.append(s)
        return i


def encode_window(
    window: Window, identity: pb.AgentIdentity, frequency_hz: int, attributor: Attributor | None = None
) -> pb.Batch:
    """The Batch for `window`, without a sequence number (the shipper assigns it)."""
    attributor = attributor or Attributor()
    strings = _Strings()
    stacks: dict[tuple, int] = {}
    processes: dict[tuple[int, int], int] = {}
    batch = pb.Batch(
        agent=identity,
        start_unix_ns=window.start_ns,
        end_unix_ns=window.end_ns,
        frequency_hz=frequency_hz,
    )
    counts: dict[tuple[int, int, int], int] = {}

    def process_index(p: ProcessInfo) -> int:
        pkey = (p.pid, p.start_ticks)
        pidx = processes.get(pkey)
        if pidx is None:
            pidx = processes[pkey] = len(batch.processes)
            batch.processes.append(
                pb.Process(
                    pid=p.pid,
                    start_time_ticks=p.start_ticks,
                    comm=strings.id(p.comm),
                    exe=strings.id(p.exe),
                    labels=[
                        pb.Label(name=strings.id(k), value=strings.id(v))
                        for k, v in sorted(attributor.labels(p).items())
                    ],
                )
            )
        return pidx

    for s in window.samples:
        pidx = process_index(s.process)
        skey = (s.frames, s.kernel_start)
        sidx = stacks.get(skey)
        if sidx is None:
            sidx = stacks[skey] = len(batch.stacks)
            batch.stacks.append(
                pb.Stack(
                    functions=[strings.id(f.function) for f in s.frames],
                    modules=[strings.id(f.module) for f in s.frames],
                    kernel_start=s.kernel_start,
                )
            )
        # Two raw stacks can symbolize to the same frames: merge them here.
        ckey = (pidx, s.tid, sidx)
        counts[ckey] = counts.get(ckey, 0) + s.count
    batch.samples.extend(pb.Sample(process=p, tid=t, stack=st, count=c) for (p, t, st), c in counts.items())
    for proc, st in window.syscalls:
        batch.syscalls.append(
            pb.SyscallStats(
                process=process_index(proc),
                syscall=strings.id(st.name),
                count=st.count,
                timed=st.timed,
                timed_ns=st.timed_ns,
                latency_log2_ns=_trimmed(st.hist),
            )
        )
    batch.syscall_latency_sample_every = window.syscall_sample_every
    batch.syscall_tracer.table_full = window.syscall_counters.get("table_full", 0)
    batch.strings.extend(strings.table)
    st = window.stats
    batch.stats.CopyFrom(
        pb.SamplerStats(
            samples=st.get("samples", 0),
            user_stack_missing=st.get("user_stack_missing", 0),
            user_stack_errors=st.get("user_stack_errors", 0),
            kernel_stack_errors=st.get("kernel_stack_errors", 0),
            stack_table_full=st.get("stack_table_full", 0),
            count_table_full=st.get("count_table_full", 0),
            unknown_process=st.get("unknown_process", 0),
        )
    )
    return batch


def _trimmed(hist: tuple[int, ...]) -> list[int]:
    """The histogram without its empty tail (most syscalls fill a few low buckets)."""
    end = len(hist)
    while end and not hist[end - 1]:
        end -= 1
    return list(hist[:end])
