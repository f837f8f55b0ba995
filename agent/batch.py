"""Encodes one resolved window into the wire Batch: strings, stacks (packed columns) and processes interned
once."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from itertools import zip_longest

import numpy as np

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.model import (
    CgroupIdentity,
    CudaWindow,
    DeviceSample,
    Frame,
    GpuWindow,
    ProcessInfo,
    ResolvedSample,
    Window,
)

# ResolvedSample.gpu_state -> the wire's enum
_GPU_STATES = {"": pb.GPU_STATE_NONE, "idle": pb.GPU_STATE_IDLE, "busy": pb.GPU_STATE_BUSY}


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


def stack_wire_id(functions: Sequence[str], modules: Sequence[str], kernel_start: int) -> int:
    """The stack's content id on the wire (Batch.stack_ids): a 64-bit hash of its frames' digests, never 0.
    The collector caches decoded stacks under it, so equal ids must mean equal stacks. Hashed frame by
    frame: the encoder keeps each frame's digest for the batch, and a new stack then hashes 8 bytes a
    frame, not its frames' names again (C++ names run to hundreds of characters, stacks to dozens)."""
    digests = [frame_digest(f, m) for f, m in zip_longest(functions, modules, fillvalue="")]
    return _stack_wire_id(digests, len(functions), len(modules), kernel_start)


def frame_digest(function: str, module: str) -> bytes:
    """A frame's content id on the wire (FrameColumns.ids), 8 bytes."""
    return hashlib.blake2b(f"{function}\0{module}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _stack_wire_id(digests: Sequence[bytes], functions: int, modules: int, kernel_start: int) -> int:
    return _hash64(b"".join(digests) + struct.pack("<III", functions, modules, kernel_start))


def process_wire_id(
    pid: int, start_ticks: int, comm: str, exe: str, labels: Sequence[tuple[str, str]]
) -> int:
    """The process description's content id on the wire (Batch.process_ids), never 0: equal ids must mean
    equal descriptions, the collector caches what it decoded under it."""
    return _wire_id(f"{pid}\1{start_ticks}\1{comm}\1{exe}\1" + "\1".join(f"{k}\0{v}" for k, v in labels))


def _wire_id(text: str) -> int:
    """A 64-bit hash of `text`, never 0."""
    return _hash64(text.encode("utf-8", "surrogatepass"))


def _hash64(data: bytes) -> int:
    """A 64-bit hash of `data`, never 0."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def _index_bytes(count: int) -> int:
    """The width of a packed column of indexes into a table of `count` entries: 2 bytes while they fit."""
    return 2 if count <= 1 << 16 else 4


def pack_stacks(
    functions: Sequence[int],
    modules: Sequence[int],
    frames: Sequence[int],
    lengths: Sequence[int],
    kernel_starts: Sequence[int],
    frame_ids: bytes = b"",
) -> tuple[pb.FrameColumns, pb.StackColumns]:
    """The wire's packed stack columns (Batch.frame_columns, Batch.stack_columns): a frame table of
    (function, module) string ids with their 8-byte content ids (`frame_ids`, joined; or none), and every
    stack's `lengths[i]` frames as indexes into it, root first, stack after stack; `kernel_starts` as
    Stack.kernel_start."""
    fwidth = _index_bytes(max(max(functions, default=0), max(modules, default=0)) + 1)  # string ids
    swidth = _index_bytes(len(functions))
    return (
        pb.FrameColumns(
            index_bytes=fwidth,
            functions=np.asarray(functions, dtype=f"<u{fwidth}").tobytes(),
            modules=np.asarray(modules, dtype=f"<u{fwidth}").tobytes(),
            ids=frame_ids,
        ),
        pb.StackColumns(
            index_bytes=swidth,
            frames=np.asarray(frames, dtype=f"<u{swidth}").tobytes(),
            lengths=np.asarray(lengths, dtype="<u2").tobytes(),
            kernel_starts=np.asarray(kernel_starts, dtype="<u2").tobytes(),
        ),
    )


def encode_window(window: Window, identity: pb.AgentIdentity) -> pb.Batch:
    """The Batch for `window` (complete: labels, GPU states and polls resolved), without a sequence number
    (the shipper assigns it). A pure function of its arguments."""
    strings = _Strings()
    stacks: dict[tuple, int] = {}
    stack_ids: list[int] = []  # Batch.stack_ids, one per stack, in stack_columns' order
    processes: dict[tuple[int, int], int] = {}
    batch = pb.Batch(
        agent=identity,
        start_unix_ns=window.start_ns,
        end_unix_ns=window.end_ns,
        frequency_hz=window.frequency_hz,
    )

    def process_index(p: ProcessInfo) -> int:
        pkey = (p.pid, p.start_ticks)
        pidx = processes.get(pkey)
        if pidx is None:
            pidx = processes[pkey] = len(batch.processes)
            labels = window.labels_of(p)
            wire_id = process_wire_id(p.pid, p.start_ticks, p.comm, p.exe, labels)
            batch.processes.append(
                pb.Process(
                    pid=p.pid,
                    start_time_ticks=p.start_ticks,
                    comm=strings.id(p.comm),
                    exe=strings.id(p.exe),
                    labels=[pb.Label(name=strings.id(k), value=strings.id(v)) for k, v in labels],
                )
            )
            batch.process_ids.append(wire_id)
        return pidx

    # Per frame object (the resolver shares one per frame): its (function, module) string ids and its wire
    # digest. Looked up by id(), a C-level hash, in one map() per stack: Frame's own __hash__ is a Python
    # call, and a new stack has ~30 frames. An id is unique only while its object lives: `kept` holds every
    # stack's frames for the batch (the window holds most; the kernel-only stacks of _encode_cuda are
    # made on the spot).
    frame_ids: dict[int, tuple[int, bytes]] = {}  # id(frame) -> (index in the frame table, digest)
    kept: list[tuple[Frame, ...]] = []
    # The packed columns (pack_stacks): the frame table, one entry per distinct (function, module), and
    # each stack's frames as indexes into it.
    frame_index: dict[tuple[int, int], int] = {}
    table_functions: list[int] = []
    table_modules: list[int] = []
    table_ids: list[bytes] = []  # each entry's digest: the frame's content id on the wire
    stack_frames: list[int] = []
    lengths: list[int] = []
    kernel_starts: list[int] = []

    def frame_entry(f: Frame) -> tuple[int, bytes]:
        pair = (strings.id(f.function), strings.id(f.module))
        at = frame_index.get(pair)
        if at is None:  # the digest is of the names alone: frames of one pair share their entry's
            at = frame_index[pair] = len(table_functions)
            table_functions.append(pair[0])
            table_modules.append(pair[1])
            table_ids.append(frame_digest(f.function, f.module))
        entry = frame_ids[id(f)] = (at, table_ids[at])
        return entry

    def stack_index(key: tuple, frames: tuple[Frame, ...], kernel_start: int) -> int:
        # One hash of the key a row (a tuple's hash is not kept, and each frame's is a Python call).
        sidx = stacks.setdefault(key, len(stacks))
        if sidx == len(lengths):
            kept.append(frames)
            got = list(map(frame_ids.get, map(id, frames)))
            if None in got:
                for i, f in enumerate(frames):
                    if got[i] is None:
                        got[i] = frame_entry(f)
            if got:
                at, digests = zip(*got, strict=True)
                stack_frames.extend(at)
            else:
                digests = ()
            lengths.append(len(frames))
            kernel_starts.append(kernel_start)
            stack_ids.append(_stack_wire_id(digests, len(frames), len(frames), kernel_start))
        return sidx

    def rows(samples: list[ResolvedSample]) -> dict[tuple[int, int, int, bool], int]:
        """(process, stack, GPU state, idle) -> count, threads summed (idle threads' apart)."""
        counts: dict[tuple[int, int, int, bool], int] = {}
        for s in samples:
            pidx = process_index(s.process)
            sidx = stack_index((s.frames, s.kernel_start), s.frames, s.kernel_start)
            # Two threads, two raw stacks or two time slots of a process on a GPU can come to the same row.
            state = _GPU_STATES[s.gpu_state]
            ckey = (pidx, sidx, state, s.idle)
            counts[ckey] = counts.get(ckey, 0) + s.count
        return counts

    counts = rows(window.samples)
    if counts:
        cols = batch.sample_columns
        pcol, scol, gcol, _ = zip(*counts, strict=True)  # samples are never idle
        cols.process.extend(pcol)
        cols.stack.extend(scol)
        cols.count.extend(counts.values())
        if any(gcol):
            cols.gpu.extend(gcol)
    blocked = rows(window.offcpu)
    if blocked:
        oc = batch.offcpu_columns
        pcol, scol, gcol, idle = zip(*blocked, strict=True)
        oc.process.extend(pcol)
        oc.stack.extend(scol)
        oc.blocked_ns.extend(blocked.values())
        if any(gcol):
            oc.gpu.extend(gcol)
        if any(idle):
            oc.idle.extend(idle)
    if window.cuda is not None and not window.cuda.empty:
        _encode_cuda(batch, window.cuda, strings, process_index, stack_index)
        launches = rows(window.cuda.launches)
        if launches:
            lc = batch.cuda_launch_columns
            pcol, scol, gcol, _ = zip(*launches, strict=True)
            lc.process.extend(pcol)
            lc.stack.extend(scol)
            lc.count.extend(launches.values())
            if any(gcol):
                lc.gpu.extend(gcol)
    batch.stack_ids.extend(stack_ids)
    if lengths:
        fc, sc = pack_stacks(
            table_functions, table_modules, stack_frames, lengths, kernel_starts, b"".join(table_ids)
        )
        batch.frame_columns.CopyFrom(fc)
        batch.stack_columns.CopyFrom(sc)
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
    if window.gpu is not None:
        _encode_gpu(batch, window.gpu, strings, process_index)
    batch.syscall_latency_duty = window.syscall_duty
    batch.syscall_tracer.table_full = window.syscall_counters.get("table_full", 0)
    batch.syscall_tracer.stale_starts = window.syscall_counters.get("stale_start", 0)
    batch.strings.extend(strings.table)
    st = window.stats
    offcpu = window.offcpu_settings
    if offcpu is not None:
        batch.offcpu_stats.CopyFrom(
            pb.OffCpuStats(
                switches=st.get("offcpu_switches", 0),
                sampled=st.get("offcpu_sampled", 0),
                recorded=st.get("offcpu_recorded", 0),
                below_min=st.get("offcpu_below_min", 0),
                state_full=st.get("offcpu_state_table_full", 0),
                sample_every=offcpu.sample_every,
                min_block_ns=offcpu.min_block_ns,
            )
        )
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


# Kernel frames of kernels whose launching stack is unknown (no launch uprobes): the proto's "stack of one
# frame, the kernel itself", its module unknown.
CUDA_MODULE = "[cuda]"


def _encode_cuda(batch: pb.Batch, cuda: CudaWindow, strings: _Strings, process_index, stack_index) -> None:
    kc = batch.cuda_kernel_columns
    for pc in cuda.processes:
        pidx = process_index(pc.process)
        placed = set()
        for frames, ns in pc.kernel_stacks:  # under the stacks that launched them (agent/resolver.py)
            placed.add(frames[-1].function)
            kc.process.append(pidx)
            kc.stack.append(stack_index(("cuda_kernel_stack", frames), frames, len(frames)))
            kc.kernel_ns.append(ns)
        for name, ns in sorted(pc.kernel_ns.items()):
            if name in placed:
                continue
            kc.process.append(pidx)
            kc.stack.append(stack_index(("cuda_kernel", name), (Frame(name, CUDA_MODULE),), 1))
            kc.kernel_ns.append(ns)
        for d in pc.devices:
            batch.cuda_activity.append(
                pb.CudaActivity(
                    process=pidx,
                    device=d.device,
                    known_ns=d.known_ns,
                    idle_ns=d.idle_ns,
                    gaps=d.gaps.count,
                    gap_histogram=list(d.gaps.histogram) if d.gaps.count else [],
                    longest_gap_ns=d.gaps.longest_ns,
                    records_lost=d.records_lost,
                )
            )
    for proc, call in cuda.calls:
        batch.cuda_calls.append(
            pb.CudaCallStats(
                process=process_index(proc),
                call=strings.id(call.call),
                count=call.count,
                timed=call.count,
                timed_ns=call.ns,
                latency_log2_ns=_trimmed(call.hist),
            )
        )
    batch.cuda_stats.kernels = cuda.kernels
    batch.cuda_stats.kernels_attributed = cuda.kernels_attributed
    if cuda.launch_sample_every:
        st = batch.cuda_stats
        st.launch_sample_every = cuda.launch_sample_every
        st.launches = cuda.launches_seen
        st.launches_sampled = cuda.launches_sampled
        st.table_full = cuda.table_full


def _encode_gpu(batch: pb.Batch, gpu: GpuWindow, strings: _Strings, process_index) -> None:
    batch.gpu_source.CopyFrom(
        pb.GpuSource(up=gpu.up, state=strings.id(gpu.state), idle_below_percent=gpu.idle_below_percent)
    )
    device_index: dict[str, int] = {}
    for dw in gpu.devices:
        d = dw.device
        owner = dw.owner
        device_index[d.uuid] = len(batch.gpu_devices)
        batch.gpu_devices.append(
            pb.GpuDevice(
                index=d.index,
                uuid=strings.id(d.uuid),
                name=strings.id(d.name),
                mig_mode=d.mig_mode,
                parent_uuid=strings.id(d.parent_uuid),
                gpu_instance_id=d.gpu_instance_id,
                samples=[_gpu_sample(s) for s in dw.samples],
                xid_errors=dw.xid_errors,
                xid_codes=dw.xid_codes,
                xid_watched=dw.xid_watched,
                owner_namespace=strings.id(owner.namespace) if owner else 0,
                owner_pod=strings.id(owner.pod) if owner else 0,
                owner_container=strings.id(owner.container) if owner else 0,
            )
        )
    for pw in gpu.processes:
        dev = device_index.get(pw.uuid)
        if dev is None:
            continue
        # A process that exited before the drain keeps its pid; it is labelled by its device's owner.
        proc = pw.process or ProcessInfo(pw.pid, 0, "", "", CgroupIdentity(""), ())
        sm, mem = pw.sm_util_percent, pw.mem_util_percent
        batch.gpu_processes.append(
            pb.GpuProcessUsage(
                process=process_index(proc),
                device=dev,
                polls=pw.polls,
                state_polls=pw.state_polls,
                idle_polls=pw.idle_polls,
                memory_used_bytes=pw.mem_used_bytes,
                sm_utilization_percent=None if sm is None else round(sm),
                memory_utilization_percent=None if mem is None else round(mem),
            )
        )


def _gpu_sample(s: DeviceSample) -> pb.GpuSample:
    """Unset (None) fields stay absent on the wire: the device does not report them."""
    return pb.GpuSample(
        time_unix_ns=s.time_ns,
        gpu_utilization_percent=s.gpu_util_percent,
        memory_utilization_percent=s.mem_util_percent,
        memory_used_bytes=s.mem_used_bytes,
        memory_total_bytes=s.mem_total_bytes,
        power_milliwatts=s.power_mw,
        energy_millijoules=s.energy_mj,
        temperature_celsius=s.temperature_c,
        sm_clock_mhz=s.sm_clock_mhz,
        clock_event_reasons=s.clock_event_reasons,
        ecc_corrected_errors=s.ecc_corrected,
        ecc_uncorrected_errors=s.ecc_uncorrected,
        pcie_tx_kilobytes_per_second=s.pcie_tx_kbps,
        pcie_rx_kilobytes_per_second=s.pcie_rx_kbps,
        sm_active_percent=s.sm_active_percent,
        sm_occupancy_percent=s.sm_occupancy_percent,
        tensor_active_percent=s.tensor_active_percent,
        dram_bandwidth_percent=s.dram_bandwidth_percent,
    )
