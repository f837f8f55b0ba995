"""The library's launch marker under a real uprobe (BCC): the CPU stack taken there names the function that
launched each sampled kernel, and kernel time joined through the marker's correlation ids comes out per
launching function exactly (every launch sampled) or within 4 sigma (1 in 8). The agent's own uprobe comes
later; this one is the smallest that proves the contract it will rely on: arguments in registers, a user
stack through our library and the CUDA stand-ins, one hit per sampled launch."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest

from fleetprof.agent.gpu.activity import LaunchIndex, kernel_time, launch_counts
from fleetprof.agent.gpu.cupti_ring import MARKER_SYMBOL
from tests.conftest import require_bpf
from tests.cuda_standin import CudaStandins, build_standins, run_held

pytestmark = pytest.mark.bpf

PROGRAM = r"""
#include <uapi/linux/ptrace.h>
struct launch_t { u64 weight; int stack; u32 hits; };
BPF_STACK_TRACE(stacks, 16384);
BPF_HASH(launches, u32, struct launch_t, 65536);
int on_launch(struct pt_regs *ctx) {
    u32 cid = (u32)PT_REGS_PARM1(ctx);
    struct launch_t zero = {}, *v = launches.lookup_or_try_init(&cid, &zero);
    if (!v) return 0;
    v->weight = PT_REGS_PARM2(ctx);
    v->stack = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    v->hits++;
    return 0;
}
"""
FUNCTIONS = ("optimizer_step", "eval_step", "train_step")  # innermost first: optimizer_step is in train_step


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


def run_with_marker_probe(cuda: CudaStandins, every: int, seconds: str) -> tuple:
    """Run the phases workload with a uprobe on the marker; returns the run and the marker's hits by
    correlation id as (weight, hits, launching function)."""
    require_bpf()
    from bcc import BPF

    bpf = BPF(text=PROGRAM.encode())
    try:
        bpf.attach_uprobe(name=bytes(cuda.library), sym=MARKER_SYMBOL.encode(), fn_name=b"on_launch")
        marks: dict[int, tuple[int, int, str | None]] = {}

        def describe(pid: int) -> None:  # while the workload holds: its symbols are still there
            stacks = bpf[b"stacks"]
            for cid, v in bpf[b"launches"].items():
                addrs = stacks.walk(v.stack) if v.stack >= 0 else []
                frames = [bpf.sym(addr, pid).decode() for addr in addrs]
                fn = next((f for f in frames if f in FUNCTIONS), None)
                marks[cid.value] = (v.weight, v.hits, fn)

        run = run_held(cuda, ["phases", seconds, "3"], on_hold=describe,
                       FLEETPROF_CUPTI_SAMPLE_EVERY=str(every), FLEETPROF_CUPTI_SAMPLE_CAP="0")  # fmt: skip
    finally:
        bpf.cleanup()
    assert run.returncode == 0, run.stderr
    return run, marks


def test_every_sampled_launch_hits_the_marker_once_with_its_id_weight_and_stack(cuda: CudaStandins) -> None:
    run, marks = run_with_marker_probe(cuda, every=1, seconds="0.8")
    launches = run.launches()
    assert {launch.correlation_id for launch in launches} == set(marks)
    for launch in launches:
        weight, hits, fn = marks[launch.correlation_id]
        assert (weight, hits) == (launch.weight, 1)
        assert fn is not None  # the user stack reached the workload's own function
    # Each logged launch's function, and the marker's stack, agree launch by launch (same order).
    logged = [e["fn"] for e in run.logged("launch")]
    ordered = [marks[launch.correlation_id][2] for launch in sorted(launches, key=lambda x: x.enter_ns)]
    assert ordered == logged


def test_kernel_time_per_launching_function_is_exact_when_every_launch_is_sampled(cuda: CudaStandins) -> None:
    run, marks = run_with_marker_probe(cuda, every=1, seconds="0.8")
    index = LaunchIndex()
    index.add(run.launches())
    stacks = {cid: fn for cid, (_w, _h, fn) in marks.items()}
    result = kernel_time(run.kernels(), index, stacks)
    truth: dict[tuple[str, str], int] = defaultdict(int)
    for e in run.logged("launch"):
        truth[(e["fn"], e["kernel"])] += e["dur"]
    assert result.by_stack == truth
    assert launch_counts(run.launches(), stacks) == Counter(e["fn"] for e in run.logged("launch"))


def test_sampled_kernel_time_per_launching_function_is_within_4_sigma(cuda: CudaStandins) -> None:
    every = 8
    run, marks = run_with_marker_probe(cuda, every=every, seconds="3")
    index = LaunchIndex()
    index.add(run.launches())
    stacks = {cid: fn for cid, (_w, _h, fn) in marks.items()}
    result = kernel_time(run.kernels(), index, stacks)
    truth: dict[tuple[str, str], int] = defaultdict(int)
    n: Counter[tuple[str, str]] = Counter()
    for e in run.logged("launch"):
        truth[(e["fn"], e["kernel"])] += e["dur"]
        n[(e["fn"], e["kernel"])] += 1
    # Per kernel name the total is exact whatever was sampled.
    for name in {k for _, k in truth}:
        assert sum(ns for (_, k), ns in result.by_stack.items() if k == name) == sum(
            ns for (_, k), ns in truth.items() if k == name
        )
    # relu_kernel is launched from train_step (2 a step) and eval_step (1 every other step): its time under
    # each is the sampled share p^ of its total. With n sampled relu launches, sigma(p^) = sqrt(p (1-p) / n).
    relu = "relu_kernel"
    total = sum(ns for (_, k), ns in truth.items() if k == relu)
    p = truth[("eval_step", relu)] / total
    sampled = sum(1 for k in run.kernels() if k.name == relu and (launch := index.get(k.correlation_id))
                  and stacks.get(launch.correlation_id))  # fmt: skip
    assert sampled >= 30, sampled  # the bound below holds for any n; 30 keeps it a real check (sigma < 9%)
    sigma = math.sqrt(p * (1 - p) / sampled)
    share = result.by_stack.get(("eval_step", relu), 0) / total
    assert abs(share - p) <= 4 * sigma, (share, p, sigma)
    # Launch counts per function from the weights: N x Binomial(n, 1/N), sigma = sqrt(n (N - 1)).
    counts = launch_counts(run.launches(), stacks)
    for fn in FUNCTIONS:
        n_fn = sum(c for (f, _), c in n.items() if f == fn)
        assert abs(counts.get(fn, 0) - n_fn) <= 4 * math.sqrt(n_fn * (every - 1)), (fn, counts, n_fn)
