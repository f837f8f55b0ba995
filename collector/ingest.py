"""gRPC ingest: validates each Batch, decodes it into store rows, drops duplicates, acknowledges."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NoReturn

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from collector.gpu_metrics import gpu_section_problem
from collector.store.base import (
    GPU_STATE_NAME,
    DurableBatches,
    Labels,
    ProfileRows,
    ProfileStore,
    Stack,
    SyscallAgg,
)
from collector.store.ids import interned_frames, labels_id, stack_id_of_frames
from collector.store.sequences import SeenSequences
from fleetprof.v1 import ingest_pb2 as pb
from fleetprof.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_FIRST, _SECOND = itemgetter(0), itemgetter(1)

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


def _batch_error(reason: str, message: str) -> BatchError:
    err = BatchError(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def _fail(seq: int, reason: str, problem: str) -> NoReturn:
    raise _batch_error(reason, f"batch {seq}: {problem}")


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
    nsamples = len(batch.samples) + len(batch.sample_columns.process)
    if nsamples > limits.max_samples:
        _fail(seq, "oversized", f"{nsamples} sample rows is over the limit of {limits.max_samples}")


def _check_string(seq: int, i: int, nstr: int, where: str) -> None:
    if i >= nstr:
        _fail(seq, "bad_string_id", f"{where} refers to string {i}, but the string table has {nstr} entries")


def _check_stack_shape(seq: int, si: int, st: pb.Stack) -> None:
    """What indexing the string table does not check (that is _check_stack_strings, on IndexError)."""
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


def _check_stack_strings(seq: int, si: int, st: pb.Stack, nstr: int) -> NoReturn:
    for f in st.functions:
        _check_string(seq, f, nstr, f"stack {si}")
    for m in st.modules:
        _check_string(seq, m, nstr, f"stack {si} module")
    raise AssertionError("called for a stack whose strings are all in the table")


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
    their FrameKeys (interned in collector/store/ids.py) and stable ids are shared by all agents. Processes
    with a wire id (Process.id) are remembered per agent the same way; label sets are cached by their
    strings. Samples are checked and turned into rows column by column. The caches are bounded.
    """

    MAX_CACHED = 500_000  # stacks by content, label sets, processes: each starts over when full
    MAX_WIRE_IDS = 2_000_000  # (agent, wire id) entries, all agents together: least recent agents go first

    def __init__(self) -> None:
        self._stacks: dict[tuple, _StackEntry] = {}
        self._labels: dict[Labels, int] = {}
        self._processes: dict[tuple, _ProcessEntry] = {}
        self._lock = threading.Lock()  # the per-agent table below (batches arrive on many threads)
        # (agent id, "stack" | "process") -> wire id -> entry
        self._by_wire_id: OrderedDict[tuple[str, str], dict[int, tuple]] = OrderedDict()
        self._wire_ids = 0

    def _stack(self, functions: tuple[str, ...], modules: tuple[str, ...], kernel_start: int) -> _StackEntry:
        key = (functions, modules, kernel_start)
        hit = self._stacks.get(key)
        if hit is None:
            if len(self._stacks) >= self.MAX_CACHED:
                self._stacks.clear()
            n = len(functions)
            kernel = (False,) * kernel_start + (True,) * (n - kernel_start)
            frames = interned_frames(zip(functions, modules, kernel, strict=True))
            hit = self._stacks[key] = (
                stack_id_of_frames(list(map(_SECOND, frames))),
                tuple(map(_FIRST, frames)),
            )
        return hit

    def _label_id(self, labels: Labels) -> int:
        lid = self._labels.get(labels)
        if lid is None:
            if len(self._labels) >= self.MAX_CACHED:
                self._labels.clear()
            lid = self._labels[labels] = labels_id(labels)
        return lid

    def _known(self, agent_id: str, kind: str) -> dict[int, tuple]:
        key = (agent_id, kind)
        with self._lock:
            known = self._by_wire_id.get(key)
            if known is None:
                known = self._by_wire_id[key] = {}
            else:
                self._by_wire_id.move_to_end(key)
            return known

    def _learned(self, known: dict[int, tuple], added: int) -> None:
        with self._lock:
            self._wire_ids += added
            if len(known) > self.MAX_WIRE_IDS // 4:  # one agent churning stacks: it starts over alone
                self._wire_ids -= len(known)
                known.clear()
            while self._wire_ids > self.MAX_WIRE_IDS and self._by_wire_id:
                _, old = self._by_wire_id.popitem(last=False)
                self._wire_ids -= len(old)

    def _remembered(
        self, agent_id: str, kind: str, wire_ids: list[int], decode: Callable[[int], tuple]
    ) -> list:
        """Entry i for each wire id: remembered for this agent, or `decode(i)` (and remembered when the
        wire id is not 0)."""
        known = self._known(agent_id, kind) if any(wire_ids) else {}
        entries = list(map(known.get, wire_ids))
        if None not in entries:
            return entries
        added = 0
        for i, entry in enumerate(entries):
            if entry is None:
                entry = entries[i] = decode(i)
                if wire_ids[i]:
                    known[wire_ids[i]] = entry
                    added += 1
        if added:
            self._learned(known, added)
        return entries

    def _decode_stacks(self, batch: pb.Batch, strings: Sequence[str]) -> list[_StackEntry]:
        seq, nstr = batch.sequence, len(strings)
        stacks = batch.stacks
        if len(batch.stack_ids) == len(stacks):
            wire_ids = list(batch.stack_ids)  # one packed run: no Stack message is touched for known ones
        elif len(batch.stack_ids):
            _fail(seq, "bad_stack", f"{len(batch.stack_ids)} stack_ids for {len(stacks)} stacks")
        else:
            wire_ids = [st.id for st in stacks]
        get = strings.__getitem__

        def decode(si: int) -> _StackEntry:
            st = stacks[si]
            _check_stack_shape(seq, si, st)
            try:
                functions = tuple(map(get, st.functions))
                modules = tuple(map(get, st.modules)) if st.modules else ("",) * len(functions)
            except IndexError:
                _check_stack_strings(seq, si, st, nstr)
            return self._stack(functions, modules, st.kernel_start)

        return self._remembered(batch.agent.agent_id, "stack", wire_ids, decode)

    def _decode_processes(self, batch: pb.Batch, strings: Sequence[str]) -> list[_ProcessEntry]:
        seq, nstr, node = batch.sequence, len(strings), batch.agent.node
        processes = batch.processes
        cache = self._processes

        def decode(pi: int) -> _ProcessEntry:
            p = processes[pi]
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
            return hit

        return self._remembered(batch.agent.agent_id, "process", [p.id for p in processes], decode)

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
        strings = batch.strings  # read only where something is decoded: most of a batch is known
        if strings and strings[0] != "":
            _fail(seq, "bad_string_table", "strings[0] must be the empty string")
        stacks = self._decode_stacks(batch, strings)
        procs = self._decode_processes(batch, strings)
        nproc, nstack = len(procs), len(stacks)
        if batch.syscalls:
            _check_syscalls(batch, nproc, len(strings))
        if gpu_problem := gpu_section_problem(batch):  # GPU section (issue #6): collector/gpu_metrics.py
            _fail(seq, "bad_gpu", gpu_problem)
        label_table: list[_ProcessEntry] = list(procs)
        pcol, kcol, ccol, gcol = _sample_columns(batch)
        if len(ccol):
            if (
                pcol.max() >= nproc
                or kcol.max() >= nstack
                or ccol.min() == 0
                or ccol.max() > MAX_COUNT
                or gcol.max() > max(GPU_STATE_LABEL)
                or gcol.min() < 0
            ):
                _check_sample_columns(seq, pcol, kcol, ccol, gcol, nproc, nstack)
            if gcol.any():
                pcol = self._gpu_tagged_processes(pcol, gcol, label_table)
        syscalls = [
            (
                procs[sc.process][1],
                strings[sc.syscall],
                SyscallAgg(sc.count, sc.timed, sc.timed_ns, list(sc.latency_log2_ns)),
            )
            for sc in batch.syscalls
        ]
        return ProfileRows(
            batch.start_unix_ns / 1e9,
            batch.end_unix_ns / 1e9,
            batch.frequency_hz,
            label_table,
            stacks,
            pcol.astype(np.int64),
            kcol.astype(np.int64),
            ccol.astype(np.int64),
            syscalls,
        )

    def _gpu_tagged_processes(
        self, pcol: np.ndarray, gcol: np.ndarray, table: list[_ProcessEntry]
    ) -> np.ndarray:
        """Samples taken on a GPU go to their process's label set plus gpu_state: one table entry is
        appended per (process, state), and those rows repointed to it."""
        tagged = np.flatnonzero(gcol)
        keys = pcol[tagged] * 4 + gcol[tagged]
        distinct, which = np.unique(keys, return_inverse=True)
        first = len(table)
        for key in distinct.tolist():
            process, state = divmod(key, 4)
            lset = tuple(sorted((*table[process][1], (GPU_STATE_NAME, GPU_STATE_LABEL[state]))))
            table.append((self._label_id(lset), lset))
        pcol = pcol.copy()
        pcol[tagged] = first + which
        return pcol


def _sample_columns(batch: pb.Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(process, stack, count, gpu) of every sample row: the `samples` messages first, then
    `sample_columns`. Counts are unsigned, so a huge one stays huge until it is checked."""
    parts = []
    if batch.samples:
        p, k, c, g = zip(*[(s.process, s.stack, s.count, s.gpu) for s in batch.samples], strict=True)
        parts.append(
            [np.array(p, np.int64), np.array(k, np.int64), np.array(c, np.uint64), np.array(g, np.int64)]
        )
    if batch.HasField("sample_columns"):
        sc = batch.sample_columns
        n = len(sc.process)
        if len(sc.stack) != n or len(sc.count) != n or len(sc.tid) not in (0, n) or len(sc.gpu) not in (0, n):
            _fail(
                batch.sequence,
                "bad_sample",
                f"sample_columns have {n} processes, {len(sc.stack)} stacks, {len(sc.count)} counts, "
                f"{len(sc.tid)} tids and {len(sc.gpu)} GPU states: process, stack and count need one per "
                "row, tid and gpu one per row or none",
            )
        gpu = np.array(sc.gpu, dtype=np.int64) if len(sc.gpu) else np.zeros(n, dtype=np.int64)
        parts.append(
            [
                np.array(sc.process, dtype=np.int64),
                np.array(sc.stack, dtype=np.int64),
                np.array(sc.count, dtype=np.uint64),
                gpu,
            ]
        )
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.uint64), empty
    if len(parts) == 1:
        return tuple(parts[0])  # type: ignore[return-value]
    return tuple(np.concatenate(c) for c in zip(*parts, strict=True))  # type: ignore[return-value]


def _check_sample_columns(
    seq: int,
    pcol: np.ndarray,
    kcol: np.ndarray,
    ccol: np.ndarray,
    gcol: np.ndarray,
    nproc: int,
    nstack: int,
) -> None:
    """Name the first bad sample row (rows of `samples` first, then of `sample_columns`)."""
    bad = (pcol >= nproc) | (kcol >= nstack) | (ccol == 0) | (ccol > MAX_COUNT)
    bad |= (gcol < 0) | (gcol > max(GPU_STATE_LABEL))
    i = int(np.flatnonzero(bad)[0])
    p, k, c, g = int(pcol[i]), int(kcol[i]), int(ccol[i]), int(gcol[i])
    if p >= nproc:
        _fail(seq, "bad_sample", f"sample {i} refers to process {p}, but there are {nproc}")
    if k >= nstack:
        _fail(seq, "bad_sample", f"sample {i} refers to stack {k}, but there are {nstack}")
    if c == 0 or c > MAX_COUNT:
        _fail(seq, "bad_count", f"sample {i} has count {c}: counts must be in 1..{MAX_COUNT}")
    _fail(seq, "bad_sample", f"sample {i} has an unknown GPU state {g}")


def decode_batch(batch: pb.Batch) -> ProfileRows:
    """Rows for the store, without caches. Raises BatchError for a batch that cannot be decoded."""
    return Decoder().decode(batch)


INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["Ingest"].full_name


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

    def _rejected(self, err: BatchError) -> None:
        reason = getattr(err, "reason", "invalid")
        with self._lock:
            self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1

    def ingest(self, batch: pb.Batch, payload: bytes | None = None) -> bool:
        """Validate and store one batch (`payload`: its wire bytes, when it arrived as bytes); False if it
        was a duplicate. Raises BatchError."""
        agent_id = batch.agent.agent_id
        durable = self._store if isinstance(self._store, DurableBatches) else None
        if payload is None and durable is not None:
            payload = batch.SerializeToString()  # the durable store logs the wire bytes
        try:
            rows = self._decoder.decode(batch, self._limits, None if payload is None else len(payload))
        except BatchError as err:
            self._rejected(err)
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
        samples = rows.total
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

    def parse(self, payload: bytes) -> pb.Batch:
        """The Batch in `payload`; BatchError (reason "unreadable") when the bytes are not one."""
        try:
            return pb.Batch.FromString(payload)
        except DecodeError as err:
            unreadable = _batch_error(
                "unreadable",
                f"batch (unreadable): {len(payload)} bytes are not a fleetprof.v1.Batch message ({err})",
            )
            self._rejected(unreadable)
            raise unreadable from None

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[pb.Ack]:  # noqa: N802
        """Batches arrive as wire bytes (see serve_ingest): parsed here, and logged as they came."""
        for payload in request_iterator:
            try:
                batch = self.parse(payload)
                self.ingest(batch, payload)
            except BatchError as err:
                log.warning("rejected from %s: %s", context.peer(), err)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            yield pb.Ack(sequence=batch.sequence)


def serve_ingest(service: IngestService, server: grpc.Server) -> None:
    """Register the Ingest service on `server` with batches handed over as bytes, not parsed by gRPC:
    an unreadable batch gets a clear INVALID_ARGUMENT instead of gRPC's internal error, and the durable
    store logs exactly the bytes that arrived instead of serializing the batch again."""
    handlers = {
        "Push": grpc.stream_stream_rpc_method_handler(
            service.Push, request_deserializer=None, response_serializer=pb.Ack.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INGEST_SERVICE, handlers),))
    server.add_registered_method_handlers(INGEST_SERVICE, handlers)


def decode_payload(payload: bytes, decoder: Decoder | None = None) -> ProfileRows:
    """Rows of a batch in wire form, as the write-ahead log keeps it (it was validated before logging)."""
    return (decoder or Decoder()).decode(pb.Batch.FromString(payload))
