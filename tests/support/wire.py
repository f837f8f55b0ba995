"""Batches in tests, in the one form agents send: built with the agent's own wire-id functions, read back
row by row, and pushed to a collector over gRPC."""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import grpc

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.agent.batch import frame_digest, pack_stacks, process_wire_id, stack_wire_id
from fleetprof.agent.model import Gap, GapStats


class Row(NamedTuple):
    process: int
    stack: int
    count: int
    gpu: int


def sample_rows(batch: pb.Batch) -> list[Row]:
    """Every sample row of the batch."""
    c = batch.sample_columns
    gpus = list(c.gpu) or [pb.GPU_STATE_NONE] * len(c.process)
    return [Row(*r) for r in zip(c.process, c.stack, c.count, gpus, strict=True)]


def offcpu_rows(batch: pb.Batch) -> list[Row]:
    """Every off-CPU row of the batch (`count`: blocked nanoseconds)."""
    c = batch.offcpu_columns
    gpus = list(c.gpu) or [pb.GPU_STATE_NONE] * len(c.process)
    return [Row(*r) for r in zip(c.process, c.stack, c.blocked_ns, gpus, strict=True)]


def cuda_launch_rows(batch: pb.Batch) -> list[Row]:
    """Every CUDA launch row of the batch (`count`: launches, scaled)."""
    c = batch.cuda_launch_columns
    gpus = list(c.gpu) or [pb.GPU_STATE_NONE] * len(c.process)
    return [Row(*r) for r in zip(c.process, c.stack, c.count, gpus, strict=True)]


def gpu_kernel_rows(batch: pb.Batch) -> list[Row]:
    """Every GPU kernel-time row of the batch (`count`: kernel nanoseconds)."""
    c = batch.cuda_kernel_columns
    return [
        Row(p, k, ns, pb.GPU_STATE_NONE) for p, k, ns in zip(c.process, c.stack, c.kernel_ns, strict=True)
    ]


class BatchBuilder:
    """A Batch as an agent builds one: interned strings, stacks and processes with their content ids,
    samples as columns. `build()` may be called once."""

    def __init__(
        self,
        node: str = "node-a",
        agent_id: str | None = None,
        sequence: int = 1,
        end_ns: int | None = None,
        window_s: float = 1.0,
        frequency_hz: int = 19,
    ) -> None:
        end = time.time_ns() if end_ns is None else end_ns
        self.batch = pb.Batch(
            agent=pb.AgentIdentity(node=node, agent_id=agent_id or uuid.uuid4().hex, boot_time_unix_ns=1),
            sequence=sequence,
            start_unix_ns=end - int(window_s * 1e9),
            end_unix_ns=end,
            frequency_hz=frequency_hz,
        )
        self._strings: dict[str, int] = {"": 0}
        self._stacks: dict[tuple, int] = {}

    def string(self, text: str) -> int:
        return self._strings.setdefault(text, len(self._strings))

    def stack(self, frames: Sequence[tuple[str, str]], kernel_start: int | None = None) -> int:
        """Index of the stack of (function, module) frames, root first; frames from kernel_start on are
        kernel frames (default: none)."""
        ks = len(frames) if kernel_start is None else kernel_start
        key = (tuple(frames), ks)
        if key not in self._stacks:
            self._stacks[key] = len(self.batch.stacks)
            functions, modules = [f for f, _ in frames], [m for _, m in frames]
            self.batch.stacks.add(
                functions=[self.string(f) for f in functions],
                modules=[self.string(m) for m in modules],
                kernel_start=ks,
            )
            self.batch.stack_ids.append(stack_wire_id(functions, modules, ks))
        return self._stacks[key]

    def process(
        self,
        pid: int,
        comm: str,
        labels: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        exe: str = "",
        start_ticks: int = 0,
    ) -> int:
        pairs = sorted(dict(labels).items())
        self.batch.processes.add(
            pid=pid,
            start_time_ticks=start_ticks,
            comm=self.string(comm),
            exe=self.string(exe),
            labels=[pb.Label(name=self.string(k), value=self.string(v)) for k, v in pairs],
        )
        self.batch.process_ids.append(process_wire_id(pid, start_ticks, comm, exe, pairs))
        return len(self.batch.processes) - 1

    def sample(self, process: int, stack: int, count: int, gpu: int = pb.GPU_STATE_NONE) -> None:
        cols = self.batch.sample_columns
        if gpu != pb.GPU_STATE_NONE and not cols.gpu:
            cols.gpu.extend([pb.GPU_STATE_NONE] * len(cols.process))
        cols.process.append(process)
        cols.stack.append(stack)
        cols.count.append(count)
        if cols.gpu or gpu != pb.GPU_STATE_NONE:
            cols.gpu.append(gpu)

    def offcpu(
        self, process: int, stack: int, blocked_ns: int, gpu: int = pb.GPU_STATE_NONE, idle: bool = False
    ) -> None:
        """An off-CPU row: `blocked_ns` of the process's threads switched out with the stack; `idle`: of
        threads the agent found idle in the window."""
        cols = self.batch.offcpu_columns
        if gpu != pb.GPU_STATE_NONE and not cols.gpu:
            cols.gpu.extend([pb.GPU_STATE_NONE] * len(cols.process))
        if idle and not cols.idle:
            cols.idle.extend([False] * len(cols.process))
        cols.process.append(process)
        cols.stack.append(stack)
        cols.blocked_ns.append(blocked_ns)
        if cols.gpu or gpu != pb.GPU_STATE_NONE:
            cols.gpu.append(gpu)
        if cols.idle:
            cols.idle.append(idle)

    def cuda_launch(self, process: int, stack: int, count: int, gpu: int = pb.GPU_STATE_NONE) -> None:
        """A CUDA launch row: `count` launches (scaled) of the process from `stack` (the kernel its leaf)."""
        cols = self.batch.cuda_launch_columns
        if gpu != pb.GPU_STATE_NONE and not cols.gpu:
            cols.gpu.extend([pb.GPU_STATE_NONE] * len(cols.process))
        cols.process.append(process)
        cols.stack.append(stack)
        cols.count.append(count)
        if cols.gpu or gpu != pb.GPU_STATE_NONE:
            cols.gpu.append(gpu)

    def gpu_kernel(self, process: int, stack: int, kernel_ns: int) -> None:
        """A GPU kernel-time row: `kernel_ns` of kernels launched from `stack` (the kernel its leaf)."""
        cols = self.batch.cuda_kernel_columns
        cols.process.append(process)
        cols.stack.append(stack)
        cols.kernel_ns.append(kernel_ns)

    def cuda_call(
        self,
        process: int,
        call: str,
        count: int,
        timed_ns: int,
        hist: Sequence[int],
        timed: int | None = None,
    ) -> None:
        """A CUDA API call row: `count` calls of `call`, `timed` of them (default: all, the histogram's
        sum) taking `timed_ns` together."""
        self.batch.cuda_calls.append(
            pb.CudaCallStats(
                process=process,
                call=self.string(call),
                count=count,
                timed=sum(hist) if timed is None else timed,
                timed_ns=timed_ns,
                latency_log2_ns=list(hist),
            )
        )

    def cuda_activity(
        self,
        process: int,
        device: int = 0,
        *,
        known_ns: int,
        gaps_ns: Sequence[int] = (),
        idle_ns: int | None = None,
        uuid: str = "",
        records_lost: int = 0,
    ) -> None:
        """A GPU activity row of the process on a device: `known_ns` covered, gaps of the lengths
        `gaps_ns` ending in the window (counted into the proto's buckets by the agent's own GapStats), idle
        time their sum unless given."""
        stats = GapStats.of([Gap(0, n, clipped=False) for n in gaps_ns])
        self.batch.cuda_activity.append(
            pb.CudaActivity(
                process=process,
                device=device,
                uuid=self.string(uuid) if uuid else 0,
                known_ns=known_ns,
                idle_ns=stats.idle_ns if idle_ns is None else idle_ns,
                gaps=stats.count,
                gap_histogram=list(stats.histogram) if stats.count else [],
                longest_gap_ns=stats.longest_ns,
                records_lost=records_lost,
            )
        )

    def build(self, packed: bool = True) -> pb.Batch:
        """The batch, its stacks as agents send them (packed columns) or, with `packed=False`, as Stack
        messages (what agents sent before, which the collector still reads; tests that edit stacks use it)."""
        self.batch.strings.extend(self._strings)  # insertion order is id order
        if packed and self.batch.stacks:
            pack(self.batch)
        return self.batch


def pack(batch: pb.Batch, frame_ids: bool = True) -> None:
    """Rewrite a batch's Stack messages as packed columns (the agent's pack_stacks), in place; with the
    frames' content ids, as agents send them, or without (`frame_ids=False`)."""
    table: dict[tuple[int, int], int] = {}
    frames: list[int] = []
    for st in batch.stacks:
        modules = st.modules or [0] * len(st.functions)
        frames.extend(table.setdefault(pair, len(table)) for pair in zip(st.functions, modules, strict=True))
    strings = batch.strings
    fc, sc = pack_stacks(
        [f for f, _ in table],
        [m for _, m in table],
        frames,
        [len(st.functions) for st in batch.stacks],
        [st.kernel_start for st in batch.stacks],
        b"".join(frame_digest(strings[f], strings[m]) for f, m in table) if frame_ids else b"",
    )
    batch.ClearField("stacks")
    batch.frame_columns.CopyFrom(fc)
    batch.stack_columns.CopyFrom(sc)


def unpack(batch: pb.Batch) -> pb.Batch:
    """The batch with its packed stack columns rewritten as Stack messages, in place (tests that edit a
    stack's frames); returns it."""
    if batch.HasField("stack_columns") or batch.HasField("frame_columns"):
        fc, sc = batch.frame_columns, batch.stack_columns
        functions, modules = _ints(fc.functions, fc.index_bytes), _ints(fc.modules, fc.index_bytes)
        frames, at = _ints(sc.frames, sc.index_bytes), 0
        for n, ks in zip(_ints(sc.lengths, 2), _ints(sc.kernel_starts, 2), strict=True):
            run = frames[at : at + n]
            at += n
            batch.stacks.add(
                functions=[functions[i] for i in run], modules=[modules[i] for i in run], kernel_start=ks
            )
        batch.ClearField("frame_columns")
        batch.ClearField("stack_columns")
    return batch


def _ints(data: bytes, width: int) -> tuple[int, ...]:
    """A packed column's little-endian entries."""
    return struct.unpack(f"<{len(data) // width}{'H' if width == 2 else 'I'}", data)


def packed_ints(values: Sequence[int], width: int = 2) -> bytes:
    """A packed column of `values` (tests that write one by hand)."""
    return struct.pack(f"<{len(values)}{'H' if width == 2 else 'I'}", *values)


class WireStack(NamedTuple):
    functions: tuple[str, ...]
    modules: tuple[str, ...]
    kernel_start: int


def stacks_of(batch: pb.Batch) -> list[WireStack]:
    """Every stack of the batch, read from either form (packed columns or Stack messages), names resolved
    from its string table. Packed columns are read here with struct (unpack), apart from the collector's
    reader."""
    strings, stacks = batch.strings, batch.stacks
    if batch.HasField("stack_columns") or batch.HasField("frame_columns"):
        stacks = unpack(pb.Batch(frame_columns=batch.frame_columns, stack_columns=batch.stack_columns)).stacks
    return [
        WireStack(
            tuple(strings[f] for f in st.functions),
            tuple(strings[m] for m in (st.modules or [0] * len(st.functions))),
            st.kernel_start,
        )
        for st in stacks
    ]


def kernel_stack(
    frames: Sequence[tuple[str, str]], kernel: str, module: str = "[cuda]"
) -> list[tuple[str, str]]:
    """A launch stack as the agent sends it: the launching CPU frames, root first, the kernel as the leaf."""
    return [*frames, (kernel, module)]


def make_batch(seq: int = 1, agent_id: str | None = None, node: str = "node-a", count: int = 5) -> pb.Batch:
    """One process (pid 42, comm "worker", container_id "abc123") with `count` samples of main;work."""
    b = BatchBuilder(node, agent_id, seq)
    b.sample(
        b.process(42, "worker", {"container_id": "abc123"}),
        b.stack([("main", "app"), ("work", "app")]),
        count,
    )
    return b.build()


def hist(**buckets: int) -> list[int]:
    """A syscall latency histogram (40 log2 ns buckets) from counts by bucket: hist(b10=6) is 6 in 2^10 ns."""
    out = [0] * 40
    for k, n in buckets.items():
        out[int(k[1:])] = n
    return out


def with_syscalls(batch: pb.Batch, rows: list[tuple[str, int, int, int, list[int]]]) -> pb.Batch:
    """`batch` with syscall rows (name, count, timed, timed_ns, histogram) of its first process."""
    for name, count, timed, timed_ns, h in rows:
        batch.strings.append(name)
        batch.syscalls.append(
            pb.SyscallStats(
                process=0,
                syscall=len(batch.strings) - 1,
                count=count,
                timed=timed,
                timed_ns=timed_ns,
                latency_log2_ns=h,
            )
        )
    batch.syscall_latency_sample_every = 16
    return batch


def push(target: str, batches: list[pb.Batch]) -> list[int]:
    """Send `batches` on one Push stream to the collector at `target`; the sequences it acknowledged."""
    with grpc.insecure_channel(target) as ch:
        return [a.sequence for a in pb_grpc.IngestStub(ch).Push(iter(batches), timeout=10)]
