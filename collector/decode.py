"""Batches into store rows: every field checked, stacks and processes an agent sent before remembered."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NoReturn

import numpy as np

from collector.frames import FrameTable
from collector.gpu_metrics import gpu_section_problem
from collector.store.base import GPU_STATE_NAME, Labels, ProfileRows, Stack, StackTable, SyscallAgg
from collector.store.id_index import IdIndex, with_room
from collector.store.ids import labels_id, stack_ids_of
from collector.store.sequences import RESEND_HORIZON_S
from fleetprof.v1 import ingest_pb2 as pb

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
    # A batch's window must lie between now - max_batch_age_s and now + max_clock_skew_s on the
    # collector's clock: a broken agent clock or a replayed capture would otherwise make buckets that
    # retention never reaches, and dedupe state would have to be kept for ever.
    max_clock_skew_s: float = 300.0
    max_batch_age_s: float = RESEND_HORIZON_S


def batch_error(reason: str, message: str) -> BatchError:
    err = BatchError(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def _fail(seq: int, reason: str, problem: str) -> NoReturn:
    raise batch_error(reason, f"batch {seq}: {problem}")


def _check_window(batch: pb.Batch, limits: IngestLimits, now: float) -> None:
    seq = batch.sequence
    ahead = batch.end_unix_ns / 1e9 - now
    if ahead > limits.max_clock_skew_s:
        _fail(
            seq,
            "clock_skew",
            f"its window ends {ahead:.0f} s after the collector's clock "
            f"(at most {limits.max_clock_skew_s:.0f} s allowed): check the node's clock",
        )
    age = now - batch.start_unix_ns / 1e9
    if age > limits.max_batch_age_s:
        _fail(
            seq,
            "stale",
            f"its window started {age:.0f} s before the collector's clock "
            f"(at most {limits.max_batch_age_s:.0f} s allowed): check the node's clock",
        )


def _check_header(batch: pb.Batch, limits: IngestLimits, size: int, now: float | None) -> None:
    """The batch-wide checks; `size` is the batch's wire size, `now` the collector's clock (None: the
    window is not checked against it)."""
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
    if now is not None:
        _check_window(batch, limits, now)
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


def _new_stacks(
    seq: int, stacks: Sequence[pb.Stack], strings: Sequence[str], which: list[int], frames: FrameTable
) -> tuple[np.ndarray, Callable[[int], Stack]]:
    """Check and decode the stacks at `which` together: their content ids (int64 column) and a function
    giving the k-th one's frames. Their frames are found as columns in `frames`, and the ids come from
    numpy passes over frame-id columns, so a new stack costs a few list appends, not a string lookup and
    a hash per frame."""
    nstr = len(strings)
    functions: list[int] = []
    modules: list[int] = []
    lengths: list[int] = []
    kernel_starts: list[int] = []
    for si in which:
        st = stacks[si]
        f, m, n = st.functions, st.modules, len(st.functions)
        if (len(m) and len(m) != n) or n > MAX_STACK_DEPTH or st.kernel_start > n:
            _check_stack_shape(seq, si, st)
        functions.extend(f)
        modules.extend(m if len(m) else repeat(0, n))  # no modules: every frame's module is "" (string 0)
        lengths.append(n)
        kernel_starts.append(st.kernel_start)
    fcol = np.array(functions, dtype=np.int64)
    mcol = np.array(modules, dtype=np.int64)
    lens = np.array(lengths, dtype=np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    if len(fcol) and max(int(fcol.max()), int(mcol.max())) >= nstr:
        first = int(np.flatnonzero((fcol >= nstr) | (mcol >= nstr))[0])
        k = int(np.searchsorted(ends, first, side="right"))
        _check_stack_strings(seq, which[k], stacks[which[k]], nstr)
    position = np.arange(len(fcol), dtype=np.int64) - np.repeat(starts, lens)
    kernel = position >= np.repeat(np.array(kernel_starts, dtype=np.int64), lens)
    slots = frames.slots(strings, fcol, mcol, kernel) if len(fcol) else fcol
    ids = stack_ids_of(frames.ids(slots), lens)
    flat = list(map(frames.keys.__getitem__, slots.tolist()))
    bounds = list(zip(starts.tolist(), ends.tolist(), strict=True))

    def stack(k: int) -> Stack:
        lo, hi = bounds[k]
        return tuple(flat[lo:hi])

    return ids, stack


_ProcessEntry = tuple[int, Labels]  # (stable content id, label set)


class Decoder:
    """Checks batches and turns them into store rows, remembering stacks and label sets across batches.

    Work is proportional to what is new, not to what is sent: agents send the same stacks every window.
    Every distinct stack decoded is kept once, in a slot (its frames and content id), and each agent's
    stack wire ids (Batch.stack_ids) map to slots in an IdIndex: a batch's known stacks are found with
    one columnar lookup and neither decoded nor checked again (they were checked when first seen, and an
    agent's wire id names one content). Keying by agent means a lying agent can only garble its own data.
    The stacks a batch's agent has not sent before (or that carry no wire id) are checked and decoded
    together (`_new_stacks`) and find their slot by content id, so every agent shares one copy. Rows
    reference stacks through a StackTable (ids column + slots), with no per-stack Python. Processes with
    a wire id (Process.id) are remembered per agent in a dict; label sets are cached by their strings.
    Samples are checked and turned into rows column by column. Every cache is bounded.
    """

    MAX_STACKS = 500_000  # slots; when full, only stacks some agent's table points to are kept
    MAX_CACHED = 500_000  # label sets and processes by content: each starts over when full
    MAX_WIRE_IDS = 2_000_000  # (agent, wire id) entries, all agents together: least recent agents go first

    def __init__(self) -> None:
        self._labels: dict[Labels, int] = {}
        self._processes: dict[tuple, _ProcessEntry] = {}
        self._lock = threading.Lock()  # everything below (batches arrive on many threads)
        # (agent id, "stack" | "process") -> wire id -> slot (IdIndex) | process entry (dict)
        self._by_wire_id: OrderedDict[tuple[str, str], IdIndex | dict[int, _ProcessEntry]] = OrderedDict()
        self._wire_ids = 0
        # Every distinct stack decoded, by slot: its frames and its content id; and the slot of each id.
        # `_frames` is only appended to (StackTables handed out keep reading it); _compact makes new ones.
        self._frames: list[Stack] = []
        self._slot_ids = np.zeros(1024, dtype=np.int64)
        self._slot_of: dict[int, int] = {}
        self._frame_table = FrameTable()
        # Stacks in batches so far: found by the agent's wire id, or checked and decoded (new to that
        # agent, or sent without an id). The share decoded is what ingest costs (README, collector scale).
        self.stack_counts = {"known": 0, "decoded": 0}

    def _label_id(self, labels: Labels) -> int:
        lid = self._labels.get(labels)
        if lid is None:
            if len(self._labels) >= self.MAX_CACHED:
                self._labels.clear()
            lid = self._labels[labels] = labels_id(labels)
        return lid

    def _table(self, agent_id: str, kind: str):  # noqa: ANN202
        """This agent's wire-id table of `kind` (lock held), made the most recently used."""
        key = (agent_id, kind)
        table = self._by_wire_id.get(key)
        if table is None:
            table = self._by_wire_id[key] = IdIndex() if kind == "stack" else {}
        else:
            self._by_wire_id.move_to_end(key)
        return table

    def _learned(self, agent_id: str, kind: str, added: int) -> None:
        """Account for `added` new wire ids of one agent (lock held) and enforce the bounds."""
        self._wire_ids += added
        key = (agent_id, kind)
        if len(self._by_wire_id[key]) > self.MAX_WIRE_IDS // 4:  # one agent churning: it starts over alone
            self._wire_ids -= len(self._by_wire_id.pop(key))
        while self._wire_ids > self.MAX_WIRE_IDS and self._by_wire_id:
            _, old = self._by_wire_id.popitem(last=False)
            self._wire_ids -= len(old)

    def _slots(self, ids: np.ndarray, stack: Callable[[int], Stack]) -> np.ndarray:
        """The slot of each content id (lock held), taking new slots for new stacks (`stack(k)`: frames)."""
        slot_of, frames = self._slot_of, self._frames
        found = list(map(slot_of.get, ids.tolist()))
        if None in found:
            for k, slot in enumerate(found):
                if slot is None:
                    cid = int(ids[k])
                    slot = slot_of.get(cid)  # the same new stack twice in one batch
                    if slot is None:
                        slot = slot_of[cid] = len(frames)
                        frames.append(stack(k))
                        self._slot_ids = with_room(self._slot_ids, slot + 1)
                        self._slot_ids[slot] = cid
                    found[k] = slot
        return np.array(found, dtype=np.int64)

    def _compact(self) -> None:
        """Keep only the slots some agent's stack table points to (lock held), dropping the least recently
        used agents' tables until at most half of MAX_STACKS remain; renumber and remap the tables."""
        while True:
            tables = [t for (_, kind), t in self._by_wire_id.items() if kind == "stack"]
            live = np.unique(np.concatenate([np.zeros(0, np.int64)] + [t.items()[1] for t in tables]))
            if len(live) <= self.MAX_STACKS // 2:
                break
            oldest = next(key for key in self._by_wire_id if key[1] == "stack")
            self._wire_ids -= len(self._by_wire_id.pop(oldest))
        renumber = np.full(len(self._frames), -1, dtype=np.int64)
        renumber[live] = np.arange(len(live), dtype=np.int64)
        self._frames = [self._frames[s] for s in live.tolist()]
        ids = self._slot_ids[live]
        self._slot_ids = ids  # a copy: _slots makes room as slots are taken
        self._slot_of = dict(zip(ids.tolist(), range(len(ids)), strict=True))
        for t in tables:
            t.remap(renumber)

    def _decode_stacks(self, batch: pb.Batch, strings: Sequence[str]) -> StackTable:
        seq, stacks, n = batch.sequence, batch.stacks, len(batch.stacks)
        if len(batch.stack_ids) == n:
            # one packed run: no Stack message is touched for known ones
            wire = np.array(batch.stack_ids, dtype=np.uint64).view(np.int64)
        elif len(batch.stack_ids):
            _fail(seq, "bad_stack", f"{len(batch.stack_ids)} stack_ids for {n} stacks")
        else:
            wire = np.fromiter((st.id for st in stacks), dtype=np.uint64, count=n).view(np.int64)
        agent_id = batch.agent.agent_id
        with self._lock:
            if len(self._frames) >= self.MAX_STACKS:
                self._compact()
            known = self._table(agent_id, "stack") if wire.any() else None
            slots = known.get(wire) if known is not None else np.full(n, -1, dtype=np.int64)
            missing = np.flatnonzero(slots < 0)
            self.stack_counts["known"] += n - len(missing)
            self.stack_counts["decoded"] += len(missing)
            if len(missing):
                which = missing.tolist()
                slots[missing] = self._slots(*_new_stacks(seq, stacks, strings, which, self._frame_table))
                named = missing[wire[missing] != 0]
                if known is not None and len(named):
                    known.add(wire[named], slots[named])
                    self._learned(agent_id, "stack", len(named))
            return StackTable(self._slot_ids[slots], slots, self._frames)

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

        if len(batch.process_ids) == len(processes):
            wire_ids = list(batch.process_ids)  # one packed run: no Process message is touched for known ones
        elif len(batch.process_ids):
            _fail(seq, "bad_process", f"{len(batch.process_ids)} process_ids for {len(processes)} processes")
        else:
            wire_ids = [p.id for p in processes]
        agent_id = batch.agent.agent_id
        with self._lock:
            known = self._table(agent_id, "process") if any(wire_ids) else {}
            entries = list(map(known.get, wire_ids))
            if None in entries:
                missing = [i for i, entry in enumerate(entries) if entry is None]
                for i in missing:
                    entries[i] = decode(i)
                learned = {wire_ids[i]: entries[i] for i in missing if wire_ids[i]}
                if learned:
                    known.update(learned)
                    self._learned(agent_id, "process", len(learned))
        return entries

    def decode(
        self,
        batch: pb.Batch,
        limits: IngestLimits | None = None,
        size: int | None = None,
        now: float | None = None,
    ) -> ProfileRows:
        """Check the batch and return its rows for the store; BatchError names the first problem found.

        With `limits`, the batch-wide limits are checked too (`size`: its wire size, when known; `now`: the
        collector's clock, for the window's bounds); without, the batch was accepted before (a write-ahead
        log record) and only what decoding relies on is checked.
        """
        seq = batch.sequence
        if limits is not None:
            _check_header(batch, limits, batch.ByteSize() if size is None else size, now)
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


def decode_payload(payload: bytes, decoder: Decoder | None = None) -> ProfileRows:
    """Rows of a batch in wire form, as the write-ahead log keeps it (it was validated before logging)."""
    return (decoder or Decoder()).decode(pb.Batch.FromString(payload))
