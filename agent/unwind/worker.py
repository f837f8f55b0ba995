"""Unwind tables built in a process of their own.

Building a table is pure-Python CPU work (0.45 s for libLLVM's million rows). Run on a thread of the agent,
it would hold the agent's GIL in 5 ms turns against the threads that must answer the kernel at once: the
one that describes new processes while they live reads a dozen /proc files each, and every read waits
for a turn (measured: 2,000 such reads took 18x longer while a build ran; a process that lived 1.5 s went
undescribed). So the agent opens each file (inside the tenant's root, while its process lives) and hands
the descriptor over a Unix socket (SCM_RIGHTS) to this worker, which parses it and sends the rows back.
The worker also keeps a tenant's hostile call-frame information out of the agent's own heap: it runs under
an address-space limit, a build that outlives its deadline is killed with the worker, and the agent starts
another for the next file.

Protocol (one request at a time): the agent sends one byte with the file's descriptor; the worker answers
RESPONSE (status, delta, rows, message length), then the message (an ElfError's reason and text) or the
rows: `rows` uint32 pcs, then `rows` uint32 rules.
"""

from __future__ import annotations

import logging
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import threading

import numpy as np

from fleetprof.agent.process.rootfs import MALFORMED, TOO_LARGE
from fleetprof.agent.symbols.elf import PF_X, ElfError, ElfFile, Segment
from fleetprof.agent.unwind.table import UnwindTable, build_table

log = logging.getLogger(__name__)

RESPONSE = struct.Struct("=BqQQ")  # status (0 ok, 1 ElfError, 2 no exec delta), delta, rows, message bytes
DEADLINE_S = 60.0  # for one file: libLLVM takes 0.5 s
ADDRESS_SPACE = 2 << 30  # the worker's RLIMIT_AS: Python and numpy need ~0.5 GB of it, libLLVM's build 40 MB


class TableWorker:
    """The agent's side: `build(fd)` -> (table, delta), or ElfError. Thread-safe (one request at a time);
    the worker starts at the first request and is restarted after it died or missed a deadline."""

    def __init__(self, deadline_s: float = DEADLINE_S) -> None:
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    def build(self, fd: int) -> tuple[UnwindTable, int]:
        """The table of the open file `fd` (closed here) and its executable segments' p_vaddr - p_offset."""
        try:
            with self._lock:
                sock = self._started()
                try:
                    socket.send_fds(sock, [b"b"], [fd])
                    head = self._read(sock, RESPONSE.size)
                    status, delta, rows, message = RESPONSE.unpack(head)
                    body = self._read(sock, message if status else 8 * rows)
                except (OSError, TimeoutError) as e:
                    self._stop()
                    raise ElfError(f"the table worker failed on this file ({e}): skipped", TOO_LARGE) from e
        finally:
            os.close(fd)
        if status:
            reason, _, text = body.decode("utf-8", "replace").partition("\n")
            raise ElfError(text, reason)
        pcs = np.frombuffer(body, dtype=np.uint32, count=rows)
        rules = np.frombuffer(body, dtype=np.uint32, count=rows, offset=4 * rows)
        return UnwindTable(pcs, rules), delta

    def _started(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        os.set_inheritable(theirs.fileno(), True)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fleetprof.agent.unwind.worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        theirs.close()
        self._sock = mine
        return mine

    def _read(self, sock: socket.socket, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            ready, _, _ = select.select([sock], [], [], self._deadline_s)
            if not ready:
                raise TimeoutError(f"no answer in {self._deadline_s:g} s")
            part = sock.recv(min(n - got, 1 << 20))
            if not part:
                raise OSError("the table worker exited")
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        with self._lock:
            self._stop()


def exec_delta(segments: tuple[Segment, ...]) -> int | None:
    """p_vaddr - p_offset of the file's executable segments, or None when they disagree (then a file
    address cannot be derived from a mapping's offset alone)."""
    deltas = {s.vaddr - s.offset for s in segments if s.flags & PF_X}
    if len(deltas) > 1:
        return None
    return deltas.pop() if deltas else 0


def _answer(sock: socket.socket, fd: int) -> None:
    try:
        with ElfFile(fd) as elf:  # owns fd from here
            delta = exec_delta(elf.load_segments)
            if delta is None:
                raise ElfError("executable segments at different offsets from their addresses", MALFORMED)
            table = build_table(elf)
    except (ElfError, OSError) as e:
        reason = getattr(e, "reason", MALFORMED)
        text = f"{reason}\n{e}".encode()
        sock.sendall(RESPONSE.pack(1, 0, 0, len(text)) + text)
        return
    pcs = np.ascontiguousarray(table.pcs, dtype=np.uint32)
    rules = np.ascontiguousarray(table.rules, dtype=np.uint32)
    sock.sendall(RESPONSE.pack(0, delta, len(pcs), 0))
    sock.sendall(pcs.tobytes())
    sock.sendall(rules.tobytes())


def serve(sock: socket.socket) -> None:
    """The worker's loop: until the agent closes its end."""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 4)
        if not msg:
            return
        for extra in fds[1:]:
            os.close(extra)
        if fds:
            _answer(sock, fds[0])
        else:
            text = f"{MALFORMED}\nno file descriptor came with the request".encode()
            sock.sendall(RESPONSE.pack(1, 0, 0, len(text)) + text)


if __name__ == "__main__":
    from fleetprof.procname import set_thread_name

    set_thread_name("fleetprof-unwind")  # comm "fleetprof-unwin": not one more python3 beside the agent
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    try:
        serve(socket.socket(fileno=int(sys.argv[1])))
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass
