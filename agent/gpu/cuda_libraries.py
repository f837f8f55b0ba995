"""The CUDA libraries a process maps, found for the agent's uprobes: each file's identity, the path that
reaches exactly the mapped inode, and where its probed functions are (file offsets, from its own .dynsym).

The file is reached as the process maps it: /proc/PID/map_files/START-END, the exact mapped inode (inside
its mount namespace, deleted or not), never a path a tenant's symlink could redirect; its exports are read by
our own ELF reader (agent/symbols/elf.py: pread, capped), and the kernel is given file offsets, so nothing
needs the file again to detach. A file that cannot be read is counted by reason and left out.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterable

from fleetprof.agent.cuda_api import RUNTIME, library_kind, wanted_functions
from fleetprof.agent.model import CudaLibrary, Mapping, ProcessInfo
from fleetprof.agent.process.rootfs import open_file
from fleetprof.agent.symbols.elf import SHT_DYNSYM, ElfError, ElfFile, Segment

log = logging.getLogger(__name__)

ERROR_REASONS = ("unreadable", "malformed")  # why a file was left unprobed

# -- the files' exported functions -----------------------------------------------------------------------

_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym: name, info, other, shndx, value, size
STT_FUNC, STT_GNU_IFUNC = 2, 10


def exported_functions(elf: ElfFile, wanted: Iterable[str]) -> dict[str, int]:
    """File offsets of the `wanted` functions that `elf` exports (defined in its .dynsym), for uprobes."""
    names = set(wanted)
    sec = next((s for s in elf.sections if s.type == SHT_DYNSYM and s.size), None)
    if sec is None:
        return {}
    if not 0 < sec.link < len(elf.sections):
        raise ElfError(f"{sec.name}: string table index {sec.link} out of range")
    syms = elf.section_data(sec)
    strings = bytes(elf.section_data(elf.sections[sec.link]))
    out: dict[str, int] = {}
    for off in range(0, len(syms) - _SYM.size + 1, _SYM.size):
        st_name, info, _other, shndx, value, _size = _SYM.unpack_from(syms, off)
        if shndx == 0 or (info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC) or not value:
            continue
        end = strings.find(b"\0", st_name)
        name = strings[st_name : end if end >= 0 else len(strings)].decode("utf-8", "replace")
        if name in names and name not in out:
            where = vaddr_to_offset(elf.load_segments, value)
            if where is not None:
                out[name] = where
    return out


def vaddr_to_offset(segments: Iterable[Segment], vaddr: int) -> int | None:
    """The file offset of ELF virtual address `vaddr` (what a uprobe is set at), through its PT_LOAD."""
    for seg in segments:
        if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
            return vaddr - seg.vaddr + seg.offset
    return None


def cuda_libraries(
    info: ProcessInfo,
    known: Callable[[tuple[int, int, int]], bool],
    errors: dict[str, int],
    proc_root: str = "/proc",
) -> list[CudaLibrary]:
    """The CUDA libraries `info` maps; those `known` (probed already, or refused before) without their
    offsets read again. Files that cannot be read are counted in `errors` and left out."""
    found: dict[tuple[int, int, int], tuple[str, list[Mapping]]] = {}
    for m in info.mappings:
        if m.is_file:
            kind = library_kind(os.path.basename(m.file_path))
            if kind is not None:
                found.setdefault((m.dev_major, m.dev_minor, m.inode), (kind, []))[1].append(m)
    out = []
    for key, (kind, maps) in found.items():
        text = tuple((m.start, m.end) for m in maps if m.is_exec) if kind == RUNTIME else ()
        m = next((m for m in maps if m.is_exec), maps[0])
        path = f"{proc_root}/{info.pid}/map_files/{m.start:x}-{m.end:x}"
        if known(key):
            out.append(CudaLibrary(key, kind, path, {}, text))
            continue
        try:
            with ElfFile(open_file(path)) as elf:
                offsets = exported_functions(elf, wanted_functions(kind))
        except ElfError as e:
            errors["malformed"] = errors.get("malformed", 0) + 1
            log.info("CUDA library %s (%s) not probed: %s", m.file_path, path, e)
            continue
        except OSError as e:
            errors["unreadable"] = errors.get("unreadable", 0) + 1
            log.info("CUDA library %s (%s) not probed: %s", m.file_path, path, e)
            continue
        out.append(CudaLibrary(key, kind, path, offsets, text))
    return out
