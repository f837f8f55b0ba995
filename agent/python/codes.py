"""Name CPython frames: code object address -> `qualname (file:line)`, read from the target's memory.

Code objects are read from /proc/PID/mem (one pread for the object, one per string), cached per
(process, code address, qualname fingerprint) in a bounded LRU. They are read as soon as BPF announces a
new stack (agent/bpf/cpu_sampler.c python_new; `prename`), not only at the drain: by then a short-lived
process is gone and a code object made by an import or an exec() may be freed, its memory reused (measured:
88% of the samples of a process that imports a module every 0.2 s were unnamed when read at the drain).
Each sampled frame carries bits of its co_qualname pointer from the moment of the sample, so a frame whose
code object was replaced before it was read is shown as freed, never under a newer name; a cached entry
keeps a fingerprint (its filename, qualname and line table pointers and its first line) and is re-checked
once per window against what lives at its address (another object with the same qualname pointer there:
read again). A process that has exited keeps the names it had. Frames that cannot be named are counted by
reason (UNNAMED_*).

Lines: the frame's instruction offset is decoded through co_linetable (the 3.11+ location table, see
CPython's Objects/locations.md), so a caller's frame names its call site and the leaf the line it runs:
in 3.12+ an inlined list comprehension (PEP 709) shows as its own line of the enclosing function.
"""

from __future__ import annotations

import os
import struct
import threading
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

from fleetprof.agent.model import Frame
from fleetprof.agent.python.detect import PythonProcess
from fleetprof.agent.python.offsets import Offsets

PYTHON_MODULE = "[python]"
MAX_STRING = 1024  # longer names and paths are cut
MAX_LINETABLE = 1 << 16
_CODE_READ = 144  # bytes of PyCodeObject read: through co_linetable (136) on 3.11-3.13


@dataclass(frozen=True)
class CodeInfo:
    qualname: str
    filename: str
    firstlineno: int
    linetable: bytes
    fingerprint: bytes
    qualname_tag: int  # bits 4-27 of the co_qualname pointer, as BPF records them
    # instruction index -> its frame: a hot code object is sampled at a few instructions thousands of times
    # (decoding the line table from its start each time was a quarter of a busy node's drain time)
    frames: dict[int, Frame] = field(default_factory=dict, compare=False, repr=False)
    # line -> its one Frame: the instructions of a line share it (as a function's addresses share one in
    # the symbolizer), so stacks that differ only in the instruction are equal tuples of the same objects
    lines: dict[int, Frame] = field(default_factory=dict, compare=False, repr=False)
    # the line table decoded (line_ranges), once a second instruction of the code object is met: a large
    # function of a deep PyTorch stack is sampled at many instructions, and each walked the whole table
    ranges: list[tuple[list[int], list[int]]] = field(default_factory=list, compare=False, repr=False)

    def frame(self, line: int) -> Frame:
        f = self.lines.get(line)
        if f is None:
            f = self.lines[line] = Frame(
                f"{self.qualname} ({os.path.basename(self.filename)}:{line})", self.filename
            )
        return f

    def frame_at(self, index: int) -> Frame:
        """The frame of instruction `index` (code units from the start of its bytecode)."""
        f = self.frames.get(index)
        if f is None:
            if not self.frames:
                line = line_at(self.linetable, self.firstlineno, index)
            else:
                if not self.ranges:
                    self.ranges.append(line_ranges(self.linetable, self.firstlineno))
                line = _line_in(self.ranges[0], self.firstlineno, index)
            f = self.frames[index] = self.frame(line)
        return f


# Why a sampled frame's code object could not be named (the agent's python_unnamed_frames self-metric).
UNNAMED_EXITED = "exited"  # the process was gone before its code objects were read
UNNAMED_REPLACED = "replaced"  # freed before it was read: another code object is there now
UNNAMED_UNREADABLE = "unreadable"  # no readable memory at the address
UNNAMED_NOT_CODE = "not_code"  # memory there, but no code object's names in it
UNNAMED_REASONS = (UNNAMED_EXITED, UNNAMED_REPLACED, UNNAMED_UNREADABLE, UNNAMED_NOT_CODE)


class _Entry:
    __slots__ = ("info", "window", "reason")

    def __init__(self, info: CodeInfo | None, window: int, reason: str = ""):
        self.info = info
        self.window = window
        self.reason = reason  # why info is None


class CodeNames:
    """Frames for (process, code address, instruction offset); thread-safe, bounded by `max_codes`.

    Entries are keyed by the sample's qualname fingerprint too: a code object read while it lived (named as
    soon as BPF announced its stack, `prename`) keeps naming the samples taken of it after it was freed and
    its memory reused by another code object, which gets an entry of its own."""

    def __init__(self, proc_root: str = "/proc", max_codes: int = 32768) -> None:
        self._proc_root = proc_root
        self._max = max_codes
        self._lock = threading.Lock()
        self._codes: OrderedDict[tuple[int, int, int, int], _Entry] = OrderedDict()
        self._window = 0
        self._mem: dict[int, int | None] = {}  # pid -> open /proc/PID/mem fd (None: cannot read) this window
        self.reads = 0
        self.read_failures = 0
        self.stale = 0  # frames whose code object was replaced between the sample and the drain
        self.unnamed: dict[str, int] = dict.fromkeys(UNNAMED_REASONS, 0)  # sampled frames, by reason

    def begin_window(self) -> None:
        """Cached names are re-checked against live memory once per window; close last window's files."""
        with self._lock:
            self._window += 1
            for fd in self._mem.values():
                if fd is not None:
                    os.close(fd)
            self._mem.clear()

    def forget(self, pid: int) -> None:
        with self._lock:
            for key in [k for k in self._codes if k[0] == pid]:
                del self._codes[key]
            fd = self._mem.pop(pid, None)
            if fd is not None:
                os.close(fd)

    def __len__(self) -> int:
        return len(self._codes)

    def take_unnamed(self) -> dict[str, int]:
        """Sampled frames left unnamed since the last call, by reason."""
        with self._lock:
            out, self.unnamed = self.unnamed, dict.fromkeys(UNNAMED_REASONS, 0)
        return out

    def prename(self, proc: PythonProcess, code: int, qualname_tag: int) -> None:
        """Read the code object now, while it (and its process) lives: BPF has just sampled it."""
        with self._lock:
            self._info(proc, code, qualname_tag)

    def frame(self, proc: PythonProcess, code: int, instr: int, qualname_tag: int, weight: int = 1) -> Frame:
        """`qualname_tag`: bits 4-27 of co_qualname's address when BPF sampled the frame; `weight`: the
        samples the frame stands for, counted by reason when it cannot be named."""
        assert proc.offsets is not None
        with self._lock:
            info, reason = self._info(proc, code, qualname_tag)
            if info is None:
                self.unnamed[reason] += weight
        if info is None:
            if reason == UNNAMED_REPLACED:
                self.stale += 1
                return Frame(f"[freed python code] (0x{code:x})", PYTHON_MODULE)
            return Frame(f"[unknown python code] (0x{code:x})", PYTHON_MODULE)
        return info.frame_at((instr - proc.offsets.code_adaptive) // 2)

    def _info(self, proc: PythonProcess, code: int, tag: int) -> tuple[CodeInfo | None, str]:
        """The code object sampled at `code` with qualname fingerprint `tag`, or None and why."""
        assert proc.offsets is not None
        key = (proc.pid, proc.start_ticks, code, tag)
        entry = self._codes.get(key)
        if entry is not None:
            self._codes.move_to_end(key)
            if entry.window == self._window:
                return entry.info, entry.reason
            fd = self._fd(proc.pid)
            head = self._read(fd, code, _CODE_READ) if fd is not None else None
            if head is None or (
                entry.info is not None and _fingerprint(head, proc.offsets) == entry.info.fingerprint
            ):
                entry.window = self._window  # unchanged, or the process is gone: what we had is all there is
                return entry.info, entry.reason
            if entry.info is not None and _tag(head, proc.offsets) != tag:
                # Replaced since: the entry names the object sampled, read while it lived.
                entry.window = self._window
                return entry.info, entry.reason
            # Another object with the same qualname pointer there now (or a failed read to retry): read again.
        fd = self._fd(proc.pid)
        if fd is None:
            info, reason = None, UNNAMED_EXITED
        else:
            info, reason = self._load(fd, code, proc.offsets)
        if info is not None and info.qualname_tag != tag:
            # The sampled object was freed before it could be read; what is there now gets its own entry.
            self._put((proc.pid, proc.start_ticks, code, info.qualname_tag), _Entry(info, self._window))
            info, reason = None, UNNAMED_REPLACED
        self._put(key, _Entry(info, self._window, reason))
        return info, reason

    def _put(self, key: tuple[int, int, int, int], entry: _Entry) -> None:
        self._codes[key] = entry
        self._codes.move_to_end(key)
        if len(self._codes) > self._max:
            self._codes.popitem(last=False)

    def _fd(self, pid: int) -> int | None:
        if pid not in self._mem:
            try:
                self._mem[pid] = os.open(f"{self._proc_root}/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._mem[pid] = None
        return self._mem[pid]

    def _read(self, fd: int, addr: int, size: int) -> bytes | None:
        self.reads += 1
        try:
            data = os.pread(fd, size, addr)
        except (OSError, OverflowError, ValueError):
            data = b""
        if len(data) != size:
            self.read_failures += 1
            return None
        return data

    def _load(self, fd: int, code: int, off: Offsets) -> tuple[CodeInfo | None, str]:
        head = self._read(fd, code, _CODE_READ)
        if head is None:
            return None, UNNAMED_UNREADABLE
        filename_p, qualname_p, linetable_p = (
            struct.unpack_from("<Q", head, o)[0]
            for o in (off.code_filename, off.code_qualname, off.code_linetable)
        )
        firstlineno = struct.unpack_from("<i", head, off.code_firstlineno)[0]
        qualname = self._string(fd, qualname_p, off)
        filename = self._string(fd, filename_p, off)
        if qualname is None or filename is None:
            return None, UNNAMED_NOT_CODE
        linetable = self._bytes(fd, linetable_p) or b""
        info = CodeInfo(qualname, filename, firstlineno, linetable, _fingerprint(head, off), _tag(head, off))
        return info, ""

    def _string(self, fd: int, addr: int, off: Offsets) -> str | None:
        """A compact str object's text (what code objects' names and paths are)."""
        head = self._read(fd, addr, off.compact_data) if addr else None
        if head is None:
            return None
        length, state = struct.unpack_from("<qI", head, 16)[0], struct.unpack_from("<I", head, 32)[0]
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length:
            return None
        n = min(length, MAX_STRING)
        data = self._read(fd, addr + (off.ascii_data if ascii_ else off.compact_data), n * kind) if n else b""
        if data is None:
            return None
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        return data.decode(codec, "replace")

    def _bytes(self, fd: int, addr: int) -> bytes | None:
        """A bytes object's content (co_linetable): ob_size at 16, data at 32 (3.11-3.13)."""
        head = self._read(fd, addr, 32) if addr else None
        if head is None:
            return None
        size = struct.unpack_from("<q", head, 16)[0]
        if not 0 <= size <= MAX_LINETABLE:
            return None
        return self._read(fd, addr + 32, size) if size else b""


def _tag(head: bytes, off: Offsets) -> int:
    """Bits 4-27 of the code object's co_qualname pointer: what BPF records of it with each frame."""
    return (struct.unpack_from("<Q", head, off.code_qualname)[0] >> 4) & 0xFFFFFF


def _fingerprint(head: bytes, off: Offsets) -> bytes:
    return (
        head[off.code_filename : off.code_filename + 8]
        + head[off.code_qualname : off.code_qualname + 8]
        + head[off.code_linetable : off.code_linetable + 8]
        + head[off.code_firstlineno : off.code_firstlineno + 4]
    )


def line_at(table: bytes, firstlineno: int, index: int) -> int:
    """The source line of instruction `index` (code units) from a 3.11+ co_linetable; firstlineno when
    the table says nothing (or the index lies outside it)."""
    return _line_in(line_ranges(table, firstlineno, max(index, 0) + 1), firstlineno, index)


def _line_in(ranges: tuple[list[int], list[int]], firstlineno: int, index: int) -> int:
    ends, lines = ranges
    at = bisect_right(ends, max(index, 0))
    return lines[at] if at < len(lines) else firstlineno


def line_ranges(table: bytes, firstlineno: int, upto: int | None = None) -> tuple[list[int], list[int]]:
    """A 3.11+ co_linetable decoded: the end (code units, exclusive) of each entry's instructions, in
    order, and its line (firstlineno for an entry without a location). `upto`: stop once an entry reaches
    past that many code units. The varints are read inline: a function call per field was a third of the
    decoding, and every new code object of a process is decoded once (hundreds a drain on a PyTorch job)."""
    ends: list[int] = []
    lines: list[int] = []
    line = firstlineno
    addr = 0
    i = 0
    n = len(table)
    stop = (1 << 62) if upto is None else upto
    while i < n and addr < stop:
        first = table[i]
        i += 1
        code = (first >> 3) & 15
        addr += (first & 7) + 1
        if code == 15:  # no location
            ends.append(addr)
            lines.append(firstlineno)
            continue
        if code >= 13:  # 14, long form: line delta, end line delta, column, end column; 13, no column
            fields = 4 if code == 14 else 1
            delta = 0
            for k in range(fields):  # varints of 6 bits a byte, the 64 bit saying more follow
                b = table[i] if i < n else 0
                i += 1
                value, shift = b & 63, 0
                while b & 64 and i < n:
                    b = table[i]
                    i += 1
                    shift += 6
                    value |= (b & 63) << shift
                if k == 0:  # the line delta, signed: its low bit is the sign
                    delta = -(value >> 1) if value & 1 else value >> 1
            line += delta
        elif code >= 10:  # one-line forms: line delta in the code, two column bytes
            line += code - 10
            i += 2
        else:  # short form: same line, one column byte
            i += 1
        ends.append(addr)
        lines.append(line)
    return ends, lines
