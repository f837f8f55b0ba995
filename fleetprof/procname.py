"""The names the kernel shows for our processes and threads (comm: /proc/PID/comm and task/TID/comm, as
top, ps, perf and our own agent's profiles read them), so that the profiler is not one more "python3".

The kernel keeps 15 bytes of a name (TASK_COMM_LEN 16 with its NUL): "fleetprof-collector" reads
"fleetprof-colle", as systemd-journald reads "systemd-journal". A new thread starts with its creator's
name; `name_process` also gives each thread started later through `threading` its Python name.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
COMM_BYTES = 15
_PREFIX = "fleetprof-"  # dropped from a thread's name: its process already says it ("unwind-tables")

_libc = ctypes.CDLL(None, use_errno=True)


def set_thread_name(name: str) -> None:
    """The calling thread's comm (the main thread's is the process's): the first 15 bytes of `name`."""
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode("utf-8", "replace")[:COMM_BYTES]), 0, 0, 0)


def thread_comm(thread_name: str) -> str:
    """The comm a thread of `thread_name` gets: the name without our prefix, cut to what the kernel keeps
    (bytes, so a multi-byte character is not split into an invalid one)."""
    name = thread_name.removeprefix(_PREFIX).encode("utf-8", "replace")[:COMM_BYTES]
    return name.decode("utf-8", "ignore")


def name_process(name: str) -> None:
    """Name this process (call it from the main thread, before other threads start: they inherit it) and
    every thread started through `threading` from now on after its Python name."""
    set_thread_name(name)
    threading.setprofile(_name_this_thread)


def _name_this_thread(_frame: FrameType, _event: str, _arg: object) -> None:
    # threading installs this as the new thread's profile function just before its run(); the first event
    # it sees is that call. One event, then the thread runs unprofiled.
    sys.setprofile(None)
    set_thread_name(thread_comm(threading.current_thread().name))


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (a child's preexec_fn): children
    of a parent killed with SIGKILL do not live on."""
    _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
