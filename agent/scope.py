"""`--cgroup PATH`: the one cgroup (v2) whose tasks, and its descendants' tasks, the agent samples and
traces, as BPF names it (agent/bpf/scope.h): the directory's inode number (the kernel's cgroup id) and its
depth below the hierarchy's root. For a machine shared with work nobody asked to profile (a systemd slice,
a CI runner's job), and for the test suite, whose agents profile their own worker's processes only."""

from __future__ import annotations

import os
from dataclasses import dataclass


class ScopeError(ValueError):
    """The path names no cgroup of the v2 hierarchy."""


@dataclass(frozen=True)
class CgroupScope:
    path: str
    id: int  # the cgroup directory's inode number: bpf_get_current_ancestor_cgroup_id's value
    level: int  # its depth in the hierarchy (the root is 0)

    def cflags(self) -> list[str]:
        return [f"-DSCOPE_CGROUP_ID={self.id}ULL", f"-DSCOPE_CGROUP_LEVEL={self.level}"]


def _cgroup2_mounts(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, root within the hierarchy) of each cgroup2 mount, from /proc/self/mountinfo's text."""
    out = []
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if sep and rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            out.append((parts[4].replace("\\040", " "), parts[3]))
    return out


def _mountinfo(text: str | None) -> str:
    """`text`, or this process's /proc/self/mountinfo when None."""
    if text is not None:
        return text
    with open("/proc/self/mountinfo") as f:
        return f.read()


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p and p != "."])


def cgroup_scope(path: str, mountinfo: str | None = None) -> CgroupScope:
    """The scope of the cgroup directory `path` (mountinfo: /proc/self/mountinfo's text, read if None).
    Raises ScopeError for a path that is not a cgroup v2 directory. The agent's cgroup namespace must be
    the node's (as the DaemonSet's is): the level counts from the hierarchy's true root."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ScopeError(f"--cgroup {path}: no such directory")
    mounts = _cgroup2_mounts(_mountinfo(mountinfo))
    under = [
        (point, root) for point, root in mounts if real == point or real.startswith(point.rstrip("/") + "/")
    ]
    if not under:
        where = ", ".join(point for point, _ in mounts) or "nowhere here"
        raise ScopeError(f"--cgroup {path}: not a directory of the cgroup v2 hierarchy (mounted at {where})")
    point, root = max(under, key=lambda m: len(m[0]))
    level = _depth(root) + _depth(os.path.relpath(real, point))
    return CgroupScope(real, os.stat(real).st_ino, level)


def cgroup2_root(mountinfo: str | None = None) -> str | None:
    """Where the cgroup v2 hierarchy's root is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified beside
    v1's controllers); None without one."""
    return next((point for point, root in _cgroup2_mounts(_mountinfo(mountinfo)) if root == "/"), None)
