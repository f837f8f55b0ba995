"""Stacks of code built without frame pointers, end to end: a real agent (default --unwind=eh_frame) and
collector. A C++ class template's hot method shows up demangled, under its callers, in `fleetprof top`,
folded output and pprof read by `go tool pprof`; a process in its own mount namespace that exits before the
agent drains its window is walked and named whole."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.pyroscope import profile_pb2
from tests.conftest import (
    RunningAgent,
    RunningCollector,
    acked_batches,
    fleetprof,
    http_get,
    settled_profile,
    start_agent,
    stop_agent,
    wait_until,
)
from tests.support.cpu_time import CPU_BOUND_TIMEOUT_S

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

FREQUENCY = 499
INTERVAL = 4.0  # seconds: longer than the short workload below lives
CHURN = "fleet::kernels::Accumulator<double>::churn(long)"
RUN_BATCH = "run_batch(fleet::kernels::Accumulator<double>&)"
DRIVE = "drive(double)"


@pytest.fixture(scope="module")
def agent(module_collector: RunningCollector) -> Iterator[RunningAgent]:
    a = start_agent(module_collector.grpc_target, FREQUENCY, INTERVAL)
    yield a
    stop_agent(a)


def run(argv: list[str]) -> int:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=120) == 0, argv
    return proc.pid


def test_a_cpp_template_method_shows_up_demangled_under_its_callers(
    agent: RunningAgent, module_collector: RunningCollector, no_fp_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    exe = str(no_fp_bin("unwind_template"))
    run([exe, "0.5"])  # an always-on agent has met the binary before: its tables are built by now
    pid = run([exe, "3"])
    query = f'{{pid="{pid}"}}'
    stacks = settled_profile(module_collector, query, agent)
    total = sum(stacks.values())
    under = sum(
        n
        for st, n in stacks.items()
        if [f.function for f in st if not f.kernel][-4:] == ["main", DRIVE, RUN_BATCH, CHURN]
    )
    hot = sum(n for st, n in stacks.items() if any(f.function == CHURN for f in st))
    print(f"{hot} of {total} samples in churn, {under} of them under main; drive; run_batch")
    # ~1,500 samples, nearly all in churn. Its callers are there only if the table walk got through
    # the frames built without frame pointers (the kernel's walk stops at churn), and names read as the
    # source does only if they were demangled.
    assert hot > 0.8 * total and under >= 0.95 * hot, (hot, under, total)

    top = fleetprof("top", "--collector", module_collector.url, "--query", query, "--since", "10m")
    assert top.returncode == 0, top.stderr
    assert CHURN in top.stdout and "_ZN" not in top.stdout, top.stdout

    q = urllib.parse.urlencode({"query": query, "since": "10m", "format": "folded"})
    folded = http_get(f"{module_collector.url}/api/v1/profile?{q}").decode()
    assert any(f";main;{DRIVE};{RUN_BATCH};{CHURN} " in line for line in folded.splitlines()), folded[:2000]

    q = urllib.parse.urlencode({"query": query, "since": "10m", "format": "pprof"})
    pprof = tmp_path / "cpp.pb.gz"
    pprof.write_bytes(http_get(f"{module_collector.url}/api/v1/profile?{q}"))
    if shutil.which("go") is None:
        pytest.fail("go is not installed (Debian golang-go; `make test` installs it)")
    traces = subprocess.run(
        ["go", "tool", "pprof", "-traces", str(pprof)], capture_output=True, text=True, check=True
    ).stdout
    # -traces prints each sampled stack leaf first: churn, then its callers.
    assert any(
        CHURN in block and block.index(CHURN) < block.index(RUN_BATCH) < block.index(DRIVE)
        for block in traces.split("-----------+")
        if CHURN in block and RUN_BATCH in block and DRIVE in block
    ), traces[:3000]
    prof = profile_pb2.Profile.FromString(gzip.decompress(pprof.read_bytes()))
    names = {(prof.string_table[f.name], prof.string_table[f.system_name]) for f in prof.function}
    assert (CHURN, "_ZN5fleet7kernels11AccumulatorIdE5churnEl") in names, sorted(names)[:20]


def test_the_agent_counts_walks_their_ends_and_frames_in_series_of_their_own(
    agent: RunningAgent, module_collector: RunningCollector, no_fp_bin: Callable[[str], Path]
) -> None:
    """Walks, how each ended, and frames are separate families, so no sum over one label mixes them; the
    table build time is a counter."""
    pid = run([str(no_fp_bin("unwind_template")), "1"])
    settled_profile(module_collector, f'{{pid="{pid}"}}', agent)
    families = {f.name: f for f in text_string_to_metric_families(agent.metrics())}
    for name in (
        "walks",
        "walk_ends",
        "fp_frames",
        "jit_fp_frames",
        "fallback_samples",
        "table_build_seconds",
    ):
        assert families[f"fleetprof_agent_unwind_{name}"].type == "counter", name
    assert "fleetprof_agent_unwind_events" not in families
    walks = families["fleetprof_agent_unwind_walks"].samples[0].value
    ends = {s.labels["reason"]: s.value for s in families["fleetprof_agent_unwind_walk_ends"].samples}
    # Each walk ends once, counted when it ends: never more ends than walks, and the binary built without
    # frame pointers was walked to its outermost frame.
    assert walks > 0 and ends["end"] > 0 and sum(ends.values()) <= walks, (walks, ends)
    assert families["fleetprof_agent_unwind_table_build_seconds"].samples[0].value > 0


def test_a_process_in_its_own_mount_namespace_that_exits_before_the_drain_is_whole(
    agent: RunningAgent, module_collector: RunningCollector, no_fp_bin: Callable[[str], Path]
) -> None:
    """The binary lives on a tmpfs mounted in the workload's own mount namespace (the host never sees the
    file), and the process runs ~1.4 s of CPU, ending before the agent's next drain (INTERVAL) when it
    gets a CPU to itself: its tables must be built while it lives, through its own root, and its symbols
    loaded then too. It waits in its gate (blocked: the agent learns of it at its first syscall) until
    the agent has built the binary's table: how soon after a start a table is there depends on the
    machine's load (a fresh-clone run beside two other BPF files had none while it ran: 0 of 359 whole),
    what is judged here is that it is built from a file only the process's own root holds."""
    target = "/mnt/ctr_unwind_chain"
    script = (
        f"mount -t tmpfs tmpfs /mnt && cp {no_fp_bin('unwind_chain')} {target} && exec {target} cpu 0.7 gate"
    )
    first = acked_batches(agent)
    wait_until(lambda: acked_batches(agent) > first, 30, "a drain to have just happened")
    tabled = agent.value("fleetprof_agent_unwind_files_tabled")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    # The binary is a new file to the node (a new tmpfs inode): one more table once it is built.
    wait_until(
        lambda: (
            agent.value("fleetprof_agent_unwind_files_tabled") > tabled
            and agent.value("fleetprof_agent_unwind_files_queued") == 0
        ),
        60,
        "the agent to build the table of the binary in the process's own mount namespace",
    )
    proc.communicate(b"go\n", timeout=CPU_BOUND_TIMEOUT_S)
    assert proc.returncode == 0
    assert not Path(target).exists(), "the test binary leaked into the host namespace"
    stacks = settled_profile(module_collector, f'{{pid="{proc.pid}"}}', agent)
    chain = ["main", "chain_a", "chain_b", "chain_c", "leaf_spin"]
    leaf = sum(n for st, n in stacks.items() if st and st[-1].function == "leaf_spin")
    whole = sum(
        n for st, n in stacks.items() if [f.function for f in st][-5:] == chain and st[0].function == "_start"
    )
    print(f"{whole} of {leaf} samples in leaf_spin whole; {sum(stacks.values())} in all")
    # The first samples precede the process's description and its table (tens of ms of ~1.4 s); the rest
    # are whole. Symbols read after the namespace is gone would be [unknown] and match nothing here.
    # 0.7 s of the workload's own CPU time in the chain part x 499 Hz: ~350 samples in leaf_spin on any
    # machine (a fixed number of rounds gave fewer on a faster one), sd <= 19: 100 is 13 sigma below.
    assert leaf > 100, stacks
    assert whole >= 0.7 * leaf, (whole, leaf)
