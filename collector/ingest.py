"""gRPC ingest: validates each Batch, decodes it into store rows, drops duplicates, acknowledges."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from collector.gpu_metrics import gpu_section_problem
from collector.render.tree import FrameKey
from collector.store.base import (
    GPU_STATE_NAME,
    DurableBatches,
    Labels,
    ProfileRows,
    ProfileStore,
    Stack,
    SyscallAgg,
)
from collector.store.ids import frame_id, labels_id, stack_id_of_frames
from collector.store.sequences import SeenSequences
from fleetprof.v1 import ingest_pb2 as pb
from fleetprof.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

GPU_STATE_LABEL = {pb.GPU_STATE_NONE: "", pb.GPU_STATE_IDLE: "idle", pb.GPU_STATE_BUSY: "busy"}
MAX_COUNT = 1 << 40  # more samples than a node takes in years: a corrupt or negative count
MAX_FREQUENCY_HZ = 100_000
MAX_STACK_DEPTH = 4096
MAX_LABEL_BYTES = 1024


class BatchError(ValueError):
    """A batch that cannot be ingested; the message names the batch and the problem."""


@dataclass(frozen=True)
class IngestLimits:
    max_batch_bytes: int = 32 * 1024 * 1024
    max_samples: int = 2_000_000
    max_strings: int = 2_000_000


@dataclass
class IngestStats:
    """Counters for self-metrics; updated under the servicer's lock."""

    batches: int = 0
    samples: int = 0
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    sampler: dict[str, int] = field(default_factory=dict)  # SamplerStats fields summed over batches


def validate_batch(batch: pb.Batch, limits: IngestLimits) -> None:
    """Raise BatchError naming the first problem; silent when the batch is sound."""
    seq = batch.sequence

    def fail(reason: str, problem: str) -> None:
        err = BatchError(f"batch {seq}: {problem}")
        err.reason = reason  # type: ignore[attr-defined]
        raise err

    size = batch.ByteSize()
    if size > limits.max_batch_bytes:
        fail("oversized", f"{size} bytes is over the collector's limit of {limits.max_batch_bytes} bytes")
    if not batch.agent.node:
        fail("no_node", "agent.node is empty: every batch must name its node")
    if not batch.agent.agent_id:
        fail("no_agent_id", "agent.agent_id is empty")
    if seq == 0:
        fail("no_sequence", "sequence must start at 1")
    if batch.end_unix_ns < batch.start_unix_ns:
        fail("bad_window", f"end_unix_ns {batch.end_unix_ns} is before start_unix_ns {batch.start_unix_ns}")
    if not 0 < batch.frequency_hz <= MAX_FREQUENCY_HZ:
        fail("bad_frequency", f"frequency_hz {batch.frequency_hz} is not in 1..{MAX_FREQUENCY_HZ}")
    nstr = len(batch.strings)
    if nstr > limits.max_strings:
        fail("oversized", f"{nstr} strings is over the limit of {limits.max_strings}")
    if len(batch.samples) > limits.max_samples:
        fail("oversized", f"{len(batch.samples)} samples is over the limit of {limits.max_samples}")
    if nstr and batch.strings[0] != "":
        fail("bad_string_table", "strings[0] must be the empty string")

    def check_str(i: int, where: str) -> None:
        if i >= nstr:
            fail("bad_string_id", f"{where} refers to string {i}, but the string table has {nstr} entries")

    for si, st in enumerate(batch.stacks):
        if len(st.modules) and len(st.modules) != len(st.functions):
            fail("bad_stack", f"stack {si} has {len(st.functions)} functions but {len(st.modules)} modules")
        if len(st.functions) > MAX_STACK_DEPTH:
            fail("bad_stack", f"stack {si} is {len(st.functions)} frames deep (limit {MAX_STACK_DEPTH})")
        if st.kernel_start > len(st.functions):
            fail(
                "bad_stack",
                f"stack {si} kernel_start {st.kernel_start} is past its {len(st.functions)} frames",
            )
        # max() runs in C: a batch has tens of thousands of frames, and only a bad one needs the loop.
        if st.functions and max(st.functions) >= nstr:
            for f in st.functions:
                check_str(f, f"stack {si}")
        if st.modules and max(st.modules) >= nstr:
            for m in st.modules:
                check_str(m, f"stack {si} module")
    for pi, p in enumerate(batch.processes):
        check_str(p.comm, f"process {pi} comm")
        check_str(p.exe, f"process {pi} exe")
        for lb in p.labels:
            check_str(lb.name, f"process {pi} label name")
            check_str(lb.value, f"process {pi} label value")
            if lb.name == 0:
                fail("bad_label", f"process {pi} has a label with an empty name")
    nproc, nstack = len(batch.processes), len(batch.stacks)
    for i, sc in enumerate(batch.syscalls):
        if sc.process >= nproc:
            fail("bad_syscall", f"syscall row {i} refers to process {sc.process}, but there are {nproc}")
        check_str(sc.syscall, f"syscall row {i}")
        if sc.syscall == 0:
            fail("bad_syscall", f"syscall row {i} has no syscall name")
        if sc.count > MAX_COUNT or sc.timed > sc.count:
            fail("bad_syscall", f"syscall row {i}: timed {sc.timed} of count {sc.count} is impossible")
        if len(sc.latency_log2_ns) > 64 or sum(sc.latency_log2_ns) != sc.timed:
            fail(
                "bad_syscall",
                f"syscall row {i}: the latency histogram ({sum(sc.latency_log2_ns)} calls in "
                f"{len(sc.latency_log2_ns)} buckets) does not add up to timed {sc.timed}",
            )
    if gpu_problem := gpu_section_problem(batch):  # GPU section (issue #6): collector/gpu_metrics.py
        fail("bad_gpu", gpu_problem)
    for i, s in enumerate(batch.samples):
        if s.process >= nproc:
            fail("bad_sample", f"sample {i} refers to process {s.process}, but there are {nproc}")
        if s.stack >= nstack:
            fail("bad_sample", f"sample {i} refers to stack {s.stack}, but there are {nstack}")
        if s.count == 0 or s.count > MAX_COUNT:
            fail("bad_count", f"sample {i} has count {s.count}: counts must be in 1..{MAX_COUNT}")
        if s.gpu not in GPU_STATE_LABEL:
            fail("bad_sample", f"sample {i} has an unknown GPU state {s.gpu}")


class Decoder:
    """Turns batches into store rows, remembering stacks and label sets across batches.

    A stack arrives as string-table indexes that differ per batch; it is looked up by its strings (a C-speed
    tuple hash), so a stack seen before costs no per-frame Python work: its FrameKeys and stable id are
    reused. The caches are bounded and simply start over when full.
    """

    MAX_CACHED = 500_000

    def __init__(self) -> None:
        self._stacks: dict[tuple, tuple[int, Stack]] = {}
        self._labels: dict[Labels, int] = {}
        self._frames: dict[FrameKey, int] = {}

    def _stack(
        self, functions: tuple[str, ...], modules: tuple[str, ...], kernel_start: int
    ) -> tuple[int, Stack]:
        key = (functions, modules, kernel_start)
        hit = self._stacks.get(key)
        if hit is None:
            if len(self._stacks) >= self.MAX_CACHED:
                self._stacks.clear()
            frames = tuple(
                FrameKey(f, m, i >= kernel_start)
                for i, (f, m) in enumerate(zip(functions, modules, strict=True))
            )
            hit = self._stacks[key] = (stack_id_of_frames([self._frame_id(f) for f in frames]), frames)
        return hit

    def _frame_id(self, frame: FrameKey) -> int:
        fid = self._frames.get(frame)
        if fid is None:
            if len(self._frames) >= self.MAX_CACHED:
                self._frames.clear()
            fid = self._frames[frame] = frame_id(frame.function, frame.module, frame.kernel)
        return fid

    def _label_id(self, labels: Labels) -> int:
        lid = self._labels.get(labels)
        if lid is None:
            if len(self._labels) >= self.MAX_CACHED:
                self._labels.clear()
            lid = self._labels[labels] = labels_id(labels)
        return lid

    def decode(self, batch: pb.Batch) -> ProfileRows:
        """Rows for the store. Assumes validate_batch passed."""
        strings = list(batch.strings)
        get = strings.__getitem__
        node = batch.agent.node
        stacks = []
        for st in batch.stacks:
            functions = tuple(map(get, st.functions))
            modules = tuple(map(get, st.modules)) if st.modules else ("",) * len(functions)
            stacks.append(self._stack(functions, modules, st.kernel_start))
        procs: list[tuple[int, Labels]] = []
        for p in batch.processes:
            labels = {"node": node, "pid": str(p.pid), "comm": strings[p.comm]}
            for lb in p.labels:
                value = strings[lb.value][:MAX_LABEL_BYTES]
                if value:
                    labels[strings[lb.name]] = value
            lset = tuple(sorted((k, v) for k, v in labels.items() if v))
            procs.append((self._label_id(lset), lset))
        rows = []
        keys = []
        tagged: dict[tuple[int, int], tuple[int, Labels]] = {}  # (process, GPU state) -> its label set
        for s in batch.samples:
            if s.gpu:
                lid, lset = tagged.get((s.process, s.gpu)) or self._gpu_tagged(procs[s.process][1], s.gpu)
                tagged[(s.process, s.gpu)] = (lid, lset)
            else:
                lid, lset = procs[s.process]
            sid, stack = stacks[s.stack]
            rows.append((lset, stack, s.count))
            keys.append((lid, sid))
        syscalls = [
            (
                procs[sc.process][1],
                strings[sc.syscall],
                SyscallAgg(sc.count, sc.timed, sc.timed_ns, list(sc.latency_log2_ns)),
            )
            for sc in batch.syscalls
        ]
        return ProfileRows(
            batch.start_unix_ns / 1e9, batch.end_unix_ns / 1e9, batch.frequency_hz, rows, syscalls, keys
        )

    def _gpu_tagged(self, lset: Labels, state: int) -> tuple[int, Labels]:
        tagged = tuple(sorted((*lset, (GPU_STATE_NAME, GPU_STATE_LABEL[state]))))
        return self._label_id(tagged), tagged


def decode_batch(batch: pb.Batch) -> ProfileRows:
    """Rows for the store, without caches. Assumes validate_batch passed."""
    return Decoder().decode(batch)


class IngestService(pb_grpc.IngestServicer):
    def __init__(
        self,
        store: ProfileStore,
        limits: IngestLimits | None = None,
        on_rows: Callable[[ProfileRows], None] | None = None,
        on_batch: Callable[[pb.Batch], None] | None = None,  # GPU metrics (issue #6)
    ):
        self._store = store
        self._on_rows = on_rows
        self._on_batch = on_batch
        self._limits = limits or IngestLimits()
        self._lock = threading.Lock()
        self._seen = SeenSequences()
        self._decoder = Decoder()
        self.stats = IngestStats()

    def ingest(self, batch: pb.Batch) -> bool:
        """Validate and store one batch; False if it was a duplicate. Raises BatchError."""
        try:
            validate_batch(batch, self._limits)
        except BatchError as err:
            reason = getattr(err, "reason", "invalid")
            with self._lock:
                self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
            raise
        agent_id = batch.agent.agent_id
        durable = self._store if isinstance(self._store, DurableBatches) else None
        if durable is not None:
            if durable.seen(agent_id, batch.sequence):
                return self._duplicate()
            rows = self._decoder.decode(batch)
            # The store logs the wire bytes before it stores the rows: once this returns, the batch
            # survives a crash, so acknowledging it is safe. It also re-checks the sequence atomically.
            if not durable.write_logged(agent_id, batch.sequence, batch.SerializeToString(), rows):
                return self._duplicate()
        else:
            with self._lock:
                if self._seen.seen(agent_id, batch.sequence):
                    self.stats.duplicates += 1
                    return False
            rows = self._decoder.decode(batch)
            self._store.write(rows)
            with self._lock:
                self._seen.add(agent_id, batch.sequence)
        if self._on_rows is not None:
            self._on_rows(rows)
        if self._on_batch is not None:
            self._on_batch(batch)
        with self._lock:
            self.stats.batches += 1
            self.stats.samples += sum(c for _, _, c in rows.rows)
            for fd, value in batch.stats.ListFields():
                self.stats.sampler[fd.name] = self.stats.sampler.get(fd.name, 0) + value
        return True

    def _duplicate(self) -> bool:
        with self._lock:
            self.stats.duplicates += 1
        return False

    def Push(self, request_iterator: Iterator[pb.Batch], context: grpc.ServicerContext) -> Iterator[pb.Ack]:  # noqa: N802
        for batch in request_iterator:
            try:
                self.ingest(batch)
            except BatchError as err:
                log.warning("rejected from %s: %s", context.peer(), err)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            yield pb.Ack(sequence=batch.sequence)


def decode_payload(payload: bytes, decoder: Decoder | None = None) -> ProfileRows:
    """Rows of a batch in wire form, as the write-ahead log keeps it (it was validated before logging)."""
    return (decoder or Decoder()).decode(pb.Batch.FromString(payload))
