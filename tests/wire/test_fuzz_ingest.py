"""Structured fuzzing of ingest against a real collector process over real gRPC.

Every batch starts as a real one (tests/support/wire.py builders, an agent's encode_window with several
processes, kernel frames and syscalls, a GPU batch from the real poller) and is mutated field by field (string
ids out of the table, huge and zero counts, stacks past the depth limit, duplicate wire ids, columns out of
step, empty and oversized strings, bad labels, far-off windows, sequence 0, ...) and then, for some, byte by
byte (truncation, bit flips, random bytes). Half are sent after the same agent's unmutated batch, so the
collector knows its stacks and processes by wire id and skips checking them. Each goes on its own Push
stream, and each must end one of two ways: acknowledged, and then read back through the HTTP API with
exactly the samples and syscall calls it carried (and, where its own stacks are what is stored, exactly its
stacks: the JSON tree, and the folded text as the writer escapes it); or refused with INVALID_ARGUMENT whose
message names the batch (and, for a single mutation, the thing mutated). Any other status is a bug. Through
the run the collector keeps answering /healthz, logs no traceback, and its RSS (VmRSS, sampled) stays under
RSS_BOUND_MB. With --data-dir, a kill -9 and a restart then replay and commit every acknowledged batch.

The suite runs a CI-sized, derandomized corpus. The big run (random seeds; `-s` prints what it found: batches
pushed, acknowledged, read back, refused by reason, RSS), ~6 min on 2 cores:

    FLEETPROF_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest tests/wire/test_fuzz_ingest.py -s

(10,000 plans in memory, 1,000 with --data-dir); `--hypothesis-seed=N` replays one.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.attribution import Attributor
from fleetprof.agent.batch import encode_window, stack_wire_id
from fleetprof.agent.kube.pods import PodMeta
from fleetprof.agent.model import CgroupIdentity, Frame, ProcessInfo, ResolvedSample, SyscallStat, Window
from fleetprof.agent.resolver import window_processes
from fleetprof.collector.ingest.validate import MAX_COUNT, MAX_STACK_DEPTH
from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.model.selector import quote
from fleetprof.collector.render.tree import KERNEL_SUFFIX, UNKNOWN_FRAME, folded_frame, parse_folded
from tests.conftest import REPO, free_port, wait_until
from tests.support.gpu_batches import gpu_batch
from tests.support.wire import BatchBuilder, hist, make_batch, pack, stacks_of, unpack, with_syscalls

BIG_RUN = int(os.environ.get("FLEETPROF_FUZZ_EXAMPLES", "0"))
# The suite's size: ~25 s on a 2-core CI machine (with tests/collector/test_fuzz_query.py, ~40 s),
# deterministic.
SUITE_MEMORY_EXAMPLES = 200
SUITE_DURABLE_EXAMPLES = 60
# The collector's RSS (VmRSS of the subprocess, sampled every 0.1 s), measured on the 2-core machine: in
# memory ~56 MiB idle, ~70 MiB after the suite's corpus, 162-169 MiB peak through 10,000 plans (~15,000
# batches); with --data-dir (DuckDB) ~125 MiB after the suite's, 136 MiB through 1,000 plans. Most of the
# growth is ingest's frame table keeping every string of every batch's table (the fuzzed 4 KiB-1 MiB
# strings too), which only a count bounds (collector/ingest/frames.py, MAX_STRINGS). 400 MiB is ~2.4x the
# peak: room for allocator slack and a faster machine's bigger bursts, while that growth, or a leak of what
# batches carry, passes it within a few tens of thousands of batches.
RSS_BOUND_MB = 400
RETENTION_S = 3600.0  # the in-memory store's default: older windows may be expired as they arrive
PUSH_TIMEOUT_S = 30.0  # a push or a query that takes longer is a hang, and a failure
INGEST = "/fleetprof.v1.Ingest/Push"


# --- seeds: real batches --------------------------------------------------------------------------------


class _Pods:
    """The pod metadata an agent's cache would hold for the one pod of the agent-shaped seed."""

    UID = "6f9b1c2e-2222-4c1e-9d1a-bbbbbbbbbbbb"
    CID = "d" * 64

    def lookup(self, uid: str) -> PodMeta | None:
        if uid != self.UID:
            return None
        return PodMeta(
            uid=uid,
            namespace="prod",
            name="api-7f9c-x2",
            node="fuzz-node",
            workload_kind="Deployment",
            workload="api",
            containers={self.CID: "server"},
            labels={"team": "payments"},
            phase="Running",
        )


def agent_batch() -> pb.Batch:
    """A window as the agent encodes it: a pod's Python server, a host daemon and a kernel thread, user and
    kernel frames, unsymbolized frames, syscalls with latency histograms, off-CPU time, sampler stats."""
    pod = CgroupIdentity(
        f"/kubepods/burstable/pod{_Pods.UID}/{_Pods.CID}", _Pods.CID, "containerd", _Pods.UID
    )
    server = ProcessInfo(4242, 91_000, "python3", "/usr/bin/python3.11", pod, ())
    daemon = ProcessInfo(812, 1_200, "containerd", "/usr/bin/containerd", CgroupIdentity("/system.slice"), ())
    kworker = ProcessInfo(17, 3, "kworker/0:1", "", CgroupIdentity("/"), ())
    py = [Frame("_start", "python3.11"), Frame("main", "python3.11"), Frame("handle (app.py)", "[python]")]
    kernel = [Frame("entry_SYSCALL_64", "[kernel]", True), Frame("do_sys_poll", "[kernel]", True)]
    unknown = Frame("[unknown] (libssl.so.3+0x4f2a0)", "libssl.so.3")
    samples = [
        ResolvedSample(server, 4242, (*py,), 3, 40),
        ResolvedSample(server, 4250, (*py, unknown), 4, 7),
        ResolvedSample(server, 4251, (*py, *kernel), 3, 12),
        ResolvedSample(daemon, 812, (Frame("runtime.goexit", "containerd"), *kernel), 1, 5),
        ResolvedSample(kworker, 17, (Frame("worker_thread", "[kernel]", True),), 0, 3),
    ]
    syscalls = [
        (server, SyscallStat(4242, 7, "poll", 300, 20, 20 * 40_000, tuple(hist(b15=12, b16=8)))),
        (daemon, SyscallStat(812, 0, "read", 90, 6, 6 * 1_500, tuple(hist(b10=6)))),
    ]
    end = time.time_ns()
    window = Window(
        end - 10 * 10**9,
        end,
        samples,
        stats={"samples": 70, "user_stack_missing": 3, "stack_table_full": 1},
        syscalls=syscalls,
        syscall_sample_every=16,
        syscall_duty=0.5,
        syscall_counters={"table_full": 0, "stale_start": 2},
        offcpu=[
            ResolvedSample(server, 4251, (*py, *kernel), 3, 2_500_000_000),
            ResolvedSample(daemon, 812, (Frame("runtime.park_m", "containerd"), *kernel), 1, 9_000_000_000),
        ],
        frequency_hz=99,
    )
    window.labels = Attributor(_Pods()).by_process(window_processes(window))
    identity = pb.AgentIdentity(node="fuzz-node", agent_id="seed", boot_time_unix_ns=1, version="fuzz")
    batch = encode_window(window, identity)
    batch.sequence = 1
    return batch


def builder_batch() -> pb.Batch:
    """Several processes and stacks, GPU-tagged rows, syscalls, and frame names folded text must escape."""
    b = BatchBuilder(frequency_hz=49)
    trainer = b.process(1001, "trainer", {"namespace": "ml", "pod": "trainer-0", "container": "main"})
    loader = b.process(1002, "loader", {"namespace": "ml", "pod": "trainer-0", "container": "data"})
    host = b.process(1, "systemd", exe="/usr/lib/systemd/systemd")
    deep = b.stack([(f"frame_{i}", "libdeep.so") for i in range(200)])
    odd = b.stack([("a;b", "m"), ("line\nbreak", "m"), ("tab\tand space", ""), ("ünïcødé 🔥", "m")])
    kern = b.stack([("main", "app"), ("read", "libc"), ("ksys_read", "[kernel]")], kernel_start=2)
    empty = b.stack([])
    b.sample(trainer, deep, 30, pb.GPU_STATE_BUSY)
    b.sample(trainer, kern, 9, pb.GPU_STATE_IDLE)
    b.sample(loader, odd, 4)
    b.sample(host, empty, 2)
    b.sample(host, kern, 1)
    return with_syscalls(b.build(), [("read", 50, 5, 5 * 2_000, hist(b10=3, b11=2))])


def gpu_cpu_batch() -> pb.Batch:
    """The real poller's GPU batch (tests/support/gpu_batches.py) with CPU samples of its GPU processes added,
    some taken while their GPU was busy or idle."""
    with pytest.MonkeyPatch.context() as mp:
        batch = gpu_batch(mp)
    strings = {s: i for i, s in enumerate(batch.strings)}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(batch.strings)
            batch.strings.append(text)
        return strings[text]

    for frames, process, count, gpu in [
        ([("train_step", "libtorch.so"), ("cudaLaunchKernel", "libcuda.so")], 0, 25, pb.GPU_STATE_BUSY),
        ([("train_step", "libtorch.so"), ("DataLoader.next", "[python]")], 0, 11, pb.GPU_STATE_IDLE),
        ([("serve", "triton")], len(batch.processes) - 1, 6, pb.GPU_STATE_NONE),
    ]:
        batch.stacks.add(functions=[sid(f) for f, _ in frames], modules=[sid(m) for _, m in frames])
        batch.stacks[-1].kernel_start = len(frames)
        batch.stack_ids.append(stack_wire_id([f for f, _ in frames], [m for _, m in frames], len(frames)))
        cols = batch.sample_columns
        cols.process.append(process)
        cols.stack.append(len(batch.stacks) - 1)
        cols.count.append(count)
        cols.gpu.append(gpu)
    return batch


SEEDS: dict[str, Callable[[], pb.Batch]] = {
    "make_batch": make_batch,
    "builder": builder_batch,
    "agent": agent_batch,
    "gpu": gpu_cpu_batch,
}


# --- mutations ------------------------------------------------------------------------------------------

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
INTERESTING = [0, 1, 2, 3, 255, 4095, 4096, 4097, 1 << 31, U32, MAX_COUNT, MAX_COUNT + 1, 1 << 53]
INTERESTING += [(1 << 63) - 1, 1 << 63, U64]
TEXTS = [
    "",
    "x",
    " ",
    "\x00",
    '"',
    "\\",
    "}{,=~",
    "a;b c\nd\re",
    "\u2028\x85\x0b\x1c",
    "ünïcødé 🔥",
    "日本" * 300,
    "n" * 128,
    "n" * 129,
    "v" * 1024,
    "v" * 1025,
    "🔥" * 256,
    "🔥" * 257,
    "node",
    "pid",
    "comm",
    "gpu_state",
    "__name__",
    "app-name",
    "9lives",
    "team",
    "namespace",
    "pod",
]
BIG_TEXTS = [1 << 12, 1 << 16, 1 << 20]  # "x" * n: function names and strings past every label limit


@dataclass(frozen=True)
class Step:
    """One mutation with its arguments: `at` picks the element (modulo the batch's), `value` and `text`
    are what is written (clipped to the field's type)."""

    name: str
    at: int
    value: int
    text: str


@dataclass(frozen=True)
class Mutation:
    apply: Callable[[pb.Batch, Step], None]
    # Words of which one appears in the refusal when this mutation alone makes the batch invalid.
    names: tuple[str, ...]
    benign: bool = False  # the batch stays valid: it must be acknowledged


def _pick(n: int, at: int) -> int | None:
    return at % n if n else None


def _string_id(batch: pb.Batch, s: Step) -> int:
    """Past the table (by 0..3), or an arbitrary uint32."""
    return len(batch.strings) + s.at % 4 if s.at % 2 else s.value & U32


def _set_string_ref(batch: pb.Batch, s: Step) -> None:
    """Point one string reference anywhere in the batch out of the table (or anywhere)."""
    sid = _string_id(batch, s)
    refs: list[Callable[[], None]] = []
    for st_ in batch.stacks:
        if st_.functions:
            refs.append(lambda st_=st_: st_.functions.__setitem__(s.at % len(st_.functions), sid))
        if st_.modules:
            refs.append(lambda st_=st_: st_.modules.__setitem__(s.at % len(st_.modules), sid))
    for p in batch.processes:
        refs.append(lambda p=p: setattr(p, "comm", sid))
        refs.append(lambda p=p: setattr(p, "exe", sid))
        for lb in p.labels:
            refs.append(lambda lb=lb: setattr(lb, "name", sid))
            refs.append(lambda lb=lb: setattr(lb, "value", sid))
    for sc in batch.syscalls:
        refs.append(lambda sc=sc: setattr(sc, "syscall", sid))
    for d in batch.gpu_devices:
        for name in ("uuid", "name", "parent_uuid", "owner_namespace", "owner_pod", "owner_container"):
            refs.append(lambda d=d, name=name: setattr(d, name, sid))
    if batch.HasField("gpu_source"):
        refs.append(lambda: setattr(batch.gpu_source, "state", sid))
    if refs:
        refs[s.value % len(refs)]()


def _set_count(batch: pb.Batch, s: Step) -> None:
    i = _pick(len(batch.sample_columns.count), s.at)
    if i is not None:
        batch.sample_columns.count[i] = s.value


def _deep_stack(batch: pb.Batch, s: Step) -> None:
    i = _pick(len(batch.stacks), s.at)
    if i is None:
        return
    depth = [MAX_STACK_DEPTH - 1, MAX_STACK_DEPTH, MAX_STACK_DEPTH + 1, 3 * MAX_STACK_DEPTH][s.value % 4]
    st_ = batch.stacks[i]
    nstr = max(len(batch.strings), 1)
    st_.ClearField("functions")
    st_.ClearField("modules")
    st_.functions.extend((k * 7 + s.at) % nstr for k in range(depth))
    st_.modules.extend((k * 3) % nstr for k in range(depth))
    st_.kernel_start = depth - s.at % 3


def _kernel_start(batch: pb.Batch, s: Step) -> None:
    i = _pick(len(batch.stacks), s.at)
    if i is not None:
        batch.stacks[i].kernel_start = (
            len(batch.stacks[i].functions) + s.value % 3 if s.at % 2 else s.value & U32
        )


def _modules_out_of_step(batch: pb.Batch, s: Step) -> None:
    i = _pick(len(batch.stacks), s.at)
    if i is not None:
        mods = batch.stacks[i].modules
        if mods and s.value % 2:
            del mods[-1]
        else:
            mods.extend([0] * (len(batch.stacks[i].functions) + 1 - len(mods)))


def _duplicate_ids(column: str) -> Callable[[pb.Batch, Step], None]:
    def apply(batch: pb.Batch, s: Step) -> None:
        ids = getattr(batch, column)
        if len(ids) >= 2:
            ids[s.at % len(ids)] = ids[s.value % len(ids)]

    return apply


def _arbitrary_id(column: str) -> Callable[[pb.Batch, Step], None]:
    def apply(batch: pb.Batch, s: Step) -> None:
        ids = getattr(batch, column)
        if ids:
            ids[s.at % len(ids)] = s.value  # 0 included: the contract says never, nothing checks it

    return apply


def _id_count(column: str) -> Callable[[pb.Batch, Step], None]:
    def apply(batch: pb.Batch, s: Step) -> None:
        ids = getattr(batch, column)
        if s.value % 2 and ids:
            del ids[s.at % len(ids)]
        else:
            ids.append(s.value or 1)

    return apply


def _column_length(batch: pb.Batch, s: Step) -> None:
    cols = batch.sample_columns
    column = getattr(cols, ("process", "stack", "count", "gpu")[s.at % 4])
    if s.value % 2 and column:
        del column[-1]
    else:
        column.append(1)


def _sample_ref(batch: pb.Batch, s: Step) -> None:
    cols = batch.sample_columns
    column, n = (cols.process, len(batch.processes)) if s.at % 2 else (cols.stack, len(batch.stacks))
    i = _pick(len(column), s.at)
    if i is not None:
        column[i] = n + s.value % 3 if s.value % 5 else s.value & U32


def _gpu_state(batch: pb.Batch, s: Step) -> None:
    cols = batch.sample_columns
    if not cols.process:
        return
    if not cols.gpu:
        cols.gpu.extend([pb.GPU_STATE_NONE] * len(cols.process))
    cols.gpu[s.at % len(cols.gpu)] = [3, 4, 1 << 30, (1 << 31) - 1, -1, -(1 << 31)][s.value % 6]


def _string_table(batch: pb.Batch, s: Step) -> None:
    kind = s.at % 5
    if kind == 0:  # the table's first string must be ""
        if batch.strings:
            batch.strings[0] = s.text or "x"
        else:
            batch.strings.append(s.text or "x")
    elif kind == 1 and len(batch.strings) > 1:
        batch.strings[1 + s.value % (len(batch.strings) - 1)] = s.text
    elif kind == 2:
        batch.strings.append("x" * BIG_TEXTS[s.value % len(BIG_TEXTS)] + str(s.value))
    elif kind == 3 and len(batch.strings) > 1:
        batch.strings[1 + s.value % (len(batch.strings) - 1)] = "f" * BIG_TEXTS[s.value % len(BIG_TEXTS)]
    else:
        batch.ClearField("strings")


def _label(batch: pb.Batch, s: Step) -> None:
    p = batch.processes[s.at % len(batch.processes)] if batch.processes else None
    if p is None:
        return
    batch.strings.append(s.text)
    text = len(batch.strings) - 1
    if s.value % 3 == 0:
        p.labels.add(name=text, value=text)
    elif s.value % 3 == 1:
        p.labels.add(name=0, value=text)  # a label without a name
    else:
        batch.strings.append(TEXTS[s.value % len(TEXTS)])
        p.labels.add(name=len(batch.strings) - 1, value=text)


def _node(batch: pb.Batch, s: Step) -> None:
    kind = s.at % 4
    if kind == 0:
        batch.agent.node = ""
    elif kind == 1 and batch.agent.node:
        batch.agent.node += s.text  # stays unique: the read-back finds it by name
    elif kind == 2:
        batch.agent.node += "x" * BIG_TEXTS[s.value % len(BIG_TEXTS)]
    else:
        batch.agent.agent_id = "" if s.value % 2 else batch.agent.agent_id + "a" * BIG_TEXTS[s.value % 3]


def _sequence(batch: pb.Batch, s: Step) -> None:
    batch.sequence = [0, 1, 2, (1 << 63) - 1, 1 << 63, U64][s.at % 6]


def _window(batch: pb.Batch, s: Step) -> None:
    now = time.time_ns()
    offsets_s = [-7300, -7100, -3500, -60, 0, 250, 299, 301, 400, 10**9]
    if s.at % 7 == 6:  # anywhere in int64
        t = (s.value & U64) - (1 << 63)
    else:
        t = now + offsets_s[s.value % len(offsets_s)] * 10**9
    if s.at % 3 == 0:
        batch.start_unix_ns = t
    elif s.at % 3 == 1:
        batch.end_unix_ns = t
    else:
        end = t + (s.value % 3 - 1) * 10**9
        batch.start_unix_ns, batch.end_unix_ns = t, min(max(end, -(1 << 63)), (1 << 63) - 1)


def _frequency(batch: pb.Batch, s: Step) -> None:
    batch.frequency_hz = [0, 1, 99, 100_000, 100_001, U32][s.at % 6] if s.value % 2 else s.value & U32


def _syscall(batch: pb.Batch, s: Step) -> None:
    if not batch.syscalls:
        batch.syscalls.add(process=0, syscall=1, count=1)
    sc = batch.syscalls[s.at % len(batch.syscalls)]
    kind = s.value % 7
    if kind == 0:
        sc.process = len(batch.processes) + s.at % 3
    elif kind == 1:
        sc.syscall = 0
    elif kind == 2:
        sc.count = [MAX_COUNT, MAX_COUNT + 1, U64][s.at % 3]
    elif kind == 3:
        sc.timed = min(sc.count + 1, U64)
    elif kind == 4:
        sc.timed_ns = [(1 << 53), (1 << 63) - 1, 1 << 63, U64][s.at % 4]
    elif kind == 5:
        sc.latency_log2_ns.extend([0] * (65 - len(sc.latency_log2_ns)))
    else:
        sc.latency_log2_ns.append(1)


def _gpu(batch: pb.Batch, s: Step) -> None:
    kind = s.value % 8
    if kind == 0 or not batch.gpu_devices:
        batch.gpu_source.state = len(batch.strings) + s.at % 2
        batch.gpu_source.up = True
    elif kind == 1:
        batch.gpu_devices[s.at % len(batch.gpu_devices)].uuid = 0
    elif kind == 2 and batch.gpu_processes:
        batch.gpu_processes[s.at % len(batch.gpu_processes)].process = len(batch.processes) + s.at % 2
    elif kind == 3 and batch.gpu_processes:
        batch.gpu_processes[s.at % len(batch.gpu_processes)].device = len(batch.gpu_devices) + s.at % 2
    elif kind == 4 and batch.gpu_processes:
        u = batch.gpu_processes[s.at % len(batch.gpu_processes)]
        u.idle_polls, u.state_polls, u.polls = 3, 2, 1
    elif kind == 5:
        d = batch.gpu_devices[s.at % len(batch.gpu_devices)]
        d.samples.add(
            time_unix_ns=-(1 << 63),
            gpu_utilization_percent=U32,
            temperature_celsius=-(1 << 31),
            energy_millijoules=U64,
            memory_used_bytes=U64,
            power_milliwatts=U32,
        )
    elif kind == 6:
        d = batch.gpu_devices[s.at % len(batch.gpu_devices)]
        d.xid_codes.extend(range(1000))
        d.xid_errors, d.xid_watched = U64, True
    else:
        d = batch.gpu_devices[s.at % len(batch.gpu_devices)]
        d.parent_uuid, d.gpu_instance_id, d.index = d.uuid, U32, U32


def _process(batch: pb.Batch, s: Step) -> None:
    kind = s.value % 3
    if kind == 0 and batch.processes:
        p = batch.processes[s.at % len(batch.processes)]
        p.pid, p.start_time_ticks = U32, U64
    elif kind == 1:  # a process no sample refers to
        batch.processes.add(pid=s.at, comm=0)
        batch.process_ids.append(s.value or 1)
    elif batch.processes:
        del batch.processes[s.at % len(batch.processes)]  # its id stays: one id too many


def _empty_stack(batch: pb.Batch, s: Step) -> None:
    i = _pick(len(batch.stacks), s.at)
    if i is not None:
        batch.stacks[i].ClearField("functions")
        batch.stacks[i].ClearField("modules")
        batch.stacks[i].kernel_start = 0


# What folded text, SVG, HTML and JSON must each escape or carry: separators, every line break
# str.splitlines knows, NUL, markup.
ODD_NAME_PARTS = [
    "\u2028",
    "\x85",
    "\x0b",
    "\x1c",
    "\r\n",
    ";",
    " ",
    "\t",
    "\x00",
    "</script>",
    "]]>",
    '"',
    "\\",
]


def _odd_frame_names(batch: pb.Batch, s: Step) -> None:
    """Frame names that folded text, SVG, JSON and pprof must each carry (the string table's strings)."""
    parts = [ODD_NAME_PARTS[(s.value >> (4 * k)) % len(ODD_NAME_PARTS)] for k in range(3)]
    batch.strings.append(s.text + "".join(parts))
    i = _pick(len(batch.stacks), s.at)
    if i is not None and batch.stacks[i].functions:
        fns = batch.stacks[i].functions
        fns[s.value % len(fns)] = len(batch.strings) - 1


def _stats(batch: pb.Batch, s: Step) -> None:
    for fd in pb.SamplerStats.DESCRIPTOR.fields:
        setattr(batch.stats, fd.name, s.value)
    batch.syscall_tracer.table_full = s.value
    batch.syscall_latency_duty = [float("nan"), float("inf"), -1.0, 1e30, 0.5][s.at % 5]


def _clear(batch: pb.Batch, s: Step) -> None:
    name = ["stacks", "processes", "sample_columns", "stack_ids", "process_ids", "agent", "gpu_devices"]
    batch.ClearField(name[s.at % len(name)])


MUTATIONS: dict[str, Mutation] = {
    "string_ref": Mutation(_set_string_ref, ("string", "gpu", "label", "syscall")),
    "count": Mutation(_set_count, ("count",)),
    "deep_stack": Mutation(_deep_stack, ("deep", "kernel_start", "string")),
    "kernel_start": Mutation(_kernel_start, ("kernel_start",)),
    "modules": Mutation(_modules_out_of_step, ("modules",)),
    "dup_stack_ids": Mutation(_duplicate_ids("stack_ids"), (), benign=True),
    "dup_process_ids": Mutation(_duplicate_ids("process_ids"), (), benign=True),
    "any_stack_id": Mutation(_arbitrary_id("stack_ids"), (), benign=True),
    "any_process_id": Mutation(_arbitrary_id("process_ids"), (), benign=True),
    "stack_id_count": Mutation(_id_count("stack_ids"), ("stack_ids",)),
    "process_id_count": Mutation(_id_count("process_ids"), ("process_ids",)),
    "column_length": Mutation(_column_length, ("sample_columns",)),
    "sample_ref": Mutation(_sample_ref, ("sample",)),
    "gpu_state": Mutation(_gpu_state, ("GPU state",)),
    "string_table": Mutation(_string_table, ("string", "label", "bytes")),
    "label": Mutation(_label, ("label",)),
    "node": Mutation(_node, ("node", "agent_id")),
    "sequence": Mutation(_sequence, ("sequence",)),
    "window": Mutation(_window, ("clock", "window", "start_unix_ns")),
    "frequency": Mutation(_frequency, ("frequency",)),
    "syscall": Mutation(_syscall, ("syscall",)),
    "gpu": Mutation(_gpu, ("gpu",)),
    "process": Mutation(_process, ("process",)),
    "empty_stack": Mutation(_empty_stack, (), benign=True),
    "odd_frame_names": Mutation(_odd_frame_names, (), benign=True),
    "stats": Mutation(_stats, (), benign=True),
    "clear": Mutation(_clear, ("node", "stack", "process", "string", "sample", "agent_id", "gpu")),
}


def _bytes_op(payload: bytes, op: tuple[int, int, bytes]) -> bytes:
    kind, at, blob = op
    n = len(payload)
    pos = at % (n + 1)
    if kind == 0:
        return payload[:pos]  # truncated
    if kind == 1:  # bit flips
        out = bytearray(payload)
        for k, b in enumerate(blob or b"\x01"):
            if out:
                out[(pos + 131 * k) % len(out)] ^= b or 1
        return bytes(out)
    if kind == 2:
        return payload[:pos] + blob + payload[pos + len(blob) :]  # overwritten
    if kind == 3:
        return payload[:pos] + blob + payload[pos:]  # inserted
    if kind == 4:
        return payload + payload[:pos]  # a message and part of another: fields merge or break
    return blob  # random bytes


def _packed_op(batch: pb.Batch, op: tuple[int, int]) -> None:
    """Damage a batch's packed stack columns (Batch.frame_columns, Batch.stack_columns)."""
    kind, at = op
    fc, sc = batch.frame_columns, batch.stack_columns
    columns = [
        (fc, "functions"),
        (fc, "modules"),
        (fc, "ids"),
        (sc, "frames"),
        (sc, "lengths"),
        (sc, "kernel_starts"),
    ]
    msg, name = columns[at % len(columns)]
    data = getattr(msg, name)
    if kind == 0:  # cut mid-entry
        setattr(msg, name, data[:-1])
    elif kind == 1:  # one entry set to its largest value: past any table, or a huge length
        width = {"lengths": 2, "kernel_starts": 2, "ids": 8}.get(name, msg.index_bytes)
        if len(data) >= width:
            pos = (at // len(columns)) % (len(data) // width) * width
            setattr(msg, name, data[:pos] + b"\xff" * width + data[pos + width :])
    elif kind == 2:  # a width that is not 2 or 4, or the other one
        (fc if at % 2 else sc).index_bytes = [0, 1, 3, 8, 2, 4][at % 6]
    elif kind == 3:  # an entry more
        setattr(msg, name, data + data[:2])
    else:  # both forms
        batch.stacks.add(functions=[0])


@dataclass(frozen=True)
class Plan:
    """One fuzzed batch: a seed, whether the agent's ids are known to the collector first (its unmutated
    batch pushed just before), structural steps (on Stack messages), its stacks then packed as agents send
    them (`packed`, where they fit) and their columns damaged (`packed_op`), then byte operations on the
    serialized batch."""

    seed: str
    warm: bool
    steps: tuple[Step, ...]
    byte_ops: tuple[tuple[int, int, bytes], ...]
    packed: bool = True
    packed_op: tuple[int, int] | None = None


steps = st.builds(
    Step,
    st.sampled_from(sorted(MUTATIONS)),
    st.integers(0, 1 << 16),
    st.one_of(st.sampled_from(INTERESTING), st.integers(0, U64)),
    st.one_of(st.sampled_from(TEXTS), st.text(max_size=40)),
)
byte_ops = st.tuples(st.integers(0, 5), st.integers(0, 1 << 20), st.binary(max_size=64))
plans = st.builds(
    Plan,
    st.sampled_from(sorted(SEEDS)),
    st.booleans(),
    st.lists(steps, max_size=3).map(tuple),
    # A quarter of the batches are also damaged byte by byte (most of those are unreadable).
    st.integers(0, 3).flatmap(
        lambda k: st.lists(byte_ops, min_size=1, max_size=3).map(tuple) if k == 0 else st.just(())
    ),
    st.booleans(),
    # A quarter of the packed ones have their columns damaged.
    st.integers(0, 3).flatmap(
        lambda k: st.tuples(st.integers(0, 4), st.integers(0, 1 << 16)) if k == 0 else st.none()
    ),
)


# --- the collector under test -----------------------------------------------------------------------------


class RssSampler(threading.Thread):
    """VmRSS of a process every `every_s` seconds; the peak and the last value, in MiB."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self._path = Path(f"/proc/{pid}/status")
        self._every_s = every_s
        self._stop_event = threading.Event()
        self.peak_mb = self.last_mb = 0.0

    def sample(self) -> None:
        try:
            text = self._path.read_text()
        except OSError:
            return
        kb = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmRSS:"))
        self.last_mb = kb / 1024
        self.peak_mb = max(self.peak_mb, self.last_mb)

    def run(self) -> None:
        while not self._stop_event.wait(self._every_s):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


class Http:
    """GETs on one kept-alive connection (reopened when the server closed it), with a timeout."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._conn: http.client.HTTPConnection | None = None

    def get(self, path: str, **params: str) -> tuple[int, bytes]:
        url = f"{path}?{urllib.parse.urlencode(params)}" if params else path
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=PUSH_TIMEOUT_S)
            try:
                self._conn.request("GET", url)
                resp = self._conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


@dataclass
class Expected:
    """What the acknowledged batches of one agent carried, the nodes they named and the window they cover.

    An agent's batches all name its node; when a fuzzed one names another, the samples of processes the
    collector knows by wire id stay with the node it first described them under (the cache is per agent
    id), so the check is on the sum over the agent's nodes."""

    nodes: set[str] = field(default_factory=set)
    samples: int = 0
    syscalls: int = 0
    lo: float = float("inf")
    hi: float = float("-inf")
    # Not checkable: a window may have aged out of the store as it arrived, or a node is another agent's too
    # (a byte-level mutation can make two nodes equal).
    uncheckable: bool = False
    # The stacks as (function, module, kernel) frames with their samples, where the batch's own stacks are
    # what is stored: not for an agent whose stacks the collector knew by wire id (a warm plan).
    stacks: Counter | None = field(default_factory=Counter)


def batch_stacks(batch: pb.Batch) -> Counter:
    """The samples of each stack of the batch, its frames as (function, module, kernel)."""
    out: Counter = Counter()
    stacks, cols = stacks_of(batch), batch.sample_columns
    for k, count in zip(cols.stack, cols.count, strict=True):
        st = stacks[k]
        frames = zip(st.functions, st.modules, strict=True)
        out[tuple((f, m, i >= st.kernel_start) for i, (f, m) in enumerate(frames))] += count
    return out


def tree_stacks(root: dict) -> Counter:
    """The stacks of /api/v1/profile's JSON tree with their samples (each node's own samples end one)."""
    out: Counter = Counter()
    pending = [(root, ())]
    while pending:
        node, path = pending.pop()
        if node["self"]:
            out[path] += node["self"]
        pending.extend((c, (*path, (c["name"], c["module"], c["kernel"]))) for c in node["children"])
    return out


def folded_view(stacks: Counter) -> Counter:
    """What parse_folded must read back from to_folded's text of these stacks: names escaped by the writer
    (folded_frame), modules gone, a "_[k]" suffix read as a kernel frame."""
    out: Counter = Counter()
    for stack, count in stacks.items():
        names = [folded_frame(FrameKey(*frame)) for frame in stack] or [UNKNOWN_FRAME]
        key = tuple(FrameKey(n.removesuffix(KERNEL_SUFFIX), "", n.endswith(KERNEL_SUFFIX)) for n in names)
        out[key] += count
    return out


@dataclass
class Findings:
    pushed: int = 0
    acked: int = 0
    read_back: int = 0
    refused: Counter = field(default_factory=Counter)  # by the word after "batch N: " (first words)
    seeds: Counter = field(default_factory=Counter)


class CollectorUnderTest:
    """A `fleetprof collector` subprocess (stderr to a file: thousands of refusals are logged), what was
    acknowledged by node, and the checks each push ends with."""

    def __init__(self, tmp: Path, data_dir: Path | None) -> None:
        self.tmp, self.data_dir = tmp, data_dir
        self.log = tmp / "collector.log"
        self.run_id = os.urandom(3).hex()
        self.names = itertools.count()
        self.expected: dict[str, Expected] = {}  # by agent id
        self.node_agent: dict[str, str] = {}  # the agent id that first stored a batch naming the node
        self.stored: set[tuple[str, int]] = set()
        self.findings = Findings()
        self.seeds = {name: make().SerializeToString() for name, make in SEEDS.items()}
        self.start()

    def start(self) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "fleetprof.cli", "collector"]
        cmd += ["--grpc", f"127.0.0.1:{self.grpc_port}", "--http", f"127.0.0.1:{self.http_port}"]
        if self.data_dir is not None:
            # Flush every second, so reads race commits: a cold query once counted a chunk being committed
            # twice, and a flush once deadlocked against one (both fixed in collector/store/durable.py).
            cmd += ["--data-dir", str(self.data_dir), "--flush-interval", "1"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
        self.http = Http(self.http_port)

        def serving() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the collector exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                return self.http.get("/healthz")[0] == 200
            except OSError:
                return False

        wait_until(serving, 60, "the collector to serve /healthz", every=0.1)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.push_raw = self.channel.stream_stream(
            INGEST, request_serializer=None, response_deserializer=None
        )
        self.rss = RssSampler(self.proc.pid)
        self.rss.start()

    def kill9(self) -> None:
        self.rss.stop()
        self.channel.close()
        self.http.close()
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.rss.stop()
        self.channel.close()
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    # -- one fuzzed batch -------------------------------------------------------------------------------
    def materialize(self, plan: Plan) -> tuple[pb.Batch, bytes]:
        """The base batch (a seed, re-timed to now, with a node and agent id of its own) and the payload
        the plan makes of it."""
        base = pb.Batch.FromString(self.seeds[plan.seed])
        length = base.end_unix_ns - base.start_unix_ns
        base.end_unix_ns = time.time_ns() - 10**9
        base.start_unix_ns = base.end_unix_ns - length
        n = next(self.names)
        base.agent.node = f"fz-{self.run_id}-{n}-{plan.seed}"
        base.agent.agent_id = f"agent-{self.run_id}-{n}"
        base.sequence = 1
        batch = pb.Batch()
        batch.CopyFrom(base)
        batch.sequence = 2 if plan.warm else 1
        unpack(batch)
        for step in plan.steps:
            MUTATIONS[step.name].apply(batch, step)
        if plan.packed and batch.stacks:
            try:
                packed = pb.Batch()
                packed.CopyFrom(batch)
                pack(packed)
                batch = packed
            except (ValueError, OverflowError, struct.error):  # what packed columns cannot say stays Stacks
                pass
            if plan.packed_op is not None and batch.HasField("stack_columns"):
                _packed_op(batch, plan.packed_op)
        payload = batch.SerializeToString()
        for op in plan.byte_ops:
            payload = _bytes_op(payload, op)
        return base, payload

    def push(self, payload: bytes) -> grpc.RpcError | None:
        """Push one payload on its own stream: None when acknowledged, else the error."""
        self.findings.pushed += 1
        try:
            acks = list(self.push_raw(iter([payload]), timeout=PUSH_TIMEOUT_S))
        except grpc.RpcError as err:
            return err
        assert len(acks) == 1, f"{len(acks)} acks for one batch"
        return None

    def check(self, plan: Plan) -> None:
        base, payload = self.materialize(plan)
        self.findings.seeds[plan.seed] += 1
        agent = base.agent.agent_id
        if plan.warm:
            assert self.push(base.SerializeToString()) is None, "an unmutated real batch was refused"
            self.accepted(base, agent, content=False)
        try:
            batch: pb.Batch | None = pb.Batch.FromString(payload)
        except DecodeError:
            batch = None
        err = self.push(payload)
        what = f"{plan}\nthe collector's log: {self.log_tail()}"
        if err is None:
            assert batch is not None, f"unreadable bytes were acknowledged: {what}"
            self.accepted(batch, agent if plan.warm else batch.agent.agent_id, content=not plan.warm)
            self.read_back(agent if plan.warm else batch.agent.agent_id)
            return
        code, details = err.code(), err.details() or ""
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}\n{what}"
        if batch is None:
            assert details.startswith("batch (unreadable): "), f"{details}\n{what}"
            self.findings.refused["unreadable"] += 1
            return
        prefix = f"batch {batch.sequence}: "
        assert details.startswith(prefix) and len(details) > len(prefix) + 10, f"{details!r}\n{what}"
        self.findings.refused[" ".join(details[len(prefix) :].split()[:3])] += 1
        mutations = [MUTATIONS[s.name] for s in plan.steps]
        assert not all(m.benign for m in mutations) or plan.byte_ops or plan.packed_op, (
            f"a valid batch refused: {details}\n{what}"
        )
        if len(mutations) == 1 and not plan.byte_ops and not plan.warm and plan.packed_op is None:
            names = mutations[0].names
            assert any(word in details for word in names), f"{details!r} names none of {names}\n{what}"

    def accepted(self, batch: pb.Batch, agent: str, content: bool) -> None:
        """Note what an acknowledged batch adds to its agent (a resend of a stored one adds nothing);
        `content`: its stacks are stored as it sent them (none was known to the collector by wire id)."""
        self.findings.acked += 1
        key = (batch.agent.agent_id, batch.sequence)
        if key in self.stored:
            return
        self.stored.add(key)
        exp = self.expected.setdefault(agent, Expected())
        if not content:
            exp.stacks = None
        exp.nodes.add(batch.agent.node)
        owner = self.expected[self.node_agent.setdefault(batch.agent.node, agent)]
        if owner is not exp:
            owner.uncheckable = exp.uncheckable = True
        start, end = batch.start_unix_ns / 1e9, batch.end_unix_ns / 1e9
        exp.samples += sum(batch.sample_columns.count)
        exp.syscalls += sum(sc.count for sc in batch.syscalls)
        if exp.stacks is not None:
            exp.stacks.update(batch_stacks(batch))
        exp.lo, exp.hi = min(exp.lo, (start + end) / 2), max(exp.hi, end)
        # The store keeps RETENTION_S by the window's midpoint; one near that edge may be dropped at once.
        exp.uncheckable |= (start + end) / 2 < time.time() - RETENTION_S + 60

    def read_back(self, agent: str) -> None:
        """The samples and syscall calls of the agent's nodes, through the query API, are what its
        acknowledged batches carried."""
        exp = self.expected[agent]
        if exp.uncheckable:
            return
        self.findings.read_back += 1
        samples = syscalls = 0
        tree: Counter = Counter()
        folded: Counter = Counter()
        for node in exp.nodes:
            q = {
                "query": "{node=" + quote(node) + "}",
                "from": f"{exp.lo - 20:.3f}",
                "until": f"{exp.hi + 20:.3f}",
            }
            samples += self.json_of("/api/v1/top", by="node", **q)["total"]
            tree.update(tree_stacks(self.json_of("/api/v1/profile", max_nodes="1000000", **q)["root"]))
            status, body = self.http.get("/api/v1/profile", format="folded", **q)
            assert status == 200, f"/api/v1/profile for {node[:80]!r}: {status} {body[:500]!r}"
            folded.update(parse_folded(body.decode()))
            if exp.syscalls:
                syscalls += self.json_of("/api/v1/syscalls", by="node", **q)["total_count"]
        what = f"of the nodes {[n[:80] for n in exp.nodes]}"
        assert (samples, tree.total(), syscalls) == (exp.samples, exp.samples, exp.syscalls), what
        assert folded == folded_view(tree), f"folded text {what} does not read back as written"
        if exp.stacks is not None:
            assert tree == exp.stacks, f"stacks {what}"

    def json_of(self, path: str, **params: str) -> dict:
        status, body = self.http.get(path, **params)
        assert status == 200, f"{path} {str(params)[:300]}: {status} {body[:500]!r}"
        limit = sys.getrecursionlimit()  # a call tree is as deep as the deepest stack, and json recurses
        sys.setrecursionlimit(max(limit, 4 * MAX_STACK_DEPTH))
        try:
            return json.loads(body)
        finally:
            sys.setrecursionlimit(limit)

    # -- after the run -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        status, body = self.http.get("/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line.startswith("fleetprof_store_") or line.startswith("fleetprof_ingest_batches"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def check_healthy(self) -> None:
        assert self.proc.poll() is None, f"the collector exited: {self.log_tail()}"
        assert self.http.get("/healthz")[0] == 200
        log = self.log.read_text(errors="replace")
        assert "Traceback (most recent call last)" not in log, log[-5000:]
        self.rss.sample()
        assert self.rss.peak_mb < RSS_BOUND_MB, f"RSS peaked at {self.rss.peak_mb:.0f} MiB"

    def summary(self, label: str) -> str:
        f = self.findings
        return (
            f"\n[fuzz {label}] pushed {f.pushed} batches: {f.acked} acknowledged ({f.read_back} read back), "
            f"{f.pushed - f.acked} refused; RSS peak {self.rss.peak_mb:.0f} MiB, last {self.rss.last_mb:.0f} "
            f"MiB (bound {RSS_BOUND_MB}); seeds {dict(f.seeds)}\n  refusals: "
            + ", ".join(f"{k!r}: {n}" for k, n in f.refused.most_common(40))
        )


def _run(target: CollectorUnderTest, examples: int) -> None:
    @settings(
        max_examples=examples,
        derandomize=not BIG_RUN,  # the suite's corpus is the same every run: a fuzz test must not flake
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(plans)
    def fuzz(plan: Plan) -> None:
        target.check(plan)

    fuzz()


@pytest.fixture(scope="module")
def memory_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorUnderTest]:
    target = CollectorUnderTest(tmp_path_factory.mktemp("fuzz-memory"), None)
    yield target
    target.stop()


def test_fuzzed_batches_in_memory_are_refused_by_name_or_stored_exactly(
    memory_collector: CollectorUnderTest,
) -> None:
    started = time.monotonic()
    try:
        _run(memory_collector, BIG_RUN or SUITE_MEMORY_EXAMPLES)
        memory_collector.check_healthy()
    finally:
        print(memory_collector.summary(f"memory, {time.monotonic() - started:.0f} s"))


def test_fuzzed_batches_on_disk_are_stored_exactly_replayed_and_committed(tmp_path: Path) -> None:
    """The durable store: the same checks; then after kill -9 the restart replays every logged batch from
    the write-ahead log and commits it to the database (one that cannot be committed would hold back every
    later one), and the batches read back from the database are exactly what was acknowledged."""
    target = CollectorUnderTest(tmp_path, tmp_path / "data")
    started = time.monotonic()
    try:
        _run(target, BIG_RUN // 10 or SUITE_DURABLE_EXAMPLES)
        target.check_healthy()
        target.kill9()
        target.start()
        store = target.metrics()
        assert store["fleetprof_store_flush_errors"] == 0, target.log_tail()
        assert store["fleetprof_store_pending_rows"] == store["fleetprof_store_backlog_rows"] == 0
        for agent in list(target.expected)[:: max(1, len(target.expected) // 50)]:
            target.read_back(agent)
        target.check_healthy()
    finally:
        print(target.summary(f"durable, {time.monotonic() - started:.0f} s"))
        target.stop()
