"""Where a mapped file's function symbols come from, best first; separate debug files are read inside the
process's root.

Distributions strip their binaries and ship the symbols apart. The places, in the order they are tried:
  1. the build-id path, /usr/lib/debug/.build-id/xx/yyyy.debug (Debian's -dbgsym and Fedora's -debuginfo
     packages put it there): in the process's root, then in the node's;
  2. .gnu_debuglink: a file name and the CRC-32 of that file's contents, looked for where GDB looks (beside
     the binary, in its .debug/ directory, under /usr/lib/debug/ plus its directory), in the process's root.
     A candidate is used only when its CRC matches, and its build id where both files have one;
  3. the file's own .symtab (it was not stripped);
  4. MiniDebugInfo: .gnu_debugdata, an xz-compressed ELF in the binary itself holding the symbols of the
     functions .dynsym lacks (Fedora and RHEL ship it): with .dynsym, a complete table (elf.py reads it);
  5. a debuginfod server's answer for the build id, from the agent's on-disk cache of them
     (agent/symbols/debuginfod.py); the symbolizer asks the servers, in the background, for files that
     nothing above gave a complete table;
  6. .dynsym alone: exported functions only. A stripped executable exports none of its own.
Debug files are tenants' files like the binaries: opened with open_in_root (never followed out of the
root), read with elf.py's caps; a file checked by CRC is read whole, so it is capped (MAX_DEBUGLINK_BYTES).
"""

from __future__ import annotations

import os
import posixpath
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from fleetprof.agent.process.rootfs import TOO_LARGE, open_file, open_in_root
from fleetprof.agent.symbols.elf import (
    ElfError,
    ElfFile,
    SymbolTable,
    build_id_symbols,
    debug_symbols,
    has_symtab,
)

# Where a table came from (see the module docstring); tables from all but DYNSYM name every function.
BUILD_ID = "build_id"
DEBUGLINK = "debuglink"
SYMTAB = "symtab"
MINIDEBUGINFO = "minidebuginfo"
DEBUGINFOD = "debuginfod"
DYNSYM = "dynsym"
SOURCES = (BUILD_ID, DEBUGLINK, SYMTAB, MINIDEBUGINFO, DEBUGINFOD, DYNSYM)

# The global debug directory of GDB's debuglink search (its `debug-file-directory`).
GLOBAL_DEBUG_DIR = "/usr/lib/debug"
# A debuglink candidate is read whole for its CRC: real debug files are tens to hundreds of MiB (a
# libLLVM's with full DWARF ~1-2 GiB, which is refused and counted as too_large).
MAX_DEBUGLINK_BYTES = 1 << 30
_CRC_STEP = 1 << 20

ErrorSink = Callable[[Exception], object]


@dataclass(frozen=True)
class FoundSymbols:
    table: SymbolTable
    source: str  # one of SOURCES

    @property
    def complete(self) -> bool:
        """Whether the table names every function the file has (all but .dynsym alone)."""
        return self.source != DYNSYM


def find_symbols(
    elf: ElfFile,
    path: str,
    root: str,
    host_debug_root: str | None = "/",
    debuginfod_cached: Callable[[str], str | None] | None = None,
    on_error: ErrorSink | None = None,
) -> FoundSymbols:
    """The best symbol table for `elf`, the file a process maps from `path` (as its /proc/PID/maps names
    it) with `root` its root directory (/proc/PID/root). `host_debug_root` stands for the node's / in the
    build-id lookup (None: only the process's root). `debuginfod_cached(build_id)` is a debug file already
    fetched for the build id, or None. Files that cannot be used are skipped, each refusal given to
    `on_error` (missing files included)."""
    roots = (root,) if host_debug_root is None else (root, host_debug_root)
    table = build_id_symbols(elf, roots, on_error)
    if table is not None:
        return FoundSymbols(table, BUILD_ID)
    table = debuglink_symbols(elf, path, root, on_error)
    if table is not None:
        return FoundSymbols(table, DEBUGLINK)
    if has_symtab(elf):
        return FoundSymbols(SymbolTable.from_elf(elf), SYMTAB)
    own = SymbolTable.from_elf(elf)  # .dynsym, merged with MiniDebugInfo's .symtab where there is one
    if elf.section(".gnu_debugdata") is not None:
        return FoundSymbols(own, MINIDEBUGINFO)
    if elf.build_id and debuginfod_cached is not None:
        fetched = debuginfod_cached(elf.build_id)
        if fetched is not None:
            table = fetched_symbols(fetched, elf.build_id, on_error)
            if table is not None:
                return FoundSymbols(table, DEBUGINFOD)
    return FoundSymbols(own, DYNSYM)


def fetched_symbols(path: str, build_id: str, on_error: ErrorSink | None = None) -> SymbolTable | None:
    """The .symtab of a debug file the agent fetched (a path of its own filesystem), if it is the build's."""
    try:
        with ElfFile(open_file(path)) as dbg:
            return debug_symbols(dbg, build_id)
    except (OSError, ElfError) as e:
        if on_error is not None:
            on_error(e)
        return None


def debuglink_candidates(path: str, name: str) -> list[str]:
    """Where GDB looks for the debug file that `.gnu_debuglink` names, for a binary at `path`: beside it,
    in .debug/ beside it, and under the global debug directory plus the binary's directory. Nowhere for a
    name that is not a plain file name (the section is the tenant's: "../../x" names no debug file)."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        return []
    directory = posixpath.dirname(posixpath.normpath(path))
    out = [
        posixpath.join(directory, name),
        posixpath.join(directory, ".debug", name),
        GLOBAL_DEBUG_DIR + posixpath.join(directory, name),
    ]
    own = posixpath.normpath(path)
    return [c for c in out if c != own]  # a link that names the binary itself names no debug file


def debuglink_symbols(
    elf: ElfFile, path: str, root: str, on_error: ErrorSink | None = None
) -> SymbolTable | None:
    """The .symtab of the file `elf`'s .gnu_debuglink names, found inside `root` with a matching CRC."""
    if elf.debuglink is None or elf.debuglink_crc is None or not path.startswith("/"):
        return None
    for candidate in debuglink_candidates(path, elf.debuglink):
        try:
            fd = open_in_root(root, candidate)
        except OSError as e:
            if on_error is not None:
                on_error(e)
            continue
        try:
            crc = file_crc32(fd)
        except (OSError, ElfError) as e:
            os.close(fd)
            if on_error is not None:
                on_error(e)
            continue
        if crc != elf.debuglink_crc:
            os.close(fd)  # another build's debug file (stale), or not one at all: the next place
            continue
        try:
            with ElfFile(fd) as dbg:
                # Build ids, where both files have one, must agree as well: a CRC is 32 bits.
                table = debug_symbols(dbg, elf.build_id if dbg.build_id else None)
        except (OSError, ElfError) as e:
            if on_error is not None:
                on_error(e)
            continue
        if table is not None:
            return table
    return None


def file_crc32(fd: int, limit: int = MAX_DEBUGLINK_BYTES) -> int:
    """The CRC-32 (zlib's: the one .gnu_debuglink records) of the whole regular file `fd`, read with pread
    a step at a time; ElfError (too_large) past `limit` bytes."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise ElfError(f"debug file of {size} bytes, over the {limit}-byte cap for its CRC", TOO_LARGE)
    crc, offset = 0, 0
    while offset < size:
        chunk = os.pread(fd, min(_CRC_STEP, size - offset), offset)
        if not chunk:
            break  # it shrank under us: the CRC will not match
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc
