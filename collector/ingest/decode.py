"""Batches into the model's rows: stacks and processes an agent sent before are found by their wire ids and
neither decoded nor checked again, so ingest costs what is new, not what is sent."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from itertools import repeat

import numpy as np

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest import validate
from fleetprof.collector.ingest.frames import FrameTable
from fleetprof.collector.ingest.validate import MAX_STACK_DEPTH, IngestLimits
from fleetprof.collector.model.id_index import IdIndex, with_room
from fleetprof.collector.model.ids import key_generation, labels_id, other_stack_id, stack_ids_of
from fleetprof.collector.model.profile import (
    GPU_STATE_NAME,
    IDLE_THREAD,
    OFFCPU,
    PROFILE_TYPE_NAME,
    THREAD_STATE_NAME,
    Labels,
    Stack,
    SyscallAgg,
)
from fleetprof.collector.model.rows import ProfileRows, StackTable

GPU_STATE_LABEL = {pb.GPU_STATE_NONE: "", pb.GPU_STATE_IDLE: "idle", pb.GPU_STATE_BUSY: "busy"}

ProcessEntry = tuple[int, Labels]  # (content id, label set)


class _PerAgent(OrderedDict):
    """agent id -> that agent's wire-id table, least recently used first, bounded in entries over all
    agents: the least recent agents' tables go first, and one agent past a quarter of the bound starts over
    alone (an agent churning ids must not evict everyone else)."""

    def __init__(self, new: Callable[[], IdIndex | dict], max_entries: int) -> None:
        super().__init__()
        self._new = new
        self._max = max_entries
        self._entries = 0

    def table(self, agent_id: Hashable) -> IdIndex | dict:
        table = self.get(agent_id)
        if table is None:
            table = self[agent_id] = self._new()
        else:
            self.move_to_end(agent_id)
        return table

    def learned(self, agent_id: Hashable, added: int) -> None:
        self._entries += added
        if len(self[agent_id]) > self._max // 4:
            self._entries -= len(self.pop(agent_id))
        while self._entries > self._max and self:
            _, old = self.popitem(last=False)
            self._entries -= len(old)

    def drop_oldest(self) -> None:
        _, old = self.popitem(last=False)
        self._entries -= len(old)


class StackCache:
    """Every distinct stack decoded, kept once in a slot (its frames and content id), and per agent its
    wire ids' slots (an IdIndex each). A batch's known stacks are found with one columnar lookup; the rest
    are checked and decoded together and find their slot by content id, so agents share one copy. Keyed by
    agent, so a lying agent can only garble its own data. Thread-safe.

    A stack new to an agent that finds its content id in a slot is compared with that slot's frames (tuples
    of shared FrameKeys: an identity check per frame). Content ids are keyed (collector/model/ids.py), so a
    mismatch is a 64-bit accident or a leaked key; either way the newcomer is counted ("collisions") and
    gets a slot of its own under a stand-in id, never the other stack's frames. Not refused: a refusal
    would let whoever holds an id get another agent's batches refused. This guards the slots this process
    holds; the stores keep the first content under an id, which is why ids are keyed."""

    MAX_STACKS = 500_000  # slots; when full, only stacks some agent's table points to are kept
    MAX_WIRE_IDS = 2_000_000  # (agent, wire id) entries, all agents together

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start_over()
        # Stacks in batches so far: found by the agent's wire id, or checked and decoded (the share decoded
        # is what ingest costs: README, collector scale); and of those decoded, how many found their
        # content id held by other frames.
        self.counts = {"known": 0, "decoded": 0, "collisions": 0}

    def _start_over(self) -> None:
        """Forget every stack (lock held): at start, and when the content-id key changes."""
        self._key_generation = key_generation()
        self._agents = _PerAgent(IdIndex, self.MAX_WIRE_IDS)
        # `_frames` is only appended to (StackTables handed out keep reading it); _compact makes a new one.
        self._frames: list[Stack] = []
        self._slot_ids = np.zeros(1024, dtype=np.int64)
        self._slot_of: dict[int, int] = {}
        self._frame_table = FrameTable()

    def table(self, batch: pb.Batch, strings: Sequence[str]) -> StackTable:
        """The batch's stack table (the batch's stack_ids were checked to be one per stack)."""
        n = len(batch.stacks)
        wire = np.array(batch.stack_ids, dtype=np.uint64).view(np.int64)
        agent_id = batch.agent.agent_id
        with self._lock:
            if self._key_generation != key_generation():
                self._start_over()
            elif len(self._frames) >= self.MAX_STACKS:
                self._compact()
            known = self._agents.table(agent_id)
            slots = known.get(wire) if n else np.zeros(0, dtype=np.int64)
            missing = np.flatnonzero(slots < 0)
            self.counts["known"] += n - len(missing)
            self.counts["decoded"] += len(missing)
            if len(missing):
                ids, stack = _new_stacks(
                    batch.sequence, batch.stacks, strings, missing.tolist(), self._frame_table
                )
                slots[missing] = self._slots(ids, stack)
                known.add(wire[missing], slots[missing])
                self._agents.learned(agent_id, len(missing))
            return StackTable(self._slot_ids[slots], slots, self._frames)

    def _slots(self, ids: np.ndarray, stack: Callable[[int], Stack]) -> np.ndarray:
        """The slot of each stack (content ids `ids`, frames `stack(k)`), lock held: the slot holding its
        content id if that slot holds its frames, else a new one."""
        frames = self._frames
        cids = ids.tolist()
        found = list(map(self._slot_of.get, cids))
        for k, slot in enumerate(found):
            st = stack(k)
            if slot is None or frames[slot] != st:
                found[k] = self._slot_for(cids[k], st)
        return np.array(found, dtype=np.int64)

    def _slot_for(self, cid: int, frames: Stack) -> int:
        """The slot of `frames` under content id `cid` or, where other frames hold it, under the first of its
        stand-in ids free or holding these frames; a new slot if none holds them (lock held)."""
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
            cid = other_stack_id(cid, attempt)

    def _compact(self) -> None:
        """Keep only the slots some agent's table points to (lock held), dropping the least recently used
        agents' tables until at most half of MAX_STACKS remain; renumber and remap the tables."""
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
            validate.check_stack_shape(seq, si, st)
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
        validate.check_stack_strings(seq, which[k], stacks[which[k]], nstr)
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


class ProcessCache:
    """Per agent, its process wire ids' label sets (a dict each); and label sets by content, so a process
    described again under a new id costs a dict lookup, not a sort and a hash. Thread-safe."""

    MAX_CACHED = 500_000  # label sets and processes by content: each starts over when full
    MAX_WIRE_IDS = 1_000_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start_over()

    def _start_over(self) -> None:
        """Forget every label set (lock held): at start, and when the content-id key changes."""
        self._key_generation = key_generation()
        self._agents = _PerAgent(dict, self.MAX_WIRE_IDS)
        self._by_content: dict[tuple, ProcessEntry] = {}
        self._label_ids: dict[Labels, int] = {}

    def label_id(self, labels: Labels) -> int:
        with self._lock:
            if self._key_generation != key_generation():
                self._start_over()
            return self._label_id(labels)

    def _label_id(self, labels: Labels) -> int:
        lid = self._label_ids.get(labels)
        if lid is None:
            if len(self._label_ids) >= self.MAX_CACHED:
                self._label_ids.clear()
            lid = self._label_ids[labels] = labels_id(labels)
        return lid

    def entries(self, batch: pb.Batch, strings: Sequence[str]) -> list[ProcessEntry]:
        """The label set of each of the batch's processes (process_ids were checked to be one each)."""
        wire_ids = list(batch.process_ids)  # one packed run: no Process message is touched for known ones
        # The node is in each entry's labels: an agent that comes back under another node name (a renamed
        # or re-imaged host keeping its state) must not file its processes under the old one.
        agent_id = (batch.agent.agent_id, batch.agent.node)
        with self._lock:
            if self._key_generation != key_generation():
                self._start_over()
            known = self._agents.table(agent_id)
            entries = list(map(known.get, wire_ids))
            if None in entries:
                missing = [i for i, entry in enumerate(entries) if entry is None]
                for i in missing:
                    entries[i] = self._decode(batch, i, strings)
                known.update((wire_ids[i], entries[i]) for i in missing)
                self._agents.learned(agent_id, len(missing))
        return entries  # type: ignore[return-value]

    def _decode(self, batch: pb.Batch, pi: int, strings: Sequence[str]) -> ProcessEntry:
        seq, nstr, node = batch.sequence, len(strings), batch.agent.node
        p = batch.processes[pi]
        comm, exe = p.comm, p.exe
        pairs = [(lb.name, lb.value) for lb in p.labels]
        if comm >= nstr or exe >= nstr or (pairs and (max(map(max, pairs)) >= nstr or min(pairs)[0] == 0)):
            validate.check_process(seq, pi, p, nstr)
        key = (node, p.pid, strings[comm], *[(strings[n], strings[v]) for n, v in pairs])
        hit = self._by_content.get(key)
        if hit is None:
            if len(self._by_content) >= self.MAX_CACHED:
                self._by_content.clear()
            labels = {"node": node, "pid": str(p.pid), "comm": strings[comm]}
            for name, value in key[3:]:
                validate.check_label(seq, pi, name, value)
                if value:
                    labels[name] = value
            lset = tuple(sorted((k, v) for k, v in labels.items() if v))
            hit = self._by_content[key] = (self._label_id(lset), lset)
        return hit


class Decoder:
    """Checks batches and turns them into ProfileRows, with a StackCache and a ProcessCache across
    batches; samples are checked and turned into rows column by column. Thread-safe."""

    def __init__(self) -> None:
        self.stacks = StackCache()
        self.processes = ProcessCache()

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
        if limits is not None:
            validate.check_header(batch, limits, batch.ByteSize() if size is None else size, now)
        validate.check_string_table(batch)
        validate.check_wire_ids(batch)
        validate.check_sample_column_lengths(batch)
        strings = batch.strings  # read only where something is decoded: most of a batch is known
        stacks = self.stacks.table(batch, strings)
        procs = self.processes.entries(batch, strings)
        if batch.syscalls:
            validate.check_syscalls(batch, len(procs), len(strings))
        if batch.gpu_devices or batch.gpu_processes or batch.HasField("gpu_source"):
            validate.check_gpu_section(batch)
        pcol, kcol, ccol, gcol = columns = _sample_columns(batch)
        validate.check_sample_columns(batch.sequence, columns, len(procs), len(stacks))
        label_table: list[ProcessEntry] = list(procs)
        if gcol.any():
            pcol = self._tagged_processes(pcol, gcol, label_table)
        offcpu_rows = len(batch.offcpu_columns.process)
        if offcpu_rows:
            opcol, okcol, occol, ogcol = columns = _offcpu_columns(batch)
            validate.check_sample_columns(batch.sequence, columns, len(procs), len(stacks), offcpu=True)
            idle = np.array(batch.offcpu_columns.idle, dtype=np.int64) if batch.offcpu_columns.idle else 0
            opcol = self._tagged_processes(opcol, ogcol + 4 * idle, label_table, offcpu=True)
            pcol, kcol = np.concatenate((pcol, opcol)), np.concatenate((kcol, okcol))
            ccol = np.concatenate((ccol, occol))
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
            pcol,
            kcol,
            ccol.astype(np.int64),
            syscalls,
            offcpu_rows,
        )

    def _tagged_processes(
        self, pcol: np.ndarray, gcol: np.ndarray, table: list[ProcessEntry], offcpu: bool = False
    ) -> np.ndarray:
        """Samples taken on a GPU go to their process's label set plus gpu_state, and off-CPU rows (all of
        them, with `offcpu`) to it plus __type__="offcpu", and __thread__="idle" for idle threads' rows: one
        table entry is appended per (process, state), and those rows repointed to it. `gcol`: the GPU
        state, plus 4 for an idle thread's off-CPU row."""
        tagged = np.arange(len(pcol)) if offcpu else np.flatnonzero(gcol)
        keys = pcol[tagged] * 8 + gcol[tagged]
        distinct, which = np.unique(keys, return_inverse=True)
        first = len(table)
        for key in distinct.tolist():
            process, state = divmod(key, 8)
            idle, state = divmod(state, 4)
            extra = [(GPU_STATE_NAME, GPU_STATE_LABEL[state])] if state else []
            if offcpu:
                extra.append((PROFILE_TYPE_NAME, OFFCPU))
            if idle:
                extra.append((THREAD_STATE_NAME, IDLE_THREAD))
            lset = tuple(sorted((*table[process][1], *extra)))
            table.append((self.processes.label_id(lset), lset))
        pcol = pcol.copy()
        pcol[tagged] = first + which
        return pcol


def _sample_columns(batch: pb.Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(process, stack, count, gpu) columns (lengths checked). Counts stay unsigned, so a huge one stays
    huge until it is checked."""
    sc = batch.sample_columns
    n = len(sc.process)
    gpu = np.array(sc.gpu, dtype=np.int64) if len(sc.gpu) else np.zeros(n, dtype=np.int64)
    return (
        np.array(sc.process, dtype=np.int64),
        np.array(sc.stack, dtype=np.int64),
        np.array(sc.count, dtype=np.uint64),
        gpu,
    )


def _offcpu_columns(batch: pb.Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(process, stack, blocked ns, gpu) columns of the off-CPU section (lengths checked)."""
    oc = batch.offcpu_columns
    n = len(oc.process)
    gpu = np.array(oc.gpu, dtype=np.int64) if len(oc.gpu) else np.zeros(n, dtype=np.int64)
    return (
        np.array(oc.process, dtype=np.int64),
        np.array(oc.stack, dtype=np.int64),
        np.array(oc.blocked_ns, dtype=np.uint64),
        gpu,
    )


def decode_batch(batch: pb.Batch) -> ProfileRows:
    """Rows for the store, without caches. Raises BatchError for a batch that cannot be decoded."""
    return Decoder().decode(batch)


def decode_payload(payload: bytes, decoder: Decoder | None = None) -> ProfileRows:
    """Rows of a batch in wire form, as the write-ahead log keeps it (it was validated before logging)."""
    return (decoder or Decoder()).decode(pb.Batch.FromString(payload))
