"""The resolver returns a complete window (labels, GPU states, GPU polls attributed, the tracers' settings),
and the batch is a pure function of it: encoding looks nothing up. Processes come from a /proc tree written
by the test, pods from a pod source in PodCache's shape, GPU state from the agent's own GPU timeline."""

from __future__ import annotations

import time
from pathlib import Path

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.attribution import Attributor
from fleetprof.agent.batch import encode_window, stack_wire_id
from fleetprof.agent.gpu.timeline import GpuTimeline
from fleetprof.agent.kube.pods import PodMeta
from fleetprof.agent.model import (
    STACK_NONE,
    CgroupIdentity,
    CudaWindow,
    DeviceAssignment,
    DeviceIdentity,
    DeviceWindow,
    Drain,
    Frame,
    GpuWindow,
    OffCpuSettings,
    ProcessCuda,
    ProcessInfo,
    ProcessWindow,
    ResolvedSample,
    SampleCount,
    SyscallDrain,
    SyscallStat,
    Window,
)
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.resolver import GpuSources, Resolver
from fleetprof.agent.symbols.symbolizer import Symbolizer
from tests.agent.test_process_table import POD_A, POD_B, FakeProc
from tests.support.wire import stacks_of

SLOT_S = 1.0
OWNER = DeviceAssignment("ml", "trainer-0", "main", "nvidia.com/gpu", "GPU-a")


class Pods:
    """The pod metadata cache's face (agent/kube/pods.py PodCache.lookup): one pod known, or none."""

    def __init__(self) -> None:
        self.known = True

    def lookup(self, uid: str) -> PodMeta | None:
        if uid != POD_A or not self.known:
            return None
        return PodMeta(
            POD_A, "ml", "trainer-0", "node-1", "StatefulSet", "trainer", {}, {"team": "ml"}, "Running"
        )


def labels(batch: pb.Batch, pid: int) -> dict[str, str]:
    (p,) = [p for p in batch.processes if p.pid == pid]
    return {batch.strings[lb.name]: batch.strings[lb.value] for lb in p.labels}


def test_the_resolved_window_is_complete_and_the_batch_is_encoded_from_it_alone(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.write(300, "trainer", POD_A, start_ticks=10)
    proc.write(301, "loader", POD_B, start_ticks=11)
    # The GPU timeline in wall-clock time: GPU-a idle under the trainer, GPU-b busy under the loader,
    # one poll a second around now (the poller's clock).
    timeline, now = GpuTimeline(), time.time()
    for k in range(-5, 6):
        timeline.record(now + k, {"GPU-a": 0, "GPU-b": 90}, {"GPU-a": {300}, "GPU-b": {301}})
    pods = Pods()
    resolver = Resolver(
        ProcessTable(proc_root=str(tmp_path)),
        Symbolizer(),
        attributor=Attributor(pods),
        gpu=GpuSources(timeline, SLOT_S, lambda uuid: OWNER if uuid == "GPU-a" else None),
    )
    slot = int(time.monotonic() / SLOT_S) + 1  # as BPF tags a sample: bpf_ktime_get_ns() / GPU_SLOT_NS + 1
    drain = Drain(
        0,
        10**10,
        [
            SampleCount(300, 300, 0, "trainer", STACK_NONE, STACK_NONE, 5, gpu_slot=slot),
            SampleCount(300, 302, 0, "trainer", STACK_NONE, STACK_NONE, 2),  # not on a GPU: untagged
            SampleCount(301, 301, 0, "loader", STACK_NONE, STACK_NONE, 3, gpu_slot=slot),
        ],
        {},
        frequency_hz=19,
        offcpu_settings=OffCpuSettings(8, 1_000_000),
    )
    syscalls = SyscallDrain(0, 10**10, [SyscallStat(301, 0, "read", 4, 1, 500, (0,) * 40)], {}, 16, 0.5)
    gpu = GpuWindow(
        "up", [DeviceWindow(DeviceIdentity(0, "GPU-a", "H100"))], [ProcessWindow(300, "GPU-a", polls=4)]
    )

    window = resolver.resolve(drain, syscalls, gpu)

    assert [(s.process.pid, s.gpu_state) for s in window.samples] == [(300, "idle"), (300, ""), (301, "busy")]
    trainer, loader = window.labels[(300, 10)], window.labels[(301, 11)]
    assert trainer == tuple(sorted(trainer))  # sorted by name, as the batch carries them
    assert {"pod_uid": POD_A, "namespace": "ml", "pod": "trainer-0", "team": "ml"}.items() <= dict(
        trainer
    ).items()
    assert dict(loader).get("pod_uid") == POD_B and "pod" not in dict(loader)  # its pod is not in the cache
    assert window.gpu is not None and window.gpu.devices[0].owner == OWNER
    assert window.gpu.processes[0].process is not None and window.gpu.processes[0].process.comm == "trainer"
    assert (window.frequency_hz, window.syscall_sample_every, window.syscall_duty) == (19, 16, 0.5)
    assert window.offcpu_settings == OffCpuSettings(8, 1_000_000)

    identity = pb.AgentIdentity(node="n1", agent_id="a")
    batch = encode_window(window, identity)
    assert batch.frequency_hz == 19
    assert batch.syscall_latency_sample_every == 16 and batch.syscall_latency_duty == 0.5
    assert (batch.offcpu_stats.sample_every, batch.offcpu_stats.min_block_ns) == (8, 1_000_000)
    cols = batch.sample_columns
    rows = {
        (batch.processes[p].pid, g, c) for p, g, c in zip(cols.process, cols.gpu, cols.count, strict=True)
    }
    assert rows == {(300, pb.GPU_STATE_IDLE, 5), (300, pb.GPU_STATE_NONE, 2), (301, pb.GPU_STATE_BUSY, 3)}
    assert labels(batch, 300)["pod"] == "trainer-0" and labels(batch, 300)["team"] == "ml"
    assert "pod" not in labels(batch, 301)
    (usage,) = batch.gpu_processes
    assert batch.processes[usage.process].pid == 300
    assert batch.strings[batch.gpu_devices[0].owner_pod] == "trainer-0"

    # Pure: the pod leaving the cache and the GPU going busy change nothing once the window is resolved.
    pods.known = False
    timeline.record(now + 6, {"GPU-a": 100}, {"GPU-a": {300}})
    assert encode_window(window, identity).SerializeToString(deterministic=True) == batch.SerializeToString(
        deterministic=True
    )
    # ... and the next window sees them.
    later = resolver.resolve(drain, syscalls, gpu)
    assert "pod" not in dict(later.labels[(300, 10)])


def test_stacks_are_encoded_once_each_under_their_content_wire_id() -> None:
    """Equal frames that are distinct objects (the resolver shares most, not all), a frame in many stacks, the
    same frames under another kernel_start, a stack of no frames: each stack is in the batch once, its
    frames as given, its wire id what stack_wire_id makes of its strings (the collector caches by it)."""
    proc = ProcessInfo(7, 1, "app", "/bin/app", CgroupIdentity(path="/x"), ())
    main, leaf = Frame("main", "/bin/app"), Frame("sha256_block_data_order_avx2", "/lib/libcrypto.so.3")
    twin = Frame("main", "/bin/app")  # equal to `main`, another object
    sched = Frame("schedule", "[kernel]", kernel=True)
    rows = [
        ((main, leaf), 2),
        ((twin, leaf), 2),  # the same stack as the first: one row
        ((main, leaf, sched), 2),
        ((main, leaf), 1),  # the same frames, the kernel part starting earlier
        ((), 0),
    ]
    samples = [ResolvedSample(proc, 7, frames, ks, 3) for frames, ks in rows]
    batch = encode_window(Window(0, 10**9, samples), pb.AgentIdentity(node="n", agent_id="a"))
    decoded = [tuple(st) for st in stacks_of(batch)]
    assert decoded == [
        (("main", "sha256_block_data_order_avx2"), ("/bin/app", "/lib/libcrypto.so.3"), 2),
        (
            ("main", "sha256_block_data_order_avx2", "schedule"),
            ("/bin/app", "/lib/libcrypto.so.3", "[kernel]"),
            2,
        ),
        (("main", "sha256_block_data_order_avx2"), ("/bin/app", "/lib/libcrypto.so.3"), 1),
        ((), (), 0),
    ]
    assert list(batch.stack_ids) == [stack_wire_id(f, m, ks) for f, m, ks in decoded]
    assert len(set(batch.stack_ids)) == 4 and list(batch.sample_columns.count) == [6, 3, 3, 3]


def test_kernel_only_stacks_made_on_the_spot_keep_their_own_names() -> None:
    """Kernels whose launching stacks are unknown go as one-frame stacks the encoder makes as it goes; each
    keeps its own name and wire id (frames are found by object identity, which a freed frame's successor
    could share)."""
    proc = ProcessInfo(9, 1, "trainer", "/usr/bin/python3", CgroupIdentity(path="/x"), ())
    names = [f"kernel_{i}" for i in range(40)]
    cuda = CudaWindow([ProcessCuda(proc, kernel_ns={n: i + 1 for i, n in enumerate(names)})])
    batch = encode_window(Window(0, 10**9, [], cuda=cuda), pb.AgentIdentity(node="n", agent_id="a"))
    wire = stacks_of(batch)
    stacks = {st.functions[0]: i for i, st in enumerate(wire)}
    assert sorted(stacks) == sorted(names)
    kc = batch.cuda_kernel_columns
    by_name = {wire[s].functions[0]: ns for s, ns in zip(kc.stack, kc.kernel_ns, strict=True)}
    assert by_name == {n: i + 1 for i, n in enumerate(names)}
    assert [batch.stack_ids[i] for i in stacks.values()] == [
        stack_wire_id([n], ["[cuda]"], 1) for n in stacks
    ]
