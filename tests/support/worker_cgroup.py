"""Each pytest process in a cgroup (v2) of its own, made when it starts (tests/conftest.py pytest_configure):
every process it starts is in it too, so the agents its tests start profile those only (`--cgroup`). The
other phase's workers, the other BPF file's processes and the machine's own are not theirs to name,
symbolize and ship: on a busy 2-CPU machine that work was most of what a test agent cost. A test that
moves workloads into cgroups of their own (fake pods') makes those below this one (conftest's own_cgroup,
test_kubernetes_e2e's v2_pods_root); one that cannot starts its agent node-wide (start_agent(node_wide=True)).

None where there is no writable cgroup v2 hierarchy: agents are node-wide there, as before."""

from __future__ import annotations

import os
from pathlib import Path

from fleetprof.agent.scope import cgroup2_root

PREFIX = "fleetprof-test-"


def _own_path() -> str:
    """This process's cgroup v2 path (the "0::" line of /proc/self/cgroup), "/" if it has none."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def enter() -> tuple[Path, Path] | None:
    """Move this process into a new cgroup of its own: (that cgroup, the one it left), or None."""
    root = cgroup2_root()
    if root is None:
        return None
    base = Path(root)
    for stale in base.glob(f"{PREFIX}*"):  # left by runs that were killed: empty ones go
        try:
            stale.rmdir()
        except OSError:
            pass
    mine = base / f"{PREFIX}{os.getpid()}"
    left = base / _own_path().lstrip("/")
    try:
        mine.mkdir(exist_ok=True)
        (mine / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return mine, left


def leave(entered: tuple[Path, Path]) -> None:
    """Back to the cgroup it left; the cgroup made goes once the processes it started are gone."""
    mine, left = entered
    try:
        (left / "cgroup.procs").write_text(str(os.getpid()))
        mine.rmdir()
    except OSError:
        pass  # a process still in it: the next run's enter() removes it once empty
