"""Batches in tests, in the one form agents send: built with the agent's own wire-id functions, and read
back row by row."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import process_wire_id, stack_wire_id


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

    def build(self) -> pb.Batch:
        self.batch.strings.extend(self._strings)  # insertion order is id order
        return self.batch
