"""CUDA uprobes with real eBPF (agent/bpf/cuda_probes.c, agent/gpu/cuda_probes.py) on our stand-in libcudart
and libcuda (tests/cuda_standin/) and on NVIDIA's real libcudart.so.13: launches counted exactly under the
function that launched them with the kernel as leaf, waiting calls timed against the workload's own clock,
probes gone with the last process; the batch carries it all."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import encode_window
from fleetprof.agent.cuda_api import CALL_NAMES, LAUNCHES
from fleetprof.agent.gpu.cuda_libraries import cuda_libraries, exported_functions
from fleetprof.agent.model import CudaCallStat, ResolvedSample
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.symbols.elf import ElfFile
from fleetprof.agent.symbols.symbolizer import Symbolizer
from tests.conftest import own_scope, require_bpf
from tests.cuda_standin import CudaStandins, build_standins, real_libcudart
from tests.support.wire import stacks_of

pytestmark = [pytest.mark.bpf]

GEMM = "_Z11gemm_kernelPKfS0_Pfi"  # tests/cuda_standin/probed.c: its host stubs carry these names
SLEEP = "_Z12sleep_kernelm"
RELU = "relu_kernel"  # a driver kernel: named by cuModuleGetFunction
SYNC_US = 3000  # each wait_for_gpu waits for a kernel of this length: [2^21, 2^22) ns is 2.10-4.19 ms


@dataclass
class Run:
    pid: int
    truth: dict
    launches: list[ResolvedSample] = field(default_factory=list)
    calls: dict[str, CudaCallStat] = field(default_factory=dict)
    stats: Counter = field(default_factory=Counter)
    batches: list[pb.Batch] = field(default_factory=list)
    offcpu: list[ResolvedSample] = field(default_factory=list)

    def under(self, leaf: str, function: str) -> int:
        """Launches of kernel `leaf` whose stack passes through `function`."""
        return sum(
            s.count
            for s in self.launches
            if s.frames[-1].function == leaf and any(f.function == function for f in s.frames)
        )


class Pipeline:
    """Sampler with CUDA probes + process table + resolver, wired as the agent wires them."""

    def __init__(self, config: SamplerConfig) -> None:
        require_bpf()
        self.sampler = CpuSampler(config)
        assert self.sampler.cuda is not None
        self.probes = self.sampler.cuda
        self.errors: dict[str, int] = {}
        self.also: list = []  # other capture hooks (the CUPTI rings' reader)
        self.table = ProcessTable(on_capture=self._captured, on_forget=self.probes.forget)
        symbolizer = Symbolizer()
        self.resolver = Resolver(self.table, symbolizer)

    def _captured(self, info) -> None:  # as agent/main.py wires it
        self.probes.attach(info.pid, cuda_libraries(info, self.probes.known, self.errors))
        for also in self.also:
            also(info)

    def run(self, argv: list[str], env: dict[str, str], describe: bool = True) -> Run:
        self.resolver.resolve(self.sampler.drain())  # an empty window to start from
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert "ready" in first or "holding" in first, first
        if describe:
            self.table.refresh(proc.pid)  # the capture: the probes are attached to what it maps
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        window = self.resolver.resolve(self.sampler.drain())
        run = Run(proc.pid, json.loads(out.strip().splitlines()[-1]))
        cuda = window.cuda
        if cuda is not None:
            run.launches = [s for s in cuda.launches if s.process.pid == proc.pid]
            run.calls = {c.call: c for p, c in cuda.calls if p.pid == proc.pid}
        run.stats.update(window.stats)
        run.offcpu = [s for s in window.offcpu if s.process.pid == proc.pid]
        run.batches.append(encode_window(window, pb.AgentIdentity(node="test")))
        self.table.mark_exited(proc.pid)
        self.table.end_window()
        self.table.end_window()  # forgotten a drain after it exited, as the agent does
        return run

    def close(self) -> None:
        self.sampler.close()


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


@pytest.fixture(scope="module")
def every_launch() -> Iterator[Pipeline]:
    p = Pipeline(SamplerConfig(interval_s=1.0, cuda=True, cuda_launch_sample_every=1, scope=own_scope()))
    yield p
    p.close()


@pytest.fixture(scope="module")
def probed_run(every_launch: Pipeline, cuda: CudaStandins) -> Run:
    return every_launch.run([str(cuda.probed), "2", str(SYNC_US)], cuda.env(inject=False))


def test_every_launch_is_counted_under_its_launching_function_with_the_kernel_as_leaf(
    probed_run: Run,
) -> None:
    run, t = probed_run, probed_run.truth
    print({k: v for k, v in run.stats.items() if k.startswith("cuda")}, t["train"], "steps")
    assert t["train"] > 10
    assert run.under(GEMM, "train_step") == 2 * t["train"]
    assert run.under(SLEEP, "wait_for_gpu") == t["waits"]
    assert run.under(RELU, "eval_step") == t["eval"]
    assert run.under("[cuda graph]", "graph_step") == t["graph"]
    total = 2 * t["train"] + t["waits"] + t["eval"] + t["graph"]
    assert sum(s.count for s in run.launches) == total
    # Every launch counted once: the runtime's own driver launches (cudaLaunchKernel -> cuLaunchKernel in
    # the stand-in, as in NVIDIA's) are told apart by their return address in libcudart.
    assert run.stats["cuda_launches"] == total
    assert run.stats["cuda_nested"] == 2 * t["train"] + t["waits"]
    assert run.stats["cuda_table_full"] == 0
    for s in run.launches:
        names = [f.function for f in s.frames]
        # leaf: the kernel; below it the API function the uprobe stopped at; then the workload's frames
        assert names[-2] in {"cudaLaunchKernel", "cuLaunchKernel", "cuGraphLaunch"}, names
        assert "main" in names, names
        assert s.kernel_start == len(s.frames)
    gemm = next(s for s in run.launches if s.frames[-1].function == GEMM)
    assert gemm.frames[-1].module == "probed"  # the host stub's file


def test_waits_are_timed_as_the_workload_measured_them(probed_run: Run) -> None:
    run, t = probed_run, probed_run.truth
    sync = run.calls["cudaStreamSynchronize"]
    assert sync.count == t["waits"]
    # Each wait is a kernel of SYNC_US (+ 2 us of launch latency) slept through: BPF's time lies within the
    # workload's own measurement around the call, and never below the kernel's length.
    assert t["waits"] * SYNC_US * 1000 <= sync.ns <= sum(t["wait_ns"])
    assert sum(sync.hist) == sync.count
    low = (SYNC_US * 1000).bit_length() - 1  # 21: the bucket of the kernel's length, [2.10, 4.19) ms
    assert sum(sync.hist[:low]) == 0
    own = Counter(min(ns.bit_length() - 1, len(sync.hist) - 1) for ns in t["wait_ns"])
    print("BPF", {i: h for i, h in enumerate(sync.hist) if h}, "workload", dict(own))
    # The driver's twin, called inside it, has its own row.
    assert run.calls["cuStreamSynchronize"].count == t["waits"]
    assert run.calls["cudaMalloc"].count == t["allocs"]
    assert run.calls["cudaFree"].count == t["allocs"] + 1  # and the customary cudaFree(0)
    assert run.calls["cuMemAlloc_v2"].count == t["allocs"]
    assert run.stats["cuda_table_full"] == 0


def test_off_cpu_time_shows_the_threads_blocked_inside_the_synchronising_call(probed_run: Run) -> None:
    """The waits the probes time are the off-CPU recorder's too: the stack blocked in cudaStreamSynchronize
    (the stand-in sleeps there until its kernel ends) is in the off-CPU profile, at about the same time."""
    t = probed_run.truth
    blocked = sum(
        s.count for s in probed_run.offcpu if any(f.function == "cudaStreamSynchronize" for f in s.frames)
    )
    waits = t["wait_ns"]
    # Off-CPU samples 1 switch-out in 8 (waits < 10 ms are not recorded exactly) and scales by 8: over n
    # waits of mean m, the estimate's sigma is 8 m sqrt(n x 1/8 x 7/8) (the waits are near equal).
    n, m = len(waits), sum(waits) / len(waits)
    sigma = 8 * m * math.sqrt(n * (1 / 8) * (7 / 8))
    print(
        f"off-CPU in cudaStreamSynchronize {blocked / 1e9:.3f} s, the waits {sum(waits) / 1e9:.3f} s, "
        f"sigma {sigma / 1e9:.3f} s"
    )
    assert abs(blocked - sum(waits)) <= 4 * sigma


def test_the_batch_carries_launches_calls_and_stats(probed_run: Run) -> None:
    (batch,) = probed_run.batches
    t = probed_run.truth
    lc = batch.cuda_launch_columns
    assert sum(lc.count) == sum(s.count for s in probed_run.launches) > 0
    leaves = Counter()
    wire = stacks_of(batch)
    for stack, count in zip(lc.stack, lc.count, strict=True):
        st = wire[stack]
        assert st.kernel_start == len(st.functions)
        leaves[st.functions[-1]] += count
    assert leaves[GEMM] == 2 * t["train"] and leaves[RELU] == t["eval"]
    calls = {batch.strings[c.call]: c for c in batch.cuda_calls}
    sync = calls["cudaStreamSynchronize"]
    assert sync.count == sync.timed == t["waits"] and sum(sync.latency_log2_ns) == sync.timed
    assert batch.cuda_stats.launch_sample_every == 1
    assert batch.cuda_stats.launches == batch.cuda_stats.launches_sampled >= sum(lc.count)


def test_probes_are_detached_with_the_last_process_that_maps_the_library(
    every_launch: Pipeline, cuda: CudaStandins, probed_run: Run
) -> None:
    left = every_launch.probes.probed_pids()
    assert len(every_launch.probes) == 0, left  # probed_run's process was forgotten: its two files detached
    # A process the agent never described is not probed: nothing is recorded of it.
    run = every_launch.run([str(cuda.probed), "0.3", "1000"], cuda.env(inject=False), describe=False)
    assert run.truth["train"] > 0
    assert run.launches == [] and run.calls == {}
    assert run.stats["cuda_launches"] == 0


def test_one_launch_in_n_is_walked_and_counts_are_scaled_back(cuda: CudaStandins) -> None:
    p = Pipeline(SamplerConfig(interval_s=1.0, cuda=True, cuda_launch_sample_every=4, scope=own_scope()))
    try:
        run = p.run([str(cuda.probed), "loop", "1"], cuda.env(inject=False))
    finally:
        p.close()
    n = run.truth["launches"]
    assert run.stats["cuda_launches"] == n  # counted exactly, sampled or not
    k = run.stats["cuda_launches_sampled"]
    scaled = sum(s.count for s in run.launches if s.frames[-1].function == GEMM)
    assert scaled == 4 * k
    # k ~ Binomial(n, 1/4): sigma = sqrt(n x 1/4 x 3/4); 4 sigma of k is 16 sigma of the scaled count.
    sigma = math.sqrt(n * 0.25 * 0.75)
    print(f"{n} launches, {k} walked ({k / n:.4f}), scaled {scaled}, 4 sigma {4 * 4 * sigma:.0f}")
    assert abs(scaled - n) <= 4 * 4 * sigma


# -- NVIDIA's real libcudart.so.13 (no GPU, no driver: every call fails at once, but it is made) ---------


def test_the_real_libcudart_exports_every_probed_runtime_function() -> None:
    lib = real_libcudart()
    with ElfFile(str(lib)) as elf:
        found = exported_functions(elf, [n for _, n, _ in LAUNCHES] + list(CALL_NAMES))
    print(sorted(found))
    runtime = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cudaStreamSynchronize")
    runtime += ("cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc", "cudaFree")
    for name in runtime:
        assert name in found, name
    # The offsets are where the functions' code is in the file: what the kernel sets a uprobe at.
    assert len(set(found.values())) == len(found)


def test_launches_through_the_real_libcudart_are_seen_with_their_stack_and_stub(
    every_launch: Pipeline, cuda: CudaStandins
) -> None:
    lib = real_libcudart()
    env = {"PATH": "/usr/bin:/bin", "HOLD": "1"}
    run = every_launch.run([str(cuda.cudart_real), str(lib), "500"], env)
    assert run.truth["calls"] == 500 and run.truth["error"] != 0  # no driver: failed, but made
    print(run.truth, {k: v for k, v in run.stats.items() if k.startswith("cuda")})
    assert run.under("fleetprof_test_kernel_stub", "launch_from_here") == 500
    s = run.launches[0]
    assert s.frames[-1].module == "cudart_real"
    assert s.frames[-2].function == "cudaLaunchKernel" and s.frames[-2].module == "libcudart.so.13"


# -- GPU kernel time under the launching stack (our CUPTI library's marker + the uprobe on it) -------------


def test_kernel_time_is_under_the_launching_function_with_the_kernel_as_leaf(
    every_launch: Pipeline, cuda: CudaStandins
) -> None:
    """tests/cuda_standin/launcher.c phases: gemm is launched from train_step only, relu from train_step and
    eval_step, adam (driver API) from optimizer_step; each kernel's GPU time is what the workload asked the
    stand-in device for. The library samples 1 launch in 8 and calls its marker with the launch's
    correlation id, where the uprobe takes the stack; CUPTI's kernel record carries the same id."""
    from fleetprof.agent.gpu.cupti_reader import CuptiReaders

    p = every_launch
    readers = CuptiReaders()
    p.also.append(readers.on_capture)  # the rings are read too, as the agent wires both
    stacks: Counter = Counter()  # (leaf, launching function) -> ns
    one_frame: Counter = Counter()  # leaf -> ns with no known stack
    kernels: Counter = Counter()  # all, and those whose time went under a launching stack
    try:
        p.resolver.resolve(p.sampler.drain())
        proc = subprocess.Popen(
            [str(cuda.launcher), "phases", "2", "5"],
            env=cuda.env(inject=True, HOLD="1", WAIT_AFTER_INIT="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["ev"] == "initialised":  # the library is loaded: capture now, as the agent would
                p.table.refresh(proc.pid)
                proc.stdin.write("\n")
                proc.stdin.flush()
            if events[-1]["ev"] == "holding":
                break

        def collect() -> None:
            offset = time.time_ns() - time.monotonic_ns()
            drain = p.sampler.drain()
            window = p.resolver.resolve(
                drain, cuda=readers.drain(drain.start_ns - offset, drain.end_ns - offset)
            )
            for pc in window.cuda.processes if window.cuda else []:
                if pc.process.pid != proc.pid:
                    continue
                for frames, ns in pc.kernel_stacks:
                    names = {f.function for f in frames}
                    for fn in ("train_step", "eval_step", "optimizer_step"):
                        if fn in names:
                            stacks[(frames[-1].function, fn)] += ns
                placed = {frames[-1].function for frames, _ in pc.kernel_stacks}
                for name, ns in pc.kernel_ns.items():
                    if name not in placed:
                        one_frame[name] += ns
                kernels["all"] += pc.kernels
                kernels["attributed"] += pc.kernels_attributed

        for _ in range(4):  # the library flushes every 100 ms: its last records are in after that
            time.sleep(0.3)
            collect()
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        p.also.remove(readers.on_capture)
        readers.close()
        p.table.mark_exited(proc.pid)  # forgotten, its files detached (test_probes_are_detached... counts)
        p.table.end_window()
        p.table.end_window()
    launches = [e for e in events if e["ev"] == "launch"]
    truth: Counter = Counter()
    for e in launches:
        truth[(e["kernel"], e["fn"])] += e["dur"]
    print("truth", dict(truth), "\nstacks", dict(stacks), "\none frame", dict(one_frame))
    gemm = "_Z11gemm_kernelPKfS0_Pfi"
    # Each window's gemm time goes under train_step, its only launcher, to the ns: a window without one
    # sampled gemm launch (1 in 8 of its ~100 gemm launches: (7/8)^100 = 1.6e-6) would leave it one-frame.
    assert stacks[(gemm, "train_step")] == truth[(gemm, "train_step")]
    assert stacks[("adam_kernel", "optimizer_step")] == truth[("adam_kernel", "optimizer_step")]
    relu = stacks[("relu_kernel", "train_step")] + stacks[("relu_kernel", "eval_step")]
    assert relu == truth[("relu_kernel", "train_step")] + truth[("relu_kernel", "eval_step")]
    assert one_frame == Counter()
    # Every kernel of the workload ran for a time the test set (none zero): all of them attributed.
    assert kernels["attributed"] == kernels["all"] == sum(1 for e in events if e["ev"] == "launch"), kernels


def test_launches_from_python_are_under_the_python_function(
    every_launch: Pipeline, cuda: CudaStandins, tmp_path: Path
) -> None:
    """The launch's CPython frames are walked as a CPU sample's: the Python function that called
    cudaLaunchKernel (through ctypes) is in the launch's stack, above the kernel leaf."""
    from fleetprof.agent.python.unwinder import PythonStacks

    stubs = tmp_path / "libstubs.so"
    (tmp_path / "stubs.c").write_text(
        'void stub(void) __asm__("_Z11gemm_kernelPKfS0_Pfi");\nvoid stub(void) { __asm__ volatile(""); }\n'
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stubs), str(tmp_path / "stubs.c")], check=True)
    p = every_launch
    python = PythonStacks(enabled=True)
    python.attach(p.sampler)
    p.also.append(python.on_capture)
    resolver = Resolver(p.table, Symbolizer(), python=python)
    script = Path(__file__).parent.parent / "cuda_standin" / "launch_from_python.py"
    try:
        resolver.resolve(p.sampler.drain())
        proc = subprocess.Popen(
            [sys.executable, str(script), str(stubs), "1"],
            env=cuda.env(inject=False),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        assert "ready" in proc.stdout.readline()
        p.table.refresh(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        truth = json.loads(proc.stdout.readline())
        window = resolver.resolve(p.sampler.drain())  # while it lives: its code objects are read
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        p.also.remove(python.on_capture)
        p.table.mark_exited(proc.pid)
        p.table.end_window()
        p.table.end_window()
    assert window.cuda is not None
    mine = [s for s in window.cuda.launches if s.process.pid == proc.pid]
    print(truth, [f.function for f in mine[0].frames] if mine else None)
    assert truth["launches"] > 100
    under = sum(
        s.count
        for s in mine
        if s.frames[-1].function == GEMM and any(f.function.startswith("train_step (") for f in s.frames)
    )
    assert under == truth["launches"]
