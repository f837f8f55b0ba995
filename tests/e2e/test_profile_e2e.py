"""End to end with real eBPF: workloads with known hot functions, read back from the collector's API."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import (
    RunningAgent,
    RunningCollector,
    samples_of,
    settled_profile,
    start_agent,
    start_collector,
    stop_agent,
    wait_until,
)
from tests.support.cpu_time import CPU_BOUND_TIMEOUT_S, run_alone, sample_band, steal_seconds

pytestmark = [pytest.mark.bpf, pytest.mark.slow(seconds=70)]

# This module's agent samples at 499 Hz (conftest's runs at 99 Hz): the shares and counts below are judged
# from ~2,000-3,000 samples a run. At 99 Hz a 4 s run gave ~400, and its +-0.05 share band was 2 sigma,
# which a share leaves ~5% of the time (it did: 0.505 read for a true 0.558).
FREQUENCY = 499


@pytest.fixture(scope="module")
def agent(module_collector: RunningCollector) -> Iterator[RunningAgent]:
    a = start_agent(module_collector.grpc_target, FREQUENCY, 1.0, "--syscalls")
    yield a
    stop_agent(a)


def share_with(stacks: dict, function: str) -> float:
    hit = sum(n for st, n in stacks.items() if any(f.function == function for f in st))
    return hit / samples_of(stacks)


@pytest.mark.parametrize("share_a", [75, 40])
def test_cpu_split_between_two_functions_matches_the_truth(
    share_a: int, agent: RunningAgent, module_collector: RunningCollector, workload_bin
) -> None:
    proc = subprocess.Popen([workload_bin("two_funcs"), "6", str(share_a)], stdout=subprocess.PIPE, text=True)
    stdout, _ = proc.communicate(timeout=CPU_BOUND_TIMEOUT_S)
    truth = json.loads(stdout)
    stacks = settled_profile(module_collector, f'{{pid="{proc.pid}"}}', agent)

    total = samples_of(stacks)
    # 6 s of the workload's own CPU time x 499 Hz = ~3,000 samples; the noise of a count is at most
    # sqrt(3,000) = 55. The arithmetic below needs n >= 1,600. A CI run with a second heavy test process on
    # both CPUs read 1,512 for a 4 s run (2,000 expected; cause not found), hence the longer run.
    assert total > 1600, f"too few samples to judge shares: {total}"
    true_alpha = truth["alpha_ns"] / truth["total_ns"]
    true_beta = truth["beta_ns"] / truth["total_ns"]
    # Sampling error of a share p over n samples: sqrt(p(1-p)/n). At the usual n = 3,000 it is 0.0089 for
    # p = 0.40/0.60 and 0.0079 for 0.75/0.25, so +-0.05 is 5.6 and 6.3 sigma (4.1 sigma at the 1,600
    # floor). The workload's rounds vary in size, so no sample is tied to the one before (binomial). The
    # truth is the workload's own thread CPU clock, exact to a microsecond, but it leaves out hypervisor
    # steal, which the sampling clock ticks through; steal lands on either function at random. It is
    # ~0.03% of this VM's time; were it 5%, in 10 ms bursts, it would add sqrt(0.05 x 0.01 s x 0.24 / 4 s)
    # = 0.0055 in quadrature: 4.1 sigma at n = 2,000. A sampler that credited samples to the wrong
    # function, or lost one function's stacks, reads 0.2 (18 sigma) to 0.6 off.
    got_alpha, got_beta = share_with(stacks, "fp_hot_alpha"), share_with(stacks, "fp_cold_beta")
    print(
        f"shares at {share_a}%: alpha {got_alpha:.3f} (true {true_alpha:.3f}), beta {got_beta:.3f} "
        f"(true {true_beta:.3f}) of {total} samples"
    )
    assert got_alpha == pytest.approx(true_alpha, abs=0.05), (got_alpha, true_alpha, total)
    assert got_beta == pytest.approx(true_beta, abs=0.05), (got_beta, true_beta, total)
    # Frame-pointer stacks are complete: the hot function sits under its callers, root first.
    alpha_stacks = [st for st in stacks if st and st[-1].function == "fp_hot_alpha"]
    assert alpha_stacks, "fp_hot_alpha never appears as the leaf"
    names = [f.function for f in max(alpha_stacks, key=stacks.get)]
    assert names[-3:] == ["main", "fp_driver", "fp_hot_alpha"]
    top = module_collector.json("/api/v1/top", query=f'{{pid="{proc.pid}"}}', since="10m", limit="5")
    assert top["functions"][0]["function"] == ("fp_hot_alpha" if share_a > 50 else "fp_cold_beta")
    assert top["functions"][0]["module"] == "two_funcs"


def test_kernel_heavy_workload_shows_kernel_frames(
    agent: RunningAgent, module_collector: RunningCollector, workload_bin
) -> None:
    proc = subprocess.Popen([workload_bin("read_zero"), "3"], stdout=subprocess.PIPE)
    proc.communicate(timeout=60)
    stacks = settled_profile(module_collector, f'{{pid="{proc.pid}"}}', agent)
    total = samples_of(stacks)
    in_kernel = sum(n for st, n in stacks.items() if st and st[-1].kernel)
    # 3 s of wall time x 499 Hz: ~1,500 samples alone, ~1,000 with both CPUs busy; the kernel's share is
    # ~0.99 (clearing 1 MiB per read), so sigma = sqrt(0.99 x 0.01 / 1,000) = 0.003 and 0.5 is >100
    # sigma away. Kernel stacks missing, or user and kernel frames split into separate samples, read 0.
    print(f"{in_kernel} of {total} samples ended in the kernel")
    assert in_kernel / total > 0.5, f"only {in_kernel}/{total} samples ended in the kernel"
    kernel_names = {f.function for st in stacks for f in st if f.kernel}
    assert kernel_names & {"ksys_read", "vfs_read", "__x64_sys_read"}, sorted(kernel_names)[:30]
    # User frames stay above kernel frames, in one stack: the read loop calls into the kernel.
    assert any(
        [f.function for f in st if not f.kernel][-1:] in (["read"], ["__libc_read"], ["fp_read_loop"])
        and st[-1].kernel
        for st in stacks
    )


def test_samples_match_cpu_time_across_many_drains(
    agent: RunningAgent, module_collector: RunningCollector, workload_bin
) -> None:
    """No sample is lost or double counted across drains: samples ≈ frequency × CPU seconds."""
    steal_before = steal_seconds()
    proc = subprocess.Popen(run_alone([workload_bin("two_funcs"), "6", "50"]), stdout=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    steal = steal_seconds() - steal_before
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    assert proc.returncode == 0, f"the workload failed ({proc.returncode}): is SCHED_FIFO allowed here?"
    cpu_s = usage.ru_utime + usage.ru_stime
    stacks = settled_profile(module_collector, f'{{pid="{proc.pid}"}}', agent)
    got = samples_of(stacks)
    # 6 s at 1 s intervals spans >= 6 drains. The CPU clock ticks at exactly 1/frequency per CPU, so the
    # only slack is the partial tick at each end of each stretch the workload runs without a break -- and,
    # in a VM, time the hypervisor stole while the workload was on the vCPU: the guest's clock ticks
    # through it, but the kernel leaves it out of the task's CPU time (steal accounting). At most all of
    # the node's steal meanwhile was the task's.
    # Noise: each unbroken stretch on a CPU gets its samples to within one (variance <= 1/4). Time-sliced
    # against other busy processes, the workload runs in thousands of 1-4 ms stretches and the count
    # varies like a Poisson count: sigma ~ sqrt(2,994) = 55 samples, and the 3% band (90) is 1.6 sigma.
    # Run alone (SCHED_FIFO, above every ordinary process) it breaks only for the kernel's RT throttling
    # (50 ms a second) -- ~7 stretches, sigma <= sqrt(7/4) = 1.3 samples: the 3% band is 69 sigma, and
    # holds with both CPUs busy. One lost or doubled 1 s window is 499 of ~2,994 samples (17%). On one CPU
    # (taskset) it runs time-sliced, and the band is 4.5 sigma of that (sample_band: 8%).
    margin = sample_band(cpu_s * agent.frequency)
    lo, hi = (1 - margin) * cpu_s * agent.frequency, (1 + margin) * (cpu_s + steal) * agent.frequency
    print(
        f"{got} samples for {cpu_s:.3f} CPU s (+ {steal:.2f} s stolen) at {agent.frequency} Hz: "
        f"{got / (cpu_s * agent.frequency):.4f} x expected, band [{lo:.0f}, {hi:.0f}]"
    )
    assert lo <= got <= hi, (
        f"{got} samples for {cpu_s:.2f} CPU s (+ {steal:.2f} s stolen) at {agent.frequency} Hz"
    )


def test_agent_reports_its_health_and_sampler_outcomes(agent: RunningAgent) -> None:
    def sampled() -> str | None:
        text = agent.metrics()
        samples = [ln for ln in text.splitlines() if ln.startswith("fleetprof_agent_samples_total")]
        return text if samples and float(samples[0].split()[-1]) > 0 else None

    # Alone (the module's other tests not run first) the node may be idle: wait for a drain with samples.
    text = wait_until(sampled, 30, "the agent to count samples")
    for reason in ("stack_table_full", "count_table_full", "kernel_stack_errors", "user_stack_errors"):
        assert f'fleetprof_agent_stack_outcomes_total{{reason="{reason}"}}' in text
    assert "process_resident_memory_bytes" in text
    assert "fleetprof_agent_batches_acked_total" in text


def test_idle_task_is_excluded_by_default(agent: RunningAgent, module_collector: RunningCollector) -> None:
    def pids() -> list[str]:
        return module_collector.json("/api/v1/labels/pid/values")["values"]

    wait_until(pids, 30, "any samples")
    pids = pids()
    assert "0" not in pids, "the idle task (pid 0) was sampled"


def test_process_in_its_own_mount_namespace_is_symbolized_after_it_exits(workload_bin) -> None:
    """Like a container: its binary exists only in a private tmpfs of its own mount namespace, which is
    gone when the process exits. With a 5 s interval and a 2 s run, every sample is drained after that.
    (A 1 s run read 0 of its samples symbolized once, in a fresh-clone run: the agent re-described the
    process after its exec, from the shell that copied the binary, only once it had gone.)"""
    col = start_collector()
    agent = start_agent(f"127.0.0.1:{col.grpc_port}", 99, 5.0)
    try:
        script = (
            "set -e; mount -t tmpfs fp-ctr /mnt; "
            f"cp {workload_bin('two_funcs')} /mnt/ctr_two_funcs; exec /mnt/ctr_two_funcs 2 75"
        )
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE
        )
        proc.communicate(timeout=CPU_BOUND_TIMEOUT_S)
        assert proc.returncode == 0
        assert not os.path.exists("/mnt/ctr_two_funcs"), "the test binary leaked into the host namespace"
        # unshare exec()s sh, which exec()s the workload: the pid is the workload's.
        running = RunningCollector(col)
        stacks = settled_profile(running, f'{{pid="{proc.pid}"}}', agent)
        # 2 s of CPU x 99 Hz = ~198 samples at a true share of 0.75: sigma = sqrt(0.75 x 0.25 / 198) = 0.031,
        # so 0.5 is 8 sigma below. Frames left unsymbolized once the namespace is gone read 0.
        print(f"fp_hot_alpha in {share_with(stacks, 'fp_hot_alpha'):.3f} of {samples_of(stacks)} samples")
        assert share_with(stacks, "fp_hot_alpha") > 0.5, stacks
        top = running.json("/api/v1/top", query=f'{{pid="{proc.pid}"}}', since="10m", limit="3")
        assert top["functions"][0]["module"] == "ctr_two_funcs"
    finally:
        stop_agent(agent)
        col.stop()


def test_agent_drops_the_compilers_code_pages_after_loading(agent: RunningAgent) -> None:
    resident: dict[str, int] = {}
    name = ""
    with open(f"/proc/{agent.proc.pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else ""
            elif head[0] == "Rss:":
                resident[name] = resident.get(name, 0) + int(head[1])
    llvm_kb = sum(kb for path, kb in resident.items() if "libLLVM" in path or "libclang" in path)
    assert llvm_kb < 20 * 1024, f"{llvm_kb} kB of LLVM/clang still resident"
