"""Every check a batch must pass before anything of it is stored, each failure a BatchError that names the
batch, the field and the problem (the agent logs it and drops the batch)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.model.profile import GPU_STATE_NAME, MAX_BATCH_AGE_S, PROFILE_TYPE_NAME
from fleetprof.collector.model.selector import LABEL_NAME
from fleetprof.gpu_families import GAP_BUCKETS_NS

MAX_COUNT = 1 << 40  # more samples than a node takes in years: a corrupt or negative count
MAX_SEQUENCE = (1 << 63) - 1  # the database keeps sequences as BIGINT: one above would fail every flush
# ~104 days of latency in one window of one process's calls of one syscall, more than all its threads can
# block in it; sums stay exact in float64 and far from BIGINT's limit in the database.
MAX_TIMED_NS = 1 << 53
MAX_BLOCKED_NS = 1 << 53  # one off-CPU row: ~104 days, past any window (agents clip a block to it)
MAX_FREQUENCY_HZ = 100_000
MAX_STACK_DEPTH = 4096
MAX_LABEL_BYTES = 1024  # a label value
MAX_LABEL_NAME_BYTES = 128
MAX_AGENT_ID_BYTES = 256  # kept in the dedupe state for every batch (agents send 32 hex digits)
# A node name as Kubernetes and hostnames spell them (letters, digits, "-", "." and "_", a letter or digit at
# each end, at most 253): no spaces, control or look-alike characters, so "victim " or a Cyrillic "vіctim"
# is refused rather than listed beside "victim".
NODE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
# Agent ids key the dedupe state and wire-id tables, joined to the peer's identity (ingest/peer.py): no
# separator can be smuggled in.
AGENT_ID = re.compile(r"[A-Za-z0-9._-]+")
# Labels the collector derives itself (from the batch's identity and the process table, or ingest's GPU
# tagging): a process label of the same name would let an agent pass its data off as another node's.
DERIVED_LABELS = frozenset({"node", "pid", "comm", GPU_STATE_NAME, PROFILE_TYPE_NAME})
MAX_GPU_SAMPLES_PER_DEVICE = 100_000
GPU_STATES = (pb.GPU_STATE_NONE, pb.GPU_STATE_IDLE, pb.GPU_STATE_BUSY)
MAX_KERNEL_NS = 1 << 53  # one kernel-time row: ~104 days, as MAX_BLOCKED_NS
# A CUDA API function's name is an exported C symbol; it becomes the `call` label of API answers and
# Prometheus series, so anything else (spaces, control characters, megabytes) is refused, not shown.
CUDA_CALL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_CUDA_DEVICE = 255  # CUDA device ordinals: a node has a few GPUs; the ordinal becomes a label value
MAX_SAMPLE_EVERY = 1 << 20
# GPM percentages: NVML's may read a little over 100 (counter rounding over a short interval) and are
# clamped; past this, or negative or not a number, the reading is corrupt and refused.
MAX_GPM_PERCENT = 200.0
GPM_FIELDS = ("sm_active_percent", "sm_occupancy_percent", "tensor_active_percent", "dram_bandwidth_percent")
MIN_GAP_NS = 1_000  # gaps shorter than 1 µs are busy time (agent/gpu/activity.py)


class BatchError(ValueError):
    """A batch that cannot be ingested; the message names the batch and the problem, `reason` is the
    counted reason (fleetprof_ingest_rejected_batches_total{reason})."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class IngestLimits:
    max_batch_bytes: int = 32 * 1024 * 1024
    max_samples: int = 2_000_000
    max_strings: int = 2_000_000
    # A batch's window must lie between now - max_batch_age_s and now + max_clock_skew_s on the
    # collector's clock: a broken agent clock or a replayed capture would otherwise make buckets that
    # retention never reaches, and dedupe state would have to be kept for ever.
    max_clock_skew_s: float = 300.0
    max_batch_age_s: float = MAX_BATCH_AGE_S
    # The label index (ingest/quota.py). A process may carry this many labels besides node, pid and comm
    # (Pyroscope: max_label_names_per_series 30; the agent sends at most ~10 plus --pod-label ones).
    max_labels_per_process: int = 64
    # Per node, within series_horizon_s: process label sets (series), distinct values per label name,
    # label names, and the bytes of all its distinct values.
    max_series_per_node: int = 20_000
    max_values_per_label: int = 5_000
    max_label_names_per_node: int = 128
    max_label_value_bytes_per_node: int = 8 << 20
    max_series_total: int = 250_000  # every node together
    max_label_value_bytes_total: int = 64 << 20
    series_horizon_s: float = 3600.0


def fail(seq: int, reason: str, problem: str) -> NoReturn:
    raise BatchError(reason, f"batch {seq}: {problem}")


def check_header(batch: pb.Batch, limits: IngestLimits, size: int, now: float | None) -> None:
    """The batch-wide checks; `size` is the batch's wire size, `now` the collector's clock (None: the
    window is not checked against it)."""
    seq = batch.sequence
    if size > limits.max_batch_bytes:
        fail(
            seq, "oversized", f"{size} bytes is over the collector's limit of {limits.max_batch_bytes} bytes"
        )
    if not batch.agent.node:
        fail(seq, "no_node", "agent.node is empty: every batch must name its node")
    if not batch.agent.agent_id:
        fail(seq, "no_agent_id", "agent.agent_id is empty")
    # The node is every sample's `node` label value, so it has a label value's limit.
    if not NODE_NAME.fullmatch(batch.agent.node):
        fail(
            seq,
            "bad_node",
            f"agent.node {batch.agent.node[:80]!r} is not a node name (letters, digits, '-', '.' and '_', "
            "a letter or digit at each end, at most 253 bytes)",
        )
    if (n := len(batch.agent.agent_id.encode())) > MAX_AGENT_ID_BYTES:
        fail(seq, "bad_agent_id", f"agent.agent_id is {n} bytes, over the limit of {MAX_AGENT_ID_BYTES}")
    if not AGENT_ID.fullmatch(batch.agent.agent_id):
        fail(
            seq,
            "bad_agent_id",
            f"agent.agent_id {batch.agent.agent_id[:80]!r} may hold only letters, digits, '-', '.' and '_'",
        )
    if seq == 0:
        fail(seq, "no_sequence", "sequence must start at 1")
    if seq > MAX_SEQUENCE:
        fail(seq, "bad_sequence", f"sequence is over the limit of {MAX_SEQUENCE}")
    if batch.end_unix_ns < batch.start_unix_ns:
        fail(
            seq,
            "bad_window",
            f"end_unix_ns {batch.end_unix_ns} is before start_unix_ns {batch.start_unix_ns}",
        )
    if now is not None:
        _check_window(batch, limits, now)
    if not 0 < batch.frequency_hz <= MAX_FREQUENCY_HZ:
        fail(seq, "bad_frequency", f"frequency_hz {batch.frequency_hz} is not in 1..{MAX_FREQUENCY_HZ}")
    nstr = len(batch.strings)
    if nstr > limits.max_strings:
        fail(seq, "oversized", f"{nstr} strings is over the limit of {limits.max_strings}")
    nsamples = len(batch.sample_columns.process)
    if nsamples > limits.max_samples:
        fail(seq, "oversized", f"{nsamples} sample rows is over the limit of {limits.max_samples}")
    for what, n in (
        ("off-CPU rows", len(batch.offcpu_columns.process)),
        ("CUDA launch rows", len(batch.cuda_launch_columns.process)),
        ("GPU kernel rows", len(batch.cuda_kernel_columns.process)),
    ):
        if n > limits.max_samples:
            fail(seq, "oversized", f"{n} {what} is over the limit of {limits.max_samples}")


def _check_window(batch: pb.Batch, limits: IngestLimits, now: float) -> None:
    seq = batch.sequence
    ahead = batch.end_unix_ns / 1e9 - now
    if ahead > limits.max_clock_skew_s:
        fail(
            seq,
            "clock_skew",
            f"its window ends {ahead:.0f} s after the collector's clock "
            f"(at most {limits.max_clock_skew_s:.0f} s allowed): check the node's clock",
        )
    age = now - batch.start_unix_ns / 1e9
    if age > limits.max_batch_age_s:
        fail(
            seq,
            "stale",
            f"its window started {age:.0f} s before the collector's clock "
            f"(at most {limits.max_batch_age_s:.0f} s allowed): check the node's clock",
        )


def check_string_table(batch: pb.Batch) -> None:
    if batch.strings and batch.strings[0] != "":
        fail(batch.sequence, "bad_string_table", "strings[0] must be the empty string")


def check_wire_ids(batch: pb.Batch, nstack: int) -> None:
    """One content id per stack (`nstack` of them, in either form) and per process (the collector's caches
    are keyed by them)."""
    seq = batch.sequence
    if len(batch.stack_ids) != nstack:
        fail(seq, "bad_stack", f"{len(batch.stack_ids)} stack_ids for {nstack} stacks")
    if len(batch.process_ids) != len(batch.processes):
        fail(seq, "bad_process", f"{len(batch.process_ids)} process_ids for {len(batch.processes)} processes")


def check_string(seq: int, i: int, nstr: int, where: str) -> None:
    if i >= nstr:
        fail(seq, "bad_string_id", f"{where} refers to string {i}, but the string table has {nstr} entries")


def check_stack_shape(seq: int, si: int, st: pb.Stack) -> None:
    """What indexing the string table does not check (that is check_stack_strings)."""
    if len(st.modules) and len(st.modules) != len(st.functions):
        fail(seq, "bad_stack", f"stack {si} has {len(st.functions)} functions but {len(st.modules)} modules")
    check_stack_size(seq, si, len(st.functions), st.kernel_start)


def check_stack_size(seq: int, si: int, frames: int, kernel_start: int) -> None:
    """A stack's depth and kernel_start, in either form of stacks."""
    if frames > MAX_STACK_DEPTH:
        fail(seq, "bad_stack", f"stack {si} is {frames} frames deep (limit {MAX_STACK_DEPTH})")
    if kernel_start > frames:
        fail(seq, "bad_stack", f"stack {si} kernel_start {kernel_start} is past its {frames} frames")


def check_stack_strings(seq: int, si: int, st: pb.Stack, nstr: int) -> NoReturn:
    """Name the string id of a stack that is out of the table (called once one is known to be)."""
    for f in st.functions:
        check_string(seq, f, nstr, f"stack {si}")
    for m in st.modules:
        check_string(seq, m, nstr, f"stack {si} module")
    raise AssertionError("called for a stack whose strings are all in the table")


def check_process(seq: int, pi: int, p: pb.Process, nstr: int, limits: IngestLimits | None) -> None:
    """The string ids and the label count of a process new to the collector (check_label: each label);
    without `limits` (a batch accepted before, replayed from the log), the string ids only."""
    check_string(seq, p.comm, nstr, f"process {pi} comm")
    check_string(seq, p.exe, nstr, f"process {pi} exe")
    if limits is not None and len(p.labels) > limits.max_labels_per_process:
        fail(
            seq,
            "too_many_labels",
            f"process {pi} has {len(p.labels)} labels, over the limit of {limits.max_labels_per_process}",
        )
    for lb in p.labels:
        check_string(seq, lb.name, nstr, f"process {pi} label name")
        check_string(seq, lb.value, nstr, f"process {pi} label value")
        if lb.name == 0:
            fail(seq, "bad_label", f"process {pi} has a label with an empty name")


def check_comm(seq: int, pi: int, comm: str) -> None:
    """The `comm` label value: the kernel's are at most 15 bytes; capped as any label value."""
    if (n := len(comm.encode())) > MAX_LABEL_BYTES:
        fail(seq, "bad_process", f"process {pi} comm is {n} bytes, over a label value's {MAX_LABEL_BYTES}")


def check_label(seq: int, pi: int, name: str, value: str) -> None:
    """A process label: a Prometheus label name the collector does not derive itself, both length-capped."""
    if not LABEL_NAME.fullmatch(name) or len(name.encode()) > MAX_LABEL_NAME_BYTES:
        fail(
            seq,
            "bad_label",
            f"process {pi} label name {name[:80]!r} is not a label name ([a-zA-Z_][a-zA-Z0-9_]*, at most "
            f"{MAX_LABEL_NAME_BYTES} bytes)",
        )
    if name in DERIVED_LABELS or name.startswith("__"):
        fail(seq, "bad_label", f"process {pi} label {name!r} is one the collector sets itself")
    if len(value.encode()) > MAX_LABEL_BYTES:
        fail(seq, "bad_label", f"process {pi} label {name!r} value is over {MAX_LABEL_BYTES} bytes")


def check_syscalls(batch: pb.Batch, nproc: int, nstr: int) -> None:
    seq = batch.sequence
    for i, sc in enumerate(batch.syscalls):
        if sc.process >= nproc:
            fail(seq, "bad_syscall", f"syscall row {i} refers to process {sc.process}, but there are {nproc}")
        check_string(seq, sc.syscall, nstr, f"syscall row {i}")
        if sc.syscall == 0:
            fail(seq, "bad_syscall", f"syscall row {i} has no syscall name")
        # `timed` may exceed `count` in one window: a call that blocked across a drain is counted in the
        # window it entered in and timed in the one it returned in (agent/syscalls.py). Refusing that
        # dropped whole batches, CPU samples included, whenever a lone call blocked past a window.
        _check_timed_row(seq, sc, "bad_syscall", f"syscall row {i}")


def check_gpu_section(batch: pb.Batch) -> None:
    """The GPU section's references and invariants."""
    seq = batch.sequence
    nstr, nproc, ndev = len(batch.strings), len(batch.processes), len(batch.gpu_devices)
    if batch.gpu_source.state >= max(nstr, 1):
        fail(
            seq,
            "bad_gpu",
            f"gpu_source.state refers to string {batch.gpu_source.state}, but there are {nstr}",
        )
    for i, d in enumerate(batch.gpu_devices):
        for name in ("uuid", "name", "parent_uuid", "owner_namespace", "owner_pod", "owner_container"):
            if getattr(d, name) >= nstr:
                fail(
                    seq,
                    "bad_gpu",
                    f"gpu device {i} {name} refers to string {getattr(d, name)}, but there are {nstr}",
                )
        if d.uuid == 0:
            fail(seq, "bad_gpu", f"gpu device {i} has no uuid")
        if len(d.samples) > MAX_GPU_SAMPLES_PER_DEVICE:
            fail(
                seq,
                "bad_gpu",
                f"gpu device {i} has {len(d.samples)} samples (limit {MAX_GPU_SAMPLES_PER_DEVICE})",
            )
        for j, sample in enumerate(d.samples):
            for name in GPM_FIELDS:
                if sample.HasField(name):
                    v = getattr(sample, name)
                    if not (math.isfinite(v) and 0.0 <= v <= MAX_GPM_PERCENT):
                        fail(
                            seq,
                            "bad_gpu",
                            f"gpu device {i} sample {j} {name} is {v}: a GPM percentage must be in "
                            f"0..{MAX_GPM_PERCENT:g}",
                        )
    for i, u in enumerate(batch.gpu_processes):
        if u.process >= nproc:
            fail(seq, "bad_gpu", f"gpu process row {i} refers to process {u.process}, but there are {nproc}")
        # Its labels name its pod: read here even when the process is known by wire id and not decoded.
        for lb in batch.processes[u.process].labels:
            check_string(
                seq, max(lb.name, lb.value), nstr, f"gpu process row {i}'s process {u.process} label"
            )
        if u.device >= ndev:
            fail(seq, "bad_gpu", f"gpu process row {i} refers to gpu device {u.device}, but there are {ndev}")
        if not u.idle_polls <= u.state_polls <= u.polls:
            fail(
                seq,
                "bad_gpu",
                f"gpu process row {i}: idle_polls {u.idle_polls} <= state_polls {u.state_polls} <= "
                f"polls {u.polls} does not hold",
            )


def check_sample_column_lengths(batch: pb.Batch) -> None:
    sc = batch.sample_columns
    n = len(sc.process)
    if len(sc.stack) != n or len(sc.count) != n or len(sc.gpu) not in (0, n):
        fail(
            batch.sequence,
            "bad_sample",
            f"sample_columns have {n} processes, {len(sc.stack)} stacks, {len(sc.count)} counts and "
            f"{len(sc.gpu)} GPU states: process, stack and count need one per row, gpu one per row or none",
        )
    oc = batch.offcpu_columns
    n = len(oc.process)
    optional = (len(oc.gpu), len(oc.idle))  # each one per row, or left out
    if len(oc.stack) != n or len(oc.blocked_ns) != n or any(k not in (0, n) for k in optional):
        fail(
            batch.sequence,
            "bad_offcpu",
            f"offcpu_columns have {n} processes, {len(oc.stack)} stacks, {len(oc.blocked_ns)} blocked_ns, "
            f"{len(oc.gpu)} GPU states and {len(oc.idle)} idle flags: process, stack and blocked_ns need one "
            "per row, gpu and idle one per row or none",
        )
    lc = batch.cuda_launch_columns
    n = len(lc.process)
    if len(lc.stack) != n or len(lc.count) != n or len(lc.gpu) not in (0, n):
        fail(
            batch.sequence,
            "bad_cuda_launch",
            f"cuda_launch_columns have {n} processes, {len(lc.stack)} stacks, {len(lc.count)} counts and "
            f"{len(lc.gpu)} GPU states: process, stack and count need one per row, gpu one per row or none",
        )
    kc = batch.cuda_kernel_columns
    n = len(kc.process)
    if len(kc.stack) != n or len(kc.kernel_ns) != n:
        fail(
            batch.sequence,
            "bad_gpu_kernel",
            f"cuda_kernel_columns have {n} processes, {len(kc.stack)} stacks and {len(kc.kernel_ns)} "
            "kernel_ns: each needs one per row",
        )


# What each column block's rows are called in refusals, their reason, their value's name and its bound.
SAMPLES = ("sample", "bad_sample", "count", MAX_COUNT)
OFFCPU = ("off-CPU row", "bad_offcpu", "blocked_ns", MAX_BLOCKED_NS)
CUDA_LAUNCHES = ("CUDA launch row", "bad_cuda_launch", "count", MAX_COUNT)
GPU_KERNELS = ("GPU kernel row", "bad_gpu_kernel", "kernel_ns", MAX_KERNEL_NS)


def check_sample_columns(
    seq: int,
    columns: Sequence[np.ndarray],
    nproc: int,
    nstack: int,
    offcpu: bool = False,
    kind: tuple[str, str, str, int] | None = None,
) -> None:
    """(process, stack, count, gpu) columns: every reference in range, every count and state valid. `kind`
    says which block they are (SAMPLES, OFFCPU, CUDA_LAUNCHES, GPU_KERNELS); `offcpu` is OFFCPU."""
    row, reason, value, limit = kind or (OFFCPU if offcpu else SAMPLES)
    pcol, kcol, ccol, gcol = columns
    if not len(ccol):
        return
    if (
        pcol.max() < nproc
        and kcol.max() < nstack
        and ccol.min() > 0
        and ccol.max() <= limit
        and gcol.min() >= 0
        and gcol.max() <= max(GPU_STATES)
    ):
        return
    bad = (pcol >= nproc) | (kcol >= nstack) | (ccol == 0) | (ccol > limit)
    bad |= (gcol < 0) | (gcol > max(GPU_STATES))
    i = int(np.flatnonzero(bad)[0])
    p, k, c, g = int(pcol[i]), int(kcol[i]), int(ccol[i]), int(gcol[i])
    if p >= nproc:
        fail(seq, reason, f"{row} {i} refers to process {p}, but there are {nproc}")
    if k >= nstack:
        fail(seq, reason, f"{row} {i} refers to stack {k}, but there are {nstack}")
    if c == 0 or c > limit:
        if value == "count" and row == "sample":
            fail(seq, "bad_count", f"{row} {i} has count {c}: counts must be in 1..{limit}")
        fail(seq, "bad_count", f"{row} {i} has {value} {c}: it must be in 1..{limit}")
    fail(seq, reason, f"{row} {i} has an unknown GPU state {g}")


def _check_timed_row(seq: int, row: pb.SyscallStats | pb.CudaCallStats, reason: str, what: str) -> None:
    """A syscall or CUDA call row's counts, timed nanoseconds and latency histogram: bounded, and the
    histogram adds up to the calls timed."""
    if row.count > MAX_COUNT or row.timed > MAX_COUNT:
        fail(seq, reason, f"{what}: count {row.count} or timed {row.timed} is over {MAX_COUNT}")
    if row.timed_ns > MAX_TIMED_NS:
        fail(seq, reason, f"{what}: timed_ns {row.timed_ns} is over the limit of {MAX_TIMED_NS}")
    if len(row.latency_log2_ns) > 64 or sum(row.latency_log2_ns) != row.timed:
        fail(
            seq,
            reason,
            f"{what}: the latency histogram ({sum(row.latency_log2_ns)} calls in "
            f"{len(row.latency_log2_ns)} buckets) does not add up to timed {row.timed}",
        )


def check_cuda_calls(batch: pb.Batch, nproc: int, nstr: int) -> None:
    """CUDA API call rows, as syscall rows, their names C identifiers."""
    seq = batch.sequence
    for i, c in enumerate(batch.cuda_calls):
        if c.process >= nproc:
            fail(
                seq,
                "bad_cuda_call",
                f"CUDA call row {i} refers to process {c.process}, but there are {nproc}",
            )
        check_string(seq, c.call, nstr, f"CUDA call row {i}")
        name = batch.strings[c.call]
        if not CUDA_CALL_NAME.fullmatch(name):
            fail(
                seq,
                "bad_cuda_call",
                f"CUDA call row {i} names the call {name[:80]!r}: a CUDA function's name is a C identifier "
                "of at most 128 bytes",
            )
        _check_timed_row(seq, c, "bad_cuda_call", f"CUDA call row {i}")


def check_cuda_activity(batch: pb.Batch, nproc: int, nstr: int) -> None:
    """GPU activity rows: references in range, one row per (process, device), times within the window,
    gap counts that a window can hold and a histogram of the proto's fixed buckets that adds up."""
    seq = batch.sequence
    window = batch.end_unix_ns - batch.start_unix_ns
    buckets = len(GAP_BUCKETS_NS) + 1
    seen: dict[tuple[int, int], int] = {}
    for i, a in enumerate(batch.cuda_activity):
        where = f"GPU activity row {i}"
        if a.process >= nproc:
            fail(seq, "bad_cuda_activity", f"{where} refers to process {a.process}, but there are {nproc}")
        check_string(seq, a.uuid, nstr, f"{where} uuid")
        if a.device > MAX_CUDA_DEVICE:
            fail(
                seq, "bad_cuda_activity", f"{where}: device {a.device} is over the limit of {MAX_CUDA_DEVICE}"
            )
        if (first := seen.setdefault((a.process, a.device), i)) != i:
            fail(
                seq,
                "bad_cuda_activity",
                f"{where} repeats process {a.process} on device {a.device} (row {first}): one row each",
            )
        if not a.idle_ns <= a.known_ns <= window:
            fail(
                seq,
                "bad_cuda_activity",
                f"{where}: idle_ns {a.idle_ns} <= known_ns {a.known_ns} <= the window's {window} ns "
                "does not hold",
            )
        # Gaps are at least MIN_GAP_NS long and each ends in this window, so their ends lie that far apart.
        most = window // MIN_GAP_NS + 1
        if a.gaps > most:
            fail(
                seq,
                "bad_cuda_activity",
                f"{where}: {a.gaps} gaps cannot end in a {window} ns window (at most {most})",
            )
        hist = a.gap_histogram
        if (len(hist) != buckets and not (len(hist) == 0 and a.gaps == 0)) or sum(hist) != a.gaps:
            fail(
                seq,
                "bad_cuda_activity",
                f"{where}: the gap histogram ({sum(hist)} gaps in {len(hist)} buckets) does not add up to "
                f"gaps {a.gaps} in the {buckets} buckets the proto fixes",
            )
        if a.longest_gap_ns > MAX_KERNEL_NS or a.records_lost > MAX_COUNT:
            fail(
                seq,
                "bad_cuda_activity",
                f"{where}: longest_gap_ns {a.longest_gap_ns} or records_lost {a.records_lost} is out of "
                "range",
            )


def check_cuda_stats(batch: pb.Batch) -> None:
    st = batch.cuda_stats
    seq = batch.sequence
    if st.launch_sample_every > MAX_SAMPLE_EVERY:
        fail(
            seq,
            "bad_cuda_stats",
            f"cuda_stats.launch_sample_every {st.launch_sample_every} is over the limit of "
            f"{MAX_SAMPLE_EVERY}",
        )
    if st.launches_sampled > st.launches or st.kernels_attributed > st.kernels:
        fail(
            seq,
            "bad_cuda_stats",
            f"cuda_stats: launches_sampled {st.launches_sampled} <= launches {st.launches} and "
            f"kernels_attributed {st.kernels_attributed} <= kernels {st.kernels} do not both hold",
        )


# The one frame of a logged stack that does not decode on replay (stand_in_undecodable).
UNREPLAYABLE_STACK = "[not replayable: frames sent again under a known stack id did not decode]"
# What a stand-in's wire id is xor'ed with: the replay's cache must not learn the stand-in under the id
# the agent's later batches send their real content under.
_STAND_IN_ID = 0x5354414E442D494E


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except BatchError:
        return False
    return True


def stand_in_undecodable(batch: pb.Batch) -> tuple[int, int]:
    """Make a batch from the write-ahead log decodable on an empty cache, keeping every sample: each stack
    that fails its checks becomes the one frame UNREPLAYABLE_STACK; each process's comm, exe and labels
    that fail theirs are emptied or dropped. Only a batch that reused a wire id the collector knew, with
    other content, needs it: ingest found those stacks and processes by id and decoded nothing of them.
    Its stacks are Stack messages (the decoder rewrites packed ones first: stacks.to_messages). Returns how
    many stacks and processes it changed."""
    seq, strings = batch.sequence, batch.strings
    nstr = len(strings)
    stand_in = None
    stacks = 0
    for si, st in enumerate(batch.stacks):
        if _passes(check_stack_shape, seq, si, st) and max((*st.functions, *st.modules), default=0) < nstr:
            continue
        if stand_in is None:
            stand_in = len(strings)
            strings.append(UNREPLAYABLE_STACK)
        st.Clear()
        st.functions.append(stand_in)
        st.kernel_start = 1
        if si < len(batch.stack_ids):
            batch.stack_ids[si] ^= _STAND_IN_ID
        stacks += 1
    processes = 0
    for pi, p in enumerate(batch.processes):
        labels = [
            (lb.name, lb.value)
            for lb in p.labels
            if 0 < lb.name < nstr
            and lb.value < nstr
            and _passes(check_label, seq, pi, strings[lb.name], strings[lb.value])
        ]
        comm_ok = p.comm < nstr and _passes(check_comm, seq, pi, strings[p.comm])
        if comm_ok and p.exe < nstr and len(labels) == len(p.labels):
            continue
        p.comm = p.comm if comm_ok else 0
        p.exe = p.exe if p.exe < nstr else 0
        del p.labels[:]
        for name, value in labels:
            p.labels.add(name=name, value=value)
        if pi < len(batch.process_ids):
            batch.process_ids[pi] ^= _STAND_IN_ID
        processes += 1
    return stacks, processes
