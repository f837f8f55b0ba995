"""Gives back memory the agent needed only to start: LLVM's heap garbage and its code pages."""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
# BCC compiles BPF C with clang/LLVM in-process: ~85 MB of their code is touched once, then never again.
COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang|clang-cpp)[-.][^/]*\.so")


def clean_compiler_mappings(smaps_text: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of compiler-library mappings that hold no modified page.

    Only those may be dropped: a clean private file page re-faults with identical bytes from the file,
    while a dirty one (relocated data, RELRO) would lose its contents.
    """
    out: list[tuple[int, int, str]] = []
    current: tuple[int, int, str] | None = None
    dirty = anon = 0

    def close() -> None:
        if current is not None and dirty == 0 and anon == 0:
            out.append(current)

    for line in smaps_text.splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            close()
            path = head[5] if len(head) == 6 else ""
            current = None
            if COMPILER_LIBRARIES.search(path):
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = (start, end, path)
            dirty = anon = 0
        elif line.startswith(("Private_Dirty:", "Shared_Dirty:")):
            dirty += int(head[1])
        elif line.startswith("Anonymous:"):
            anon += int(head[1])
    close()
    return out


class HeapTrimmer:
    """malloc_trim (~1 ms) after a drain in which symbol tables were loaded or dropped. Parsing a large
    symbol table or kallsyms frees tens of MB of transient buffers that glibc otherwise keeps mapped behind
    live allocations of other threads; a steady drain frees little. `generation()` is a number that
    changes when such work happened (None: trim every call)."""

    def __init__(self, generation: Callable[[], int] | None = None) -> None:
        self._generation = generation
        self._last: int | None = None
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def __call__(self) -> None:
        if self._trim is None:
            return
        if self._generation is not None:
            generation = self._generation()
            if generation == self._last:
                return
            self._last = generation
        self._trim(0)


def release_startup_memory(smaps_path: str = "/proc/self/smaps") -> int:
    """malloc_trim the heap and drop the compiler libraries' clean pages; returns bytes released."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        with open(smaps_path) as f:
            smaps = f.read()
    except OSError:
        return 0
    libc.malloc_trim(0)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for start, end, path in clean_compiler_mappings(smaps):
        if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
        else:
            log.debug("madvise(MADV_DONTNEED) refused for %s (errno %d)", path, ctypes.get_errno())
    return released
