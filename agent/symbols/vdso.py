"""The node's vDSO: the ELF image the kernel maps into every process as `[vdso]`, read from the agent's own.

The kernel builds one vDSO image per ABI and maps the same pages into every process of that ABI (the data
beside it, `[vvar]`, is what differs, by time namespace), so the agent's own copy, at
getauxval(AT_SYSINFO_EHDR), is every 64-bit process's. Code calls into it for clock_gettime, gettimeofday,
time, getcpu and getrandom; where a clock has no fast path (CPU-time clocks, or a clock source the vDSO
cannot read) the vDSO makes the syscall itself, so a sample in such a syscall has its user IP in `[vdso]`.
With this image the unwinder walks out of it by its .eh_frame like any file (agent/unwind/unwinder.py), and
the symbolizer names its functions (`__vdso_clock_gettime`).

A process's `[vdso]` is taken for this image only when the mapping is exactly as long: a 32-bit (ia32 or x32)
process maps another image, and its frames stay unnamed rather than wrongly named.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from functools import cached_property

from fleetprof.agent.model import Mapping
from fleetprof.agent.symbols.elf import ElfError, ElfFile, Segment, SymbolTable
from fleetprof.agent.symbols.maps import parse_maps

log = logging.getLogger(__name__)

AT_SYSINFO_EHDR = 33  # include/uapi/linux/auxvec.h: the vDSO's ELF header
VDSO_NAME = "[vdso]"
MAX_VDSO_BYTES = 1 << 20  # today's x86-64 image is 8 KB; anything near this is not a vDSO


@dataclass(frozen=True, eq=False)
class Vdso:
    """The vDSO's bytes as mapped (its ELF file image: the kernel maps it from offset 0)."""

    image: bytes

    def matches(self, mapping: Mapping) -> bool:
        """Whether a process's mapping is this image: its `[vdso]`, exactly as long."""
        return mapping.path == VDSO_NAME and mapping.end - mapping.start == len(self.image)

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        with ElfFile(self.image) as elf:
            return elf.load_segments

    @cached_property
    def symbols(self) -> SymbolTable:
        with ElfFile(self.image) as elf:
            return SymbolTable.from_elf(elf)

    def open_memfd(self) -> int:
        """A new read-only-ish descriptor holding the image as a regular file (the table worker takes files by
        descriptor); the caller owns it."""
        fd = os.memfd_create("fleetprof-vdso", os.MFD_CLOEXEC)
        try:
            os.write(fd, self.image)
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            os.close(fd)
            raise
        return fd


def _auxv_vdso_base() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    getauxval = libc.getauxval
    getauxval.argtypes, getauxval.restype = [ctypes.c_ulong], ctypes.c_ulong
    return int(getauxval(AT_SYSINFO_EHDR))


def read_own_vdso(proc_root: str = "/proc") -> Vdso | None:
    """The agent's own vDSO image, or None (said once in the log) where there is none or it cannot be read:
    then `[vdso]` frames are walked by frame pointer and left unnamed, as before."""
    try:
        base = _auxv_vdso_base()
        if not base:
            log.info("no vDSO in this process (getauxval(AT_SYSINFO_EHDR) is 0): vDSO frames stay unnamed")
            return None
        with open(f"{proc_root}/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            mine = [m for m in parse_maps(f.read()) if m.start == base and m.path == VDSO_NAME]
        if not mine or not 0 < mine[0].end - mine[0].start <= MAX_VDSO_BYTES:
            raise ElfError(f"no [vdso] mapping of a plausible size at 0x{base:x}")
        size = mine[0].end - mine[0].start
        fd = os.open(f"{proc_root}/self/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            image = os.pread(fd, size, base)
        finally:
            os.close(fd)
        if len(image) != size:
            raise ElfError(f"read {len(image)} of the vDSO's {size} bytes")
        vdso = Vdso(image)
        _ = vdso.segments, vdso.symbols  # parse it now: a bad image is refused here, not at the first sample
        return vdso
    except (OSError, ElfError, ValueError, AttributeError) as e:
        log.warning("cannot read this node's vDSO (%s): vDSO frames stay unnamed and end table walks", e)
        return None
