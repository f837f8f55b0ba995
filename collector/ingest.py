"""gRPC ingest: validates each Batch, decodes it into store rows, drops duplicates, acknowledges."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NoReturn

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
_COUNT = itemgetter(2)  # of a (labels, stack, count) row


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


def _fail(seq: int, reason: str, problem: str) -> NoReturn:
    err = BatchError(f"batch {seq}: {problem}")
    err.reason = reason  # type: ignore[attr-defined]
    raise err


def _check_header(batch: pb.Batch, limits: IngestLimits, size: int) -> None:
    """The batch-wide checks; `size` is the batch's wire size."""
    seq = batch.sequence
    if size > limits.max_batch_bytes:
        _fail(
            seq, "oversized", f"{size} bytes is over the collector's limit of {limits.max_batch_bytes} bytes"
        )
    if not batch.agent.node:
        _fail(seq, "no_node", "agent.node is empty: every batch must name its node")
    if not batch.agent.agent_id:
        _fail(seq, "no_agent_id", "agent.agent_id is empty")
    if seq == 0:
        _fail(seq, "no_sequence", "sequence must start at 1")
    if batch.end_unix_ns < batch.start_unix_ns:
        _fail(
            seq,
            "bad_window",
            f"end_unix_ns {batch.end_unix_ns} is before start_unix_ns {batch.start_unix_ns}",
        )
    if not 0 < batch.frequency_hz <= MAX_FREQUENCY_HZ:
        _fail(seq, "bad_frequency", f"frequency_hz {batch.frequency_hz} is not in 1..{MAX_FREQUENCY_HZ}")
    nstr = len(batch.strings)
    if nstr > limits.max_strings:
        _fail(seq, "oversized", f"{nstr} strings is over the limit of {limits.max_strings}")
    if len(batch.samples) > limits.max_samples:
        _fail(seq, "oversized", f"{len(batch.samples)} samples is over the limit of {limits.max_samples}")


def _check_string(seq: int, i: int, nstr: int, where: str) -> None:
    if i >= nstr:
        _fail(seq, "bad_string_id", f"{where} refers to string {i}, but the string table has {nstr} entries")


def _check_stack(seq: int, si: int, st: pb.Stack, nstr: int) -> None:
    if len(st.modules) and len(st.modules) != len(st.functions):
        _fail(seq, "bad_stack", f"stack {si} has {len(st.functions)} functions but {len(st.modules)} modules")
    if len(st.functions) > MAX_STACK_DEPTH:
        _fail(seq, "bad_stack", f"stack {si} is {len(st.functions)} frames deep (limit {MAX_STACK_DEPTH})")
    if st.kernel_start > len(st.functions):
        _fail(
            seq,
            "bad_stack",
            f"stack {si} kernel_start {st.kernel_start} is past its {len(st.functions)} frames",
        )
    # max() runs in C: only a bad stack needs the loop that names the frame.
    if st.functions and max(st.functions) >= nstr:
        for f in st.functions:
            _check_string(seq, f, nstr, f"stack {si}")
    if st.modules and max(st.modules) >= nstr:
        for m in st.modules:
            _check_string(seq, m, nstr, f"stack {si} module")


def _check_process(seq: int, pi: int, p: pb.Process, nstr: int) -> None:
    _check_string(seq, p.comm, nstr, f"process {pi} comm")
    _check_string(seq, p.exe, nstr, f"process {pi} exe")
    for lb in p.labels:
        _check_string(seq, lb.name, nstr, f"process {pi} label name")
        _check_string(seq, lb.value, nstr, f"process {pi} label value")
        if lb.name == 0:
            _fail(seq, "bad_label", f"process {pi} has a label with an empty name")


def _check_syscalls(batch: pb.Batch, nproc: int, nstr: int) -> None:
    seq = batch.sequence
    for i, sc in enumerate(batch.syscalls):
        if sc.process >= nproc:
            _fail(
                seq, "bad_syscall", f"syscall row {i} refers to process {sc.process}, but there are {nproc}"
            )
        _check_string(seq, sc.syscall, nstr, f"syscall row {i}")
        if sc.syscall == 0:
            _fail(seq, "bad_syscall", f"syscall row {i} has no syscall name")
        if sc.count > MAX_COUNT or sc.timed > sc.count:
            _fail(seq, "bad_syscall", f"syscall row {i}: timed {sc.timed} of count {sc.count} is impossible")
        if len(sc.latency_log2_ns) > 64 or sum(sc.latency_log2_ns) != sc.timed:
            _fail(
                seq,
                "bad_syscall",
                f"syscall row {i}: the latency histogram ({sum(sc.latency_log2_ns)} calls in "
                f"{len(sc.latency_log2_ns)} buckets) does not add up to timed {sc.timed}",
            )


def _check_samples(batch: pb.Batch, nproc: int, nstack: int) -> None:
    """Sample by sample, to name the first bad one (the decoder checks whole columns at once first)."""
    seq = batch.sequence
    for i, s in enumerate(batch.samples):
        if s.process >= nproc:
            _fail(seq, "bad_sample", f"sample {i} refers to process {s.process}, but there are {nproc}")
        if s.stack >= nstack:
            _fail(seq, "bad_sample", f"sample {i} refers to stack {s.stack}, but there are {nstack}")
        if s.count == 0 or s.count > MAX_COUNT:
            _fail(seq, "bad_count", f"sample {i} has count {s.count}: counts must be in 1..{MAX_COUNT}")
        if s.gpu not in GPU_STATE_LABEL:
            _fail(seq, "bad_sample", f"sample {i} has an unknown GPU state {s.gpu}")


def validate_batch(batch: pb.Batch, limits: IngestLimits) -> None:
    """Raise BatchError naming the first problem; silent when the batch is sound."""
    Decoder().decode(batch, limits)


_StackEntry = tuple[int, Stack]  # (stable content id, frames)
_ProcessEntry = tuple[int, Labels]  # (stable content id, label set)


class Decoder:
    """Checks batches and turns them into store rows, remembering stacks and label sets across batches.

    Work is proportional to what is new, not to what is sent: agents send the same stacks every window.
    A stack with a wire id (Stack.id) is looked up per (agent id, wire id); a known one costs a dict lookup,
    its frames are neither decoded nor checked again (it was checked when first seen, and an agent's id
    names one content). Keying by agent means a lying agent can only garble its own data. Stacks without
    an id, or not seen before, are checked and then looked up by their strings (a C-speed tuple hash), so
    their FrameKeys and stable ids are shared by all agents. Process label sets are cached by their
    strings. Samples are checked and turned into rows column by column. The caches are bounded.
    """

    MAX_CACHED = 500_000  # stacks by content, label sets, frames, processes: each starts over when full
    MAX_WIRE_IDS = 2_000_000  # (agent, wire id) entries, all agents together: least recent agents go first

    def __init__(self) -> None:
        self._stacks: dict[tuple, _StackEntry] = {}
        self._labels: dict[Labels, int] = {}
        self._frames: dict[FrameKey, int] = {}
        self._processes: dict[tuple, _ProcessEntry] = {}
        self._lock = threading.Lock()  # the per-agent table below (batches arrive on many threads)
        self._by_wire_id: OrderedDict[str, dict[int, _StackEntry]] = OrderedDict()
        self._wire_ids = 0

    def _stack(self, functions: tuple[str, ...], modules: tuple[str, ...], kernel_start: int) -> _StackEntry:
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

    def _known_stacks(self, agent_id: str) -> dict[int, _StackEntry]:
        with self._lock:
            known = self._by_wire_id.get(agent_id)
            if known is None:
                known = self._by_wire_id[agent_id] = {}
            else:
                self._by_wire_id.move_to_end(agent_id)
            return known

    def _learned(self, known: dict[int, _StackEntry], added: int) -> None:
        with self._lock:
            self._wire_ids += added
            if len(known) > self.MAX_WIRE_IDS // 4:  # one agent churning stacks: it starts over alone
                self._wire_ids -= len(known)
                known.clear()
            while self._wire_ids > self.MAX_WIRE_IDS and self._by_wire_id:
                _, old = self._by_wire_id.popitem(last=False)
                self._wire_ids -= len(old)

    def _decode_stacks(self, batch: pb.Batch, strings: list[str]) -> list[_StackEntry]:
        seq, nstr = batch.sequence, len(strings)
        stacks = batch.stacks
        wire_ids = [st.id for st in stacks]
        known = self._known_stacks(batch.agent.agent_id) if any(wire_ids) else {}
        entries = list(map(known.get, wire_ids))
        if None not in entries:
            return entries  # type: ignore[return-value]
        get = strings.__getitem__
        added = 0
        for si, entry in enumerate(entries):
            if entry is not None:
                continue
            st = stacks[si]
            _check_stack(seq, si, st, nstr)
            functions = tuple(map(get, st.functions))
            modules = tuple(map(get, st.modules)) if st.modules else ("",) * len(functions)
            entry = entries[si] = self._stack(functions, modules, st.kernel_start)
            if wire_ids[si]:
                known[wire_ids[si]] = entry
                added += 1
        if added:
            self._learned(known, added)
        return entries  # type: ignore[return-value]

    def _decode_processes(self, batch: pb.Batch, strings: list[str]) -> list[_ProcessEntry]:
        seq, nstr, node = batch.sequence, len(strings), batch.agent.node
        out = []
        cache = self._processes
        for pi, p in enumerate(batch.processes):
            comm, exe = p.comm, p.exe
            pairs = [(lb.name, lb.value) for lb in p.labels]
            if (
                comm >= nstr
                or exe >= nstr
                or (pairs and (max(map(max, pairs)) >= nstr or min(pairs)[0] == 0))
            ):
                _check_process(seq, pi, p, nstr)
            key = (node, p.pid, strings[comm], *[(strings[n], strings[v]) for n, v in pairs])
            hit = cache.get(key)
            if hit is None:
                if len(cache) >= self.MAX_CACHED:
                    cache.clear()
                labels = {"node": node, "pid": str(p.pid), "comm": strings[comm]}
                for name, value in key[3:]:
                    value = value[:MAX_LABEL_BYTES]
                    if value:
                        labels[name] = value
                lset = tuple(sorted((k, v) for k, v in labels.items() if v))
                hit = cache[key] = (self._label_id(lset), lset)
            out.append(hit)
        return out

    def decode(
        self, batch: pb.Batch, limits: IngestLimits | None = None, size: int | None = None
    ) -> ProfileRows:
        """Check the batch and return its rows for the store; BatchError names the first problem found.

        With `limits`, the batch-wide limits are checked too (`size`: its wire size, when known); without,
        the batch was accepted before (a write-ahead log record) and only what decoding relies on is checked.
        """
        seq = batch.sequence
        if limits is not None:
            _check_header(batch, limits, batch.ByteSize() if size is None else size)
        strings = list(batch.strings)
        if strings and strings[0] != "":
            _fail(seq, "bad_string_table", "strings[0] must be the empty string")
        stacks = self._decode_stacks(batch, strings)
        procs = self._decode_processes(batch, strings)
        nproc, nstack = len(procs), len(stacks)
        if batch.syscalls:
            _check_syscalls(batch, nproc, len(strings))
        if gpu_problem := gpu_section_problem(batch):  # GPU section (issue #6): collector/gpu_metrics.py
            _fail(seq, "bad_gpu", gpu_problem)
        rows: list[tuple[Labels, Stack, int]] = []
        keys: list[tuple[int, int]] = []
        cols = [(s.process, s.stack, s.count, s.gpu) for s in batch.samples]
        if cols:
            pcol, kcol, ccol, gcol = zip(*cols, strict=True)
            gpu = any(gcol)
            if (
                max(pcol) >= nproc
                or max(kcol) >= nstack
                or min(ccol) == 0
                or max(ccol) > MAX_COUNT
                or (gpu and not set(gcol) <= GPU_STATE_LABEL.keys())
            ):
                _check_samples(batch, nproc, nstack)
            lids = [lid for lid, _ in procs]
            lsets = [lset for _, lset in procs]
            if gpu:
                pcol = self._gpu_tagged_processes(list(pcol), gcol, lids, lsets)
            sids = [sid for sid, _ in stacks]
            frames = [st for _, st in stacks]
            rows = list(zip(map(lsets.__getitem__, pcol), map(frames.__getitem__, kcol), ccol, strict=True))
            keys = list(zip(map(lids.__getitem__, pcol), map(sids.__getitem__, kcol), strict=True))
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

    def _gpu_tagged_processes(
        self, pcol: list[int], gcol: tuple[int, ...], lids: list[int], lsets: list[Labels]
    ) -> list[int]:
        """Samples taken on a GPU go to their process's label set plus gpu_state: appended to lids/lsets,
        one per (process, state), and `pcol` repointed to them."""
        tagged: dict[tuple[int, int], int] = {}
        for i, state in enumerate(gcol):
            if state:
                key = (pcol[i], state)
                j = tagged.get(key)
                if j is None:
                    lset = tuple(sorted((*lsets[pcol[i]], (GPU_STATE_NAME, GPU_STATE_LABEL[state]))))
                    j = tagged[key] = len(lsets)
                    lsets.append(lset)
                    lids.append(self._label_id(lset))
                pcol[i] = j
        return pcol


def decode_batch(batch: pb.Batch) -> ProfileRows:
    """Rows for the store, without caches. Raises BatchError for a batch that cannot be decoded."""
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
        agent_id = batch.agent.agent_id
        durable = self._store if isinstance(self._store, DurableBatches) else None
        # The durable store logs the wire bytes anyway: their length is the size check, no ByteSize() pass.
        payload = batch.SerializeToString() if durable is not None else None
        try:
            rows = self._decoder.decode(batch, self._limits, None if payload is None else len(payload))
        except BatchError as err:
            reason = getattr(err, "reason", "invalid")
            with self._lock:
                self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
            raise
        if durable is not None:
            # The store logs the wire bytes before it stores the rows: once this returns, the batch
            # survives a crash, so acknowledging it is safe. It also checks the sequence atomically.
            if not durable.write_logged(agent_id, batch.sequence, payload, rows):  # type: ignore[arg-type]
                return self._duplicate()
        else:
            with self._lock:
                if self._seen.seen(agent_id, batch.sequence):
                    self.stats.duplicates += 1
                    return False
            self._store.write(rows)
            with self._lock:
                self._seen.add(agent_id, batch.sequence)
        if self._on_rows is not None:
            self._on_rows(rows)
        if self._on_batch is not None:
            self._on_batch(batch)
        samples = sum(map(_COUNT, rows.rows))
        with self._lock:
            self.stats.batches += 1
            self.stats.samples += samples
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
