"""`--cgroup PATH`: the agent samples, and traces the syscalls of, only the tasks of one cgroup (v2) and its
descendants, with real BPF on this kernel: a workload moved into a cgroup of its own (and the child it
forks) is seen, the same workload beside it outside is not, and the flag refuses what is not a cgroup."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.scope import CgroupScope, ScopeError, cgroup2_root, cgroup_scope
from fleetprof.agent.syscalls import SyscallConfig, SyscallTracer
from tests.conftest import REPO, own_scope, require_bpf

HYBRID = (
    "25 1 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw\n"
    "28 25 0:26 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,cpu\n"
)


def test_the_scope_is_the_directorys_inode_and_its_depth_below_the_hierarchys_root(tmp_path: Path) -> None:
    """Levels count from the hierarchy's root: the mount's own root (a container's view) adds its depth."""
    leaf = tmp_path / "kubepods.slice" / "pod1"
    leaf.mkdir(parents=True)
    pure = f"30 1 0:27 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert cgroup_scope(str(leaf), pure) == CgroupScope(str(leaf), leaf.stat().st_ino, 2)
    assert cgroup_scope(str(tmp_path), pure).level == 0
    nested = f"30 1 0:27 /system.slice/x.scope {tmp_path} rw - cgroup2 cgroup2 rw\n"
    assert cgroup_scope(str(leaf), nested).level == 4
    assert cgroup2_root(HYBRID) == "/sys/fs/cgroup/unified" and cgroup2_root(nested) is None
    with pytest.raises(ScopeError, match="not a directory of the cgroup v2 hierarchy .mounted at /sys/fs/"):
        cgroup_scope(str(leaf), HYBRID)
    with pytest.raises(ScopeError, match="no such directory"):
        cgroup_scope(str(tmp_path / "gone"), pure)


def test_the_flag_refuses_what_is_not_a_cgroup(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fleetprof.cli", "agent", "--cgroup", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "argument --cgroup: not a directory of the cgroup v2 hierarchy" in out.stderr, out.stderr


@pytest.fixture
def scope() -> Iterator[CgroupScope]:
    """A cgroup of its own under this process's (tests/support/worker_cgroup.py), removed after."""
    require_bpf()
    own = own_scope()
    if own is None:
        pytest.skip("no writable cgroup v2 hierarchy on this machine")
    path = Path(own.path) / f"scope-test-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    try:
        yield cgroup_scope(str(path))
    finally:
        for _ in range(100):  # its processes were reaped; the kernel lets go of them a moment later
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _in(scope: CgroupScope, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", f'echo $$ > {scope.path}/cgroup.procs && exec "$@"', "sh", *argv])


@pytest.mark.bpf
def test_only_the_cgroups_tasks_are_sampled(scope: CgroupScope, workload_bin: Callable[[str], Path]) -> None:
    """Two copies of one CPU-bound workload, one inside the cgroup (it forks nothing; a shell forks it there)
    and one outside: every sample of the process is of the one inside, none of the one outside."""
    sampler = CpuSampler(SamplerConfig(frequency_hz=199, interval_s=1.0, off_cpu=False, scope=scope))
    try:
        sampler.drain()
        argv = [str(workload_bin("two_funcs")), "1.0", "50"]
        inside, outside = _in(scope, argv), subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        per_pid: collections.Counter = collections.Counter()
        while inside.poll() is None or outside.poll() is None:
            time.sleep(0.3)
            for s in sampler.drain().samples:
                per_pid[s.tgid] += s.count
        for s in sampler.drain().samples:
            per_pid[s.tgid] += s.count
        print(per_pid.most_common(5))
        # ~199 samples of its 1 s of CPU (a lower bar: a loaded machine delays the timer, never adds)
        assert per_pid[inside.pid] >= 50, per_pid
        assert per_pid[outside.pid] == 0
        assert set(per_pid) == {inside.pid}, per_pid  # nothing else of the node either
    finally:
        sampler.close()


@pytest.mark.bpf
def test_only_the_cgroups_syscalls_are_counted(
    scope: CgroupScope, workload_bin: Callable[[str], Path]
) -> None:
    tracer = SyscallTracer(SyscallConfig(latency_sample_every=0, scope=scope))
    try:
        tracer.drain()
        argv = [str(workload_bin("getppid_n")), "5000", "1"]
        inside, outside = _in(scope, argv), subprocess.Popen(argv)
        assert inside.wait(60) == 0 and outside.wait(60) == 0
        per_pid: collections.Counter = collections.Counter()
        for st in tracer.drain().stats:
            if st.name == "getppid":
                per_pid[st.tgid] += st.count
        assert per_pid == {inside.pid: 5000}, per_pid  # exactly its calls; none of the other's
    finally:
        tracer.close()
