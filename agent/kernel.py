"""The face over the kernel's BPF prerequisites: finds BCC and says in one sentence what is missing."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from types import ModuleType


class BpfUnavailable(RuntimeError):
    """eBPF cannot run here; the message names what is missing and how to get it."""


def missing_prerequisite(modules_root: str = "/lib/modules") -> str | None:
    """The first missing prerequisite for compiling and loading BPF programs, as a sentence, or None."""
    if os.geteuid() != 0:
        return (
            "the agent must run as root (or with CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN) to load eBPF programs"
        )
    release = platform.release()
    build = Path(modules_root) / release / "build"
    if not (build / "include").exists():
        return (
            f"kernel headers for {release} are missing: {build} does not exist "
            "(install them, or run scripts/setup.sh, which links Debian's linux-headers-amd64 there)"
        )
    if (
        not Path("/sys/kernel/tracing/events").exists()
        and not Path("/sys/kernel/debug/tracing/events").exists()
    ):
        return "tracefs is not mounted: run `mount -t tracefs nodev /sys/kernel/tracing`"
    return None


def load_bcc() -> ModuleType:
    """Import BCC after checking prerequisites; raise BpfUnavailable with one clear sentence otherwise."""
    problem = missing_prerequisite()
    if problem:
        raise BpfUnavailable(problem)
    try:
        import bcc  # Debian python3-bpfcc, linked into the venv by scripts/setup.sh
    except ImportError as exc:
        raise BpfUnavailable(
            "BCC's Python module is not importable: install Debian's python3-bpfcc and run scripts/setup.sh "
            f"({exc})"
        ) from exc
    if not hasattr(bcc, "BPF"):
        raise BpfUnavailable(
            "the `bcc` module found is not BCC (PyPI's `bcc` is an unrelated package): "
            "uninstall it and use Debian's python3-bpfcc"
        )
    return bcc
