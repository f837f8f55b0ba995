"""Is this process a CPython we can walk? Decided from its mappings, once per interpreter file.

A process runs CPython when an executable mapping is a `python3.X` binary or a `libpython3.X.so` (pyenv and
most distributions link libpython into the binary or ship it beside it). For that file, read once per
(device, inode): the version (`Py_Version`, else the file name), the ELF address of `_PyRuntime`, and the
struct offsets (tabled, or from `_Py_DebugOffsets` in .data). Per process only the load address and the
pid namespace are new: one stat() on top of the mappings the process table already read.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from fleetprof.agent.model import Mapping
from fleetprof.agent.process.rootfs import FileErrors, open_file, open_in_root
from fleetprof.agent.python.offsets import (
    DEBUG_OFFSETS_BYTES,
    FIRST_DEBUG_OFFSETS,
    LAST_KNOWN,
    TABLE,
    Offsets,
    from_debug_offsets,
)
from fleetprof.agent.symbols.elf import ElfError, ElfFile, Segment

INTERPRETER_NAME = re.compile(r"^(?:lib)?python(\d)\.(\d+)[a-z]*(?:\.so(?:\.[\d.]+)?)?$")
SHT_SYMTAB, SHT_DYNSYM = 2, 11

# Why a CPython process is not walked (values of the python_processes self-metric's outcome label).
SUPPORTED = "supported"
UNSUPPORTED_VERSION = "unsupported_version"
NO_SYMBOLS = "no_runtime_symbol"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Interpreter:
    """What one interpreter file (binary or libpython) tells: version, _PyRuntime's ELF address, layout."""

    version: tuple[int, int] | None
    runtime_vaddr: int
    offsets: Offsets | None
    segments: tuple[Segment, ...]
    outcome: str
    code_type_vaddr: int = 0  # PyCode_Type's ELF address (0: not exported)


@dataclass(frozen=True)
class PythonProcess:
    pid: int
    start_ticks: int
    version: tuple[int, int] | None
    outcome: str
    offsets: Offsets | None = None
    runtime: int = 0  # address of _PyRuntime in the process
    pidns: tuple[int, int] = (0, 0)  # (nsfs dev in the kernel's encoding, inode)
    code_type: int = 0  # address of PyCode_Type in the process (0: unknown): BPF checks frames' code with it

    @property
    def supported(self) -> bool:
        return self.outcome == SUPPORTED


class Detector:
    """Per-file analysis cache (bounded LRU by count); thread-safe. Interpreter files are the tenant's: they
    are opened inside the process's root and read within caps, refusals counted in `file_errors`."""

    def __init__(
        self, proc_root: str = "/proc", max_files: int = 64, file_errors: FileErrors | None = None
    ) -> None:
        self._proc_root = proc_root
        self._max = max_files
        self.file_errors = file_errors if file_errors is not None else FileErrors()
        self._files: OrderedDict[tuple[int, int, int], Interpreter] = OrderedDict()
        self._lock = threading.Lock()

    def detect(self, pid: int, start_ticks: int, mappings: Sequence[Mapping]) -> PythonProcess | None:
        """The process's CPython, or None when it runs none. Never raises for a live process."""
        candidates = [m for m in mappings if m.is_file and INTERPRETER_NAME.match(m.display_name)]
        if not candidates:
            return None
        # libpython before the binary: an embedding or pyenv binary keeps the runtime in the library.
        candidates.sort(key=lambda m: not m.display_name.startswith("lib"))
        best: tuple[Mapping, Interpreter] | None = None
        for m in candidates:
            interp = self._interpreter(pid, m)
            if best is None or (interp.outcome == SUPPORTED and best[1].outcome != SUPPORTED):
                best = (m, interp)
            if interp.runtime_vaddr:
                best = (m, interp)
                break
        assert best is not None
        mapping, interp = best
        if interp.outcome != SUPPORTED:
            return PythonProcess(pid, start_ticks, interp.version, interp.outcome)
        bias = _load_bias(interp.segments, mapping)
        try:
            st = os.stat(f"{self._proc_root}/{pid}/ns/pid")
        except OSError:
            return PythonProcess(pid, start_ticks, interp.version, UNREADABLE)
        pidns = ((os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino)
        code_type = bias + interp.code_type_vaddr if interp.code_type_vaddr else 0
        return PythonProcess(
            pid,
            start_ticks,
            interp.version,
            SUPPORTED,
            interp.offsets,
            bias + interp.runtime_vaddr,
            pidns,
            code_type,
        )

    def _interpreter(self, pid: int, m: Mapping) -> Interpreter:
        key = (m.dev_major, m.dev_minor, m.inode)
        with self._lock:
            cached = self._files.get(key)
            if cached is not None:
                self._files.move_to_end(key)
                return cached
        interp = self._analyse(pid, m)
        with self._lock:
            self._files[key] = interp
            while len(self._files) > self._max:
                self._files.popitem(last=False)
        return interp

    def _analyse(self, pid: int, m: Mapping) -> Interpreter:
        name_version = INTERPRETER_NAME.match(m.display_name)
        assert name_version is not None
        version: tuple[int, int] | None = (int(name_version[1]), int(name_version[2]))
        proc = f"{self._proc_root}/{pid}"
        # The exact mapped file first; else its path inside the process's root, same inode (map_files needs
        # CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE).
        for open_mapped in (
            lambda: open_file(f"{proc}/map_files/{m.start:x}-{m.end:x}"),
            lambda: open_in_root(f"{proc}/root", m.file_path, m.inode),
        ):
            try:
                elf = ElfFile(open_mapped())
            except (OSError, ElfError) as e:
                self.file_errors.count(e)
                continue
            try:
                return _analyse_elf(elf, version)
            except (ElfError, OSError, ValueError, struct.error) as e:
                self.file_errors.count(e)
                return Interpreter(version, 0, None, (), UNREADABLE)
            finally:
                elf.close()
        return Interpreter(version, 0, None, (), UNREADABLE)


def _analyse_elf(elf: ElfFile, version: tuple[int, int] | None) -> Interpreter:
    syms = find_symbols(elf, (b"_PyRuntime", b"Py_Version", b"PyCode_Type"))
    segments = elf.load_segments
    if b"Py_Version" in syms:
        raw = read_vaddr(elf, segments, syms[b"Py_Version"], 4)
        if raw is not None:
            hexversion = struct.unpack("<I", raw)[0]
            version = (hexversion >> 24, (hexversion >> 16) & 0xFF)
    runtime = syms.get(b"_PyRuntime", 0)
    if version is None or version < (3, 11) or version > LAST_KNOWN:
        return Interpreter(version, runtime, None, segments, UNSUPPORTED_VERSION)
    if not runtime:
        return Interpreter(version, 0, None, segments, NO_SYMBOLS)
    if version >= FIRST_DEBUG_OFFSETS:
        blob = read_vaddr(elf, segments, runtime, DEBUG_OFFSETS_BYTES)
        if blob is None:
            return Interpreter(version, runtime, None, segments, UNREADABLE)
        try:
            offsets = from_debug_offsets(blob)
        except ValueError:
            return Interpreter(version, runtime, None, segments, UNSUPPORTED_VERSION)
    else:
        offsets = TABLE[version]
    offsets.check()
    return Interpreter(version, runtime, offsets, segments, SUPPORTED, syms.get(b"PyCode_Type", 0))


def find_symbols(elf: ElfFile, names: Sequence[bytes]) -> dict[bytes, int]:
    """ELF addresses of the named symbols, from .dynsym, else .symtab (names not found are left out)."""
    found: dict[bytes, int] = {}
    for sh_type in (SHT_DYNSYM, SHT_SYMTAB):
        for sec in elf.sections:
            if sec.type != sh_type or not sec.size or not 0 < sec.link < len(elf.sections):
                continue
            strings = elf.section_data(elf.sections[sec.link])
            wanted = {}
            for name in names:
                if name in found:
                    continue
                off = strings.find(b"\0" + name + b"\0")
                if off >= 0:
                    wanted[off + 1] = name
            if not wanted:
                continue
            for st_name, _info, _other, shndx, value, _size in struct.iter_unpack(
                "<IBBHQQ", elf.section_data(sec)
            ):
                if st_name in wanted and shndx != 0 and value:
                    found[wanted.pop(st_name)] = value
        if len(found) == len(names):
            break
    return found


def read_vaddr(elf: ElfFile, segments: Sequence[Segment], vaddr: int, size: int) -> bytes | None:
    """`size` bytes at ELF address `vaddr` as stored in the file (initialised data), or None."""
    for seg in segments:
        if seg.vaddr <= vaddr and vaddr + size <= seg.vaddr + seg.filesz:
            return elf.read(seg.offset + vaddr - seg.vaddr, size)
    return None


def _load_bias(segments: Sequence[Segment], m: Mapping) -> int:
    """Address in the process minus ELF address, from one mapping of the file."""
    for seg in segments:
        if seg.offset <= m.offset < seg.offset + max(seg.filesz, 1):
            return m.start - (m.offset - seg.offset + seg.vaddr)
    return m.start - m.offset  # cannot happen for a mapping of this file's code
