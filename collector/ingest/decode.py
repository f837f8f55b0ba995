"""Batches into the model's rows: stacks and processes an agent sent before are found by their wire ids and
neither decoded nor checked again, so ingest costs what is new, not what is sent."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest import stacks as wire_stacks
from fleetprof.collector.ingest import validate
from fleetprof.collector.ingest.frames import FrameTable
from fleetprof.collector.ingest.quota import SeriesQuota
from fleetprof.collector.ingest.stacks import NewStacks
from fleetprof.collector.ingest.validate import IngestLimits
from fleetprof.collector.model.id_index import IdIndex, PerSource, with_room
from fleetprof.collector.model.ids import ContentIds, stack_ids_of
from fleetprof.collector.model.profile import (
    CUDA_CALLS,
    CUDA_LAUNCH,
    GPU_KERNELS,
    GPU_STATE_NAME,
    IDLE_THREAD,
    OFFCPU,
    PROFILE_TYPE_NAME,
    THREAD_STATE_NAME,
    Labels,
    Stack,
    SyscallAgg,
)
from fleetprof.collector.model.rows import DecodedStacks, ProfileRows, StackTable

log = logging.getLogger(__name__)

GPU_STATE_LABEL = {pb.GPU_STATE_NONE: "", pb.GPU_STATE_IDLE: "idle", pb.GPU_STATE_BUSY: "busy"}

ProcessEntry = tuple[int, Labels]  # (content id, label set)


@dataclass
class _StackPlan:
    """A batch's stack table as looked up, before anything of it is learned: each stack's slot (-1 for the
    new ones), and the new stacks' checked frame columns."""

    source: str
    wire: np.ndarray
    slots: np.ndarray
    missing: np.ndarray
    columns: NewStacks | None


class StackCache:
    """Every distinct stack decoded, kept once in a slot (its frames and content id), and per source (an
    agent id, qualified by the identity that authenticated it) its wire ids' slots (an IdIndex each). A
    batch's known stacks are found with one columnar lookup; the rest are checked and decoded together and
    find their slot by content id, so agents share one copy. Keyed by source, so a lying agent can only
    garble its own data. Not thread-safe: the Decoder locks.

    Two steps, so that a refused batch leaves nothing behind: `plan` looks the batch's stacks up and checks
    the new ones, changing nothing; `commit` decodes and learns them, and cannot fail.

    A stack new to an agent that finds its content id in a slot is compared with that slot's frames (tuples
    of shared FrameKeys: an identity check per frame). Content ids are keyed (collector/model/ids.py), so a
    mismatch is a 64-bit accident or a leaked key; either way the newcomer is counted ("collisions") and
    gets a slot of its own under a stand-in id, never the other stack's frames. Not refused: a refusal
    would let whoever holds an id get another agent's batches refused. This guards the slots this process
    holds; the stores keep the first content under an id, which is why ids are keyed."""

    MAX_STACKS = 500_000  # slots; when full, only stacks some agent's table points to are kept
    MAX_WIRE_IDS = 2_000_000  # (agent, wire id) entries, all agents together

    def __init__(self, ids: ContentIds) -> None:
        self._ids = ids
        # Stacks in batches so far: found by the agent's wire id, or checked and decoded (the share decoded
        # is what ingest costs: bench/README.md, Collector scale); and of those decoded, how many found their
        # content id held by other frames.
        self.counts = {"known": 0, "decoded": 0, "collisions": 0}
        self._agents = PerSource(IdIndex, self.MAX_WIRE_IDS)
        # `_frames` is only appended to (StackTables handed out keep reading it); _compact makes a new one.
        self._frames: list[Stack] = []
        self._slot_ids = np.zeros(1024, dtype=np.int64)
        self._slot_of: dict[int, int] = {}
        self._frame_table = FrameTable(self._ids)

    def plan(
        self,
        batch: pb.Batch,
        strings: Sequence[str],
        source: str,
        packed: wire_stacks.PackedStacks | None = None,
    ) -> _StackPlan:
        """Look the batch's stacks up (its stack_ids were checked to be one per stack) and check the ones
        new to `source` (`packed`: its packed columns as check_form read them); raises BatchError, changing
        nothing but the cache's own housekeeping."""
        if len(self._frames) >= self.MAX_STACKS:
            self._compact()
        n = wire_stacks.stack_count(batch)
        wire = np.array(batch.stack_ids, dtype=np.uint64).view(np.int64)
        known = self._agents.get(source)
        slots = known.get(wire) if known is not None and n else np.full(n, -1, dtype=np.int64)
        missing = np.flatnonzero(slots < 0)
        columns = None
        if len(missing):
            columns = wire_stacks.new_stack_columns(batch, len(strings), missing.tolist(), packed)
        return _StackPlan(source, wire, slots, missing, columns)

    def commit(self, plan: _StackPlan, strings: Sequence[str]) -> StackTable:
        """Decode and learn a planned batch's new stacks; its stack table."""
        slots, missing = plan.slots, plan.missing
        self.counts["known"] += len(slots) - len(missing)
        self.counts["decoded"] += len(missing)
        decoded = None
        if plan.columns is not None:
            ids, stack, frame_ids = _decode_stacks(plan.columns, strings, self._frame_table, plan.source)
            new = slots[missing] = self._slots(ids, stack)
            self._agents.table(plan.source).add(plan.wire[missing], new)
            self._agents.learned(plan.source, len(missing))
            # Under their slots' ids: a stack whose id other frames held has a stand-in id (_slot_for).
            stacks = list(map(self._frames.__getitem__, new.tolist()))
            decoded = DecodedStacks(self._slot_ids[new], plan.columns.lengths, frame_ids, stacks)
        elif len(slots):
            self._agents.table(plan.source)  # used now: the least recently used tables go first
        return StackTable(self._slot_ids[slots], slots, self._frames, decoded)

    def sizes(self) -> dict[str, int]:
        """What the cache holds: stacks, wire ids, frames and their strings (the refused-batch test)."""
        frames = self._frame_table
        return {
            "stacks": len(self._frames),
            "stack_slot_ids": len(self._slot_of),
            "stack_wire_ids": sum(len(t) for t in self._agents.values()),
            "stack_sources": len(self._agents),
            "frames": len(frames.keys),
            "frame_strings": len(frames._strings),
            "frame_string_chars": frames._chars,
            "frame_wire_ids": sum(len(t) for t in frames._by_wire_id.values()),
        }

    def _slots(self, ids: np.ndarray, stack: Callable[[int], Stack]) -> np.ndarray:
        """The slot of each stack (content ids `ids`, frames `stack(k)`): the slot holding its content id
        if that slot holds its frames, else a new one."""
        frames = self._frames
        cids = ids.tolist()
        found = list(map(self._slot_of.get, cids))
        fresh: dict[int, int] = {}  # content id -> k, for ids no slot holds: taken together below
        others = []  # the same id twice in one batch, or an id held by other frames: one by one, after
        for k, slot in enumerate(found):
            if slot is None:
                if fresh.setdefault(cids[k], k) != k:
                    others.append(k)
            elif frames[slot] != stack(k):
                others.append(k)
        if fresh:
            # New slots in a few list and array operations, not an append and an array store each.
            base = len(frames)
            order = list(fresh.values())
            frames.extend(map(stack, order))
            self._slot_of.update(zip(fresh, range(base, base + len(order)), strict=True))
            self._slot_ids = with_room(self._slot_ids, base + len(order))
            self._slot_ids[base : base + len(order)] = ids[order]
            for k, slot in zip(order, range(base, base + len(order)), strict=True):
                found[k] = slot
        for k in others:
            found[k] = self._slot_for(cids[k], stack(k))
        return np.array(found, dtype=np.int64)

    def _slot_for(self, cid: int, frames: Stack) -> int:
        """The slot of `frames` under content id `cid` or, where other frames hold it, under the first of its
        stand-in ids free or holding these frames; a new slot if none holds them."""
        attempt = 0
        while True:
            slot = self._slot_of.get(cid)
            if slot is None:
                slot = self._slot_of[cid] = len(self._frames)
                self._frames.append(frames)
                self._slot_ids = with_room(self._slot_ids, slot + 1)
                self._slot_ids[slot] = cid
                return slot
            if self._frames[slot] == frames:  # the same new stack twice in one batch, or a stand-in's
                return slot
            if attempt == 0:
                self.counts["collisions"] += 1
            attempt += 1
            cid = self._ids.other_stack_id(cid, attempt)

    def _compact(self) -> None:
        """Keep only the slots some agent's table points to, dropping the least recently used agents'
        tables until at most half of MAX_STACKS remain; renumber and remap the tables."""
        while True:
            tables = list(self._agents.values())
            live = np.unique(np.concatenate([np.zeros(0, np.int64)] + [t.items()[1] for t in tables]))
            if len(live) <= self.MAX_STACKS // 2:
                break
            self._agents.drop_oldest()
        renumber = np.full(len(self._frames), -1, dtype=np.int64)
        renumber[live] = np.arange(len(live), dtype=np.int64)
        self._frames = [self._frames[s] for s in live.tolist()]
        ids = self._slot_ids[live]
        self._slot_ids = ids  # a copy: _slots makes room as slots are taken
        self._slot_of = dict(zip(ids.tolist(), range(len(ids)), strict=True))
        for t in tables:
            t.remap(renumber)


def _decode_stacks(
    columns: NewStacks, strings: Sequence[str], frames: FrameTable, source: str
) -> tuple[np.ndarray, Callable[[int], Stack], np.ndarray]:
    """Decode checked new stacks together: their content ids (int64 column), a function giving the k-th
    one's frames, and the ids of all their frames, one stack after another (int64 column).
    Their frames are found as columns in `frames`, and the ids come from numpy passes over frame-id
    columns, so a new stack costs a few list appends, not a string lookup and a hash per frame; where the
    agent sent frame ids, the frames it sent before (`source`) cost no string lookup either."""
    fcol, mcol, lens, kernel_starts, wire = columns
    ends = np.cumsum(lens)
    starts = ends - lens
    position = np.arange(len(fcol), dtype=np.int64) - np.repeat(starts, lens)
    kernel = position >= np.repeat(kernel_starts, lens)
    if not len(fcol):
        slots = fcol
    elif wire is not None:
        slots = frames.wire_slots(source, wire, strings, kernel)
    else:
        slots = frames.slots(strings, fcol, mcol, kernel)
    frame_ids = frames.ids(slots)
    ids = stack_ids_of(frame_ids, lens)
    flat = list(map(frames.keys.__getitem__, slots.tolist()))
    bounds = list(zip(starts.tolist(), ends.tolist(), strict=True))

    def stack(k: int) -> Stack:
        lo, hi = bounds[k]
        return tuple(flat[lo:hi])

    return ids, stack, frame_ids


@dataclass
class _ProcessPlan:
    """A batch's processes as looked up, before anything of them is learned: every process's entry, and the
    ones new to the source, each with the content key it is remembered under."""

    key: tuple[str, str]  # (source, node)
    wire_ids: list[int]
    entries: list[ProcessEntry]
    new: dict[int, tuple]  # process index -> content key


class ProcessCache:
    """Per (source, node), its process wire ids' label sets (a dict each); and label sets by content, so a
    process described again under a new id costs a dict lookup, not a sort and a hash. Two steps, as
    StackCache: `plan` checks, `commit` learns. The Decoder locks around both; `label_id` is thread-safe."""

    MAX_CACHED = 500_000  # label sets and processes by content: each starts over when full
    MAX_WIRE_IDS = 1_000_000

    def __init__(self, ids: ContentIds) -> None:
        self._ids = ids
        self._lock = threading.Lock()  # _label_ids, which label_id reaches without the Decoder's lock
        self._agents = PerSource(dict, self.MAX_WIRE_IDS)
        self._by_content: dict[tuple, ProcessEntry] = {}
        self._label_ids: dict[Labels, int] = {}

    def label_id(self, labels: Labels) -> int:
        with self._lock:
            lid = self._label_ids.get(labels)
            if lid is None:
                if len(self._label_ids) >= self.MAX_CACHED:
                    self._label_ids.clear()
                lid = self._label_ids[labels] = self._ids.labels_id(labels)
            return lid

    def plan(
        self, batch: pb.Batch, strings: Sequence[str], source: str, limits: IngestLimits | None
    ) -> _ProcessPlan:
        """The label set of each of the batch's processes (process_ids were checked to be one each), the
        ones new to the source checked; raises BatchError, changing nothing."""
        wire_ids = list(batch.process_ids)  # one packed run: no Process message is touched for known ones
        # The node is in each entry's labels: an agent that comes back under another node name (a renamed
        # or re-imaged host keeping its state) must not file its processes under the old one.
        key = (source, batch.agent.node)
        known = self._agents.get(key)
        entries = list(map(known.get, wire_ids)) if known is not None else [None] * len(wire_ids)
        new: dict[int, tuple] = {}
        if None in entries:
            for i, entry in enumerate(entries):
                if entry is None:
                    new[i], entries[i] = self._describe(batch, i, strings, limits)
        return _ProcessPlan(key, wire_ids, entries, new)  # type: ignore[arg-type]

    def commit(self, plan: _ProcessPlan) -> list[ProcessEntry]:
        """Learn a planned batch's new processes; every process's entry."""
        entries = plan.entries
        if plan.new:
            if len(self._by_content) + len(plan.new) > self.MAX_CACHED:
                self._by_content.clear()
            with self._lock:
                if len(self._label_ids) + len(plan.new) > self.MAX_CACHED:
                    self._label_ids.clear()
                for i, content in plan.new.items():
                    lid, lset = self._by_content.setdefault(content, entries[i])
                    self._label_ids.setdefault(lset, lid)
            known = self._agents.table(plan.key)
            known.update((plan.wire_ids[i], entries[i]) for i in plan.new)
            self._agents.learned(plan.key, len(plan.new))
        elif entries:
            self._agents.table(plan.key)  # used now: the least recently used tables go first
        return entries

    def sizes(self) -> dict[str, int]:
        """What the cache holds: wire ids, processes and label sets by content (the refused-batch test)."""
        return {
            "process_wire_ids": sum(len(t) for t in self._agents.values()),
            "process_sources": len(self._agents),
            "processes_by_content": len(self._by_content),
            "label_set_ids": len(self._label_ids),
        }

    def _describe(
        self, batch: pb.Batch, pi: int, strings: Sequence[str], limits: IngestLimits | None
    ) -> tuple[tuple, ProcessEntry]:
        """A new process's content key and entry, checked (BatchError names the problem)."""
        seq, nstr, node = batch.sequence, len(strings), batch.agent.node
        p = batch.processes[pi]
        comm, exe = p.comm, p.exe
        pairs = [(lb.name, lb.value) for lb in p.labels]
        if (
            comm >= nstr
            or exe >= nstr
            or (pairs and (max(map(max, pairs)) >= nstr or min(pairs)[0] == 0))
            or (limits is not None and len(pairs) > limits.max_labels_per_process)
        ):
            validate.check_process(seq, pi, p, nstr, limits)
        key = (node, p.pid, strings[comm], *[(strings[n], strings[v]) for n, v in pairs])
        hit = self._by_content.get(key)
        if hit is None:
            validate.check_comm(seq, pi, key[2])
            labels = {"node": node, "pid": str(p.pid), "comm": key[2]}
            for name, value in key[3:]:
                validate.check_label(seq, pi, name, value)
                if value:
                    labels[name] = value
            lset = tuple(sorted((k, v) for k, v in labels.items() if v))
            lid = self._label_ids.get(lset)
            hit = (self._ids.labels_id(lset) if lid is None else lid, lset)
        return key, hit


def source_key(identity: str, agent_id: str) -> str:
    """What keys an agent's wire-id tables and dedupe state: its agent id, qualified by the identity that
    authenticated it where there is one (ingest/peer.py), so an agent that learns another's id cannot reach
    the other's tables or pre-send its sequence numbers. Agent ids hold no "|" (validate.AGENT_ID)."""
    return f"{identity}|{agent_id}" if identity else agent_id


class Decoder:
    """Checks batches and turns them into ProfileRows, with a StackCache, a ProcessCache and, for batches
    checked against limits, a SeriesQuota across batches; samples are checked and turned into rows column
    by column. Thread-safe.

    A refused batch leaves nothing behind: every check runs before any cache learns from the batch (the
    sample, syscall and GPU sections first, then the new stacks and processes, then the label quota, all
    under one lock with the learning that follows), so the caches' sizes after a refusal are what they
    were before it (tests/collector/test_refused_batches.py)."""

    def __init__(self, ids: ContentIds, clock: Callable[[], float] = time.time) -> None:
        self._ids = ids
        self._lock = threading.Lock()
        self.stacks = StackCache(ids)
        self.processes = ProcessCache(ids)
        self.quota = SeriesQuota(clock)

    def decode(
        self,
        batch: pb.Batch,
        limits: IngestLimits | None = None,
        size: int | None = None,
        now: float | None = None,
        identity: str = "",
    ) -> ProfileRows:
        """Check the batch and return its rows for the store; BatchError names the first problem found.

        With `limits`, the batch-wide limits and the label quota are checked too (`size`: its wire size,
        when known; `now`: the collector's clock, for the window's bounds); without, the batch was accepted
        before (a write-ahead log record) and only what decoding relies on is checked. `identity`: who
        authenticated the batch ("" for no one in particular): it keys the caches and the quota.
        """
        seq = batch.sequence
        if limits is not None:
            validate.check_header(batch, limits, batch.ByteSize() if size is None else size, now)
        validate.check_string_table(batch)
        packed = wire_stacks.check_form(batch)
        nproc, nstack = len(batch.processes), wire_stacks.stack_count(batch)
        validate.check_wire_ids(batch, nstack)
        validate.check_sample_column_lengths(batch)
        pcol, kcol, ccol, gcol = columns = _columns(batch.sample_columns, "count")
        validate.check_sample_columns(seq, columns, nproc, nstack)
        offcpu_rows = len(batch.offcpu_columns.process)
        if offcpu_rows:
            offcpu = _columns(batch.offcpu_columns, "blocked_ns")
            validate.check_sample_columns(seq, offcpu, nproc, nstack, kind=validate.OFFCPU)
        launch_rows = len(batch.cuda_launch_columns.process)
        if launch_rows:
            launches = _columns(batch.cuda_launch_columns, "count")
            validate.check_sample_columns(seq, launches, nproc, nstack, kind=validate.CUDA_LAUNCHES)
            wire_stacks.check_kernel_leaves(batch, packed, launches[1], validate.CUDA_LAUNCHES)
        kernel_rows = len(batch.cuda_kernel_columns.process)
        if kernel_rows:
            kernels = _columns(batch.cuda_kernel_columns, "kernel_ns")
            validate.check_sample_columns(seq, kernels, nproc, nstack, kind=validate.GPU_KERNELS)
            wire_stacks.check_kernel_leaves(batch, packed, kernels[1], validate.GPU_KERNELS)
        strings = batch.strings  # read only where something is decoded: most of a batch is known
        if batch.syscalls:
            validate.check_syscalls(batch, nproc, len(strings))
        if batch.cuda_calls:
            validate.check_cuda_calls(batch, nproc, len(strings))
        if batch.cuda_activity:
            validate.check_cuda_activity(batch, nproc, len(strings))
        if batch.HasField("cuda_stats"):
            validate.check_cuda_stats(batch)
        if batch.gpu_devices or batch.gpu_processes or batch.HasField("gpu_source"):
            validate.check_gpu_section(batch)
        source = source_key(identity, batch.agent.agent_id)
        tenant = (identity, batch.agent.node)
        with self._lock:
            stack_plan = self.stacks.plan(batch, strings, source, packed)
            process_plan = self.processes.plan(batch, strings, source, limits)
            if limits is not None:
                self.quota.check(seq, batch.agent.node, tenant, process_plan.entries, limits)
            # Nothing below refuses the batch.
            stacks = self.stacks.commit(stack_plan, strings)
            procs = self.processes.commit(process_plan)
            if limits is not None:
                self.quota.admit(tenant, procs, limits)
        label_table: list[ProcessEntry] = list(procs)
        if gcol.any():
            pcol = self._tagged_processes(pcol, gcol, label_table)
        # Other profile types follow the CPU samples, each under its __type__ (ProfileRows.typed_rows).
        typed = []
        if offcpu_rows:
            opcol, okcol, occol, ogcol = offcpu
            idle = np.array(batch.offcpu_columns.idle, dtype=np.int64) if batch.offcpu_columns.idle else 0
            opcol = self._tagged_processes(opcol, ogcol + 4 * idle, label_table, OFFCPU)
            typed.append((opcol, okcol, occol))
        if launch_rows:
            lpcol, lkcol, lccol, lgcol = launches
            typed.append((self._tagged_processes(lpcol, lgcol, label_table, CUDA_LAUNCH), lkcol, lccol))
        if kernel_rows:
            kpcol, kkcol, kccol, kgcol = kernels
            typed.append((self._tagged_processes(kpcol, kgcol, label_table, GPU_KERNELS), kkcol, kccol))
        if typed:
            pcol = np.concatenate((pcol, *(t[0] for t in typed)))
            kcol = np.concatenate((kcol, *(t[1] for t in typed)))
            ccol = np.concatenate((ccol, *(t[2] for t in typed)))
        syscalls = [
            (
                procs[sc.process][1],
                strings[sc.syscall],
                SyscallAgg(sc.count, sc.timed, sc.timed_ns, list(sc.latency_log2_ns)),
            )
            for sc in batch.syscalls
        ]
        # CUDA API calls are stored as syscall rows are, under their process's label set plus
        # __type__="cuda" (a label set of their own: no syscall query sees them, nor they a syscall).
        cuda_types: dict[int, Labels] = {}
        for c in batch.cuda_calls:
            lset = cuda_types.get(c.process)
            if lset is None:
                lset = cuda_types[c.process] = tuple(
                    sorted((*procs[c.process][1], (PROFILE_TYPE_NAME, CUDA_CALLS)))
                )
                label_table.append((self.processes.label_id(lset), lset))
            syscalls.append(
                (lset, strings[c.call], SyscallAgg(c.count, c.timed, c.timed_ns, list(c.latency_log2_ns)))
            )
        return ProfileRows(
            batch.start_unix_ns / 1e9,
            batch.end_unix_ns / 1e9,
            batch.frequency_hz,
            label_table,
            stacks,
            pcol,
            kcol,
            ccol.astype(np.int64),
            syscalls,
            offcpu_rows + launch_rows + kernel_rows,
            len(batch.cuda_calls),
        )

    def decode_payload(self, payload: bytes) -> ProfileRows:
        """Rows of a batch in wire form, as the write-ahead log keeps it. It was checked before it was logged,
        except for the stacks and processes the collector knew by wire id then; a restart replays it on an
        empty cache, which decodes them all. Where the agent sent other content under a known id that does
        not decode, its samples stay, under a stand-in (validate.stand_in_undecodable), and it is logged:
        checking every known stack at ingest would have cost ingest 5x (bench/ingest_cpu.py, 0% new)."""
        batch = pb.Batch.FromString(payload)
        try:
            return self.decode(batch)
        except validate.BatchError as err:
            wire_stacks.to_messages(batch)
            stacks, processes = validate.stand_in_undecodable(batch)
            if not stacks and not processes:
                raise
            log.warning(
                "%s; it was accepted with the content the collector knew under those ids, and is stored "
                "with %d stacks and %d processes standing in",
                err,
                stacks,
                processes,
            )
            return self.decode(batch)

    def sizes(self) -> dict[str, int]:
        """Every table ingest keeps across batches, by entries (and characters of frame names): what a
        refused batch must leave as it was."""
        with self._lock:
            out = {**self.stacks.sizes(), **self.processes.sizes()}
        out.update({f"quota_{k}": v for k, v in self.quota.sizes().items()})
        out["interned_frames"] = self._ids.interned_frame_count()
        return out

    def _tagged_processes(
        self, pcol: np.ndarray, gcol: np.ndarray, table: list[ProcessEntry], profile_type: str = ""
    ) -> np.ndarray:
        """Samples taken on a GPU go to their process's label set plus gpu_state, and rows of another
        profile type (all of them, with `profile_type`: off-CPU, CUDA launches, GPU kernel time) to it plus
        __type__, and __thread__="idle" for idle threads' off-CPU rows: one table entry is appended per
        (process, state), and those rows repointed to it. `gcol`: the GPU state, plus 4 for an idle
        thread's off-CPU row."""
        tagged = np.arange(len(pcol)) if profile_type else np.flatnonzero(gcol)
        keys = pcol[tagged] * 8 + gcol[tagged]
        distinct, which = np.unique(keys, return_inverse=True)
        first = len(table)
        for key in distinct.tolist():
            process, state = divmod(key, 8)
            idle, state = divmod(state, 4)
            extra = [(GPU_STATE_NAME, GPU_STATE_LABEL[state])] if state else []
            if profile_type:
                extra.append((PROFILE_TYPE_NAME, profile_type))
            if idle:
                extra.append((THREAD_STATE_NAME, IDLE_THREAD))
            lset = tuple(sorted((*table[process][1], *extra)))
            table.append((self.processes.label_id(lset), lset))
        pcol = pcol.copy()
        pcol[tagged] = first + which
        return pcol


def _columns(section, values: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(process, stack, `values`, gpu) columns of a column section (SampleColumns, OffCpuColumns,
    CudaLaunchColumns, CudaKernelColumns; lengths checked). Values stay unsigned, so a huge one stays huge
    until it is checked. A section without GPU states (or without the field: kernel time) reads none."""
    n = len(section.process)
    states = getattr(section, "gpu", ())
    gpu = np.array(states, dtype=np.int64) if len(states) else np.zeros(n, dtype=np.int64)
    return (
        np.array(section.process, dtype=np.int64),
        np.array(section.stack, dtype=np.int64),
        np.array(getattr(section, values), dtype=np.uint64),
        gpu,
    )


def decode_batch(batch: pb.Batch, ids: ContentIds) -> ProfileRows:
    """Rows for the store, without caches. Raises BatchError for a batch that cannot be decoded."""
    return Decoder(ids).decode(batch)
