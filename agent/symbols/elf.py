"""Minimal ELF64 little-endian reader: load segments, build id, debuglink and compact function symbols.

The files it reads belong to tenants (any container's /proc/PID/root) and the agent reads them as root, so:
  * files are read with pread, never mapped: a tenant can truncate a file while we read it, and a mapping
    of the vanished pages raises SIGBUS, which kills the whole node's profiler; a pread comes back short,
    which is an ElfError (reason "truncated");
  * only the headers are read up front; sections are read when asked for, each bounded by a cap
    (MAX_HEADER_BYTES, MAX_SECTION_BYTES), so a 200 MB libLLVM costs what its symbol sections cost;
  * decompression never produces more than it is allowed to: SHF_COMPRESSED sections at most their
    declared size (itself capped), .gnu_debugdata at most MAX_MINI_DEBUGINFO_BYTES;
  * every refusal is an ElfError whose `reason` (agent/process/rootfs.py REASONS) is counted by callers.
"""

from __future__ import annotations

import lzma
import os
import stat
import struct
import sys
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from fleetprof.agent.process.rootfs import (
    DECOMPRESSION_BOMB,
    MALFORMED,
    NOT_REGULAR,
    TOO_LARGE,
    TRUNCATED,
    UNSUPPORTED_COMPRESSION,
    UnsafeFile,
    open_file,
    open_in_root,
)

try:  # Python 3.14+; without it zstd-compressed sections are refused (reason "unsupported_compression")
    from compression import zstd as _zstd  # type: ignore[import-not-found]
except ImportError:
    _zstd = None

ET_EXEC = 2
ET_DYN = 3

EM_X86_64 = 62
EM_AARCH64 = 183

PT_LOAD = 1
PT_NOTE = 4
PF_X = 1

SHT_SYMTAB = 2
SHT_NOTE = 7
SHT_NOBITS = 8
SHT_DYNSYM = 11
SHF_COMPRESSED = 0x800
SHN_UNDEF = 0
SHN_XINDEX = 0xFFFF
PN_XNUM = 0xFFFF

STT_FUNC = 2
STT_GNU_IFUNC = 10
NT_GNU_BUILD_ID = 3
ELFCOMPRESS_ZLIB = 1
ELFCOMPRESS_ZSTD = 2

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_CHDR = struct.Struct("<IIQQ")
_NHDR = struct.Struct("<III")

# Rank of st_bind when several symbols share an address: GLOBAL, then WEAK, then LOCAL, then anything else.
_BIND_RANK = (2, 0, 1) + (3,) * 13
# Sizes are stored as 32-bit; no real function is 4 GiB long.
_MAX_SIZE = 0xFFFFFFFF
# How many earlier symbols lookup() inspects when the nearest one ends before the address: covers a
# function that contains smaller sized symbols (assembly entry points, cold labels).
_ENCLOSING_SCAN = 8

# String tables larger than this are stored compressed (see SymbolTable); libc's is ~130 KiB, LLVM's ~17 MiB.
COMPRESS_NAMES_ABOVE = 1 << 20

DEBUG_BUILD_ID_DIR = "usr/lib/debug/.build-id"

# Caps on what one file can make us allocate. Header tables: real files have tens of program and section
# headers (a few KiB); 16 MiB is ~260,000 sections. Sections: the largest real symbol tables we know are
# a few hundred MiB at most (libLLVM's .strtab is 17 MiB); a declared uncompressed size above the cap is
# refused before anything is inflated. MiniDebugInfo is small by design (a few MiB of .symtab).
MAX_HEADER_BYTES = 16 << 20
MAX_SECTION_BYTES = 256 << 20
MAX_MINI_DEBUGINFO_BYTES = 64 << 20
# Notes and .gnu_debuglink hold a build id or a file name: anything larger is not one.
MAX_NOTE_BYTES = 1 << 20
# xz's own memory (its dictionary) for .gnu_debugdata: `xz -9` streams need ~65 MiB to decode.
_XZ_MEMLIMIT = 128 << 20
# Decompressed output is gathered this much at a time (see _decompress_capped).
_INFLATE_STEP = 1 << 20

Buffer = bytes | bytearray | memoryview
_ZlibDecompressor = type(zlib.decompressobj())
Decompressor = _ZlibDecompressor | lzma.LZMADecompressor  # or compression.zstd's ZstdDecompressor


class ElfError(Exception):
    """The data is not a well-formed ELF64 little-endian file (or uses a feature this reader lacks, or
    would cost more than its caps allow); `reason` says which, as one of agent/process/rootfs.py REASONS."""

    def __init__(self, message: str, reason: str = MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


class Segment(NamedTuple):
    """One PT_LOAD program header."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    flags: int


class Section(NamedTuple):
    """One section header, with its name resolved."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


def offset_to_vaddr(segments: Sequence[Segment], file_offset: int) -> int | None:
    """Translate a file offset to an ELF virtual address through the PT_LOAD segment that contains it."""
    for seg in segments:
        if seg.offset <= file_offset < seg.offset + seg.filesz:
            return file_offset - seg.offset + seg.vaddr
    return None


class ElfFile:
    """Headers of one ELF64 LE file; section data is read on demand, with pread from a file (never an mmap:
    see the module docstring) or from the given buffer.

    `source` is a path (of the agent's own filesystem: use agent/process/rootfs.py to open a tenant's
    file), an open file descriptor, which the ElfFile then owns and closes, or the bytes of a whole file.
    """

    def __init__(self, source: str | os.PathLike[str] | int | Buffer) -> None:
        self._fd = -1
        self._buf: Buffer | None = None
        if isinstance(source, (str, os.PathLike)):
            self._fd = open_file(os.fspath(source))
        elif isinstance(source, int):
            self._fd = source
        else:
            self._buf = source
        try:
            if self._buf is not None:
                self._size = len(self._buf)
            else:
                st = os.fstat(self._fd)
                if not stat.S_ISREG(st.st_mode):
                    raise UnsafeFile(NOT_REGULAR, f"fd {self._fd}: not a regular file")
                self._size = st.st_size
            self._parse()
        except struct.error as e:
            self.close()
            raise ElfError(f"truncated ELF header data: {e}", TRUNCATED) from e
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the file if this object holds one; headers stay usable, section data does not."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read(self, offset: int, size: int, what: str) -> bytes:
        """Exactly `size` bytes at `offset`, or ElfError: past the end of the file as it was when opened,
        or the file shrank since (a short read)."""
        if offset < 0 or size < 0 or offset + size > self._size:
            raise ElfError(f"{what} extend past the end of the file", TRUNCATED)
        if self._buf is not None:
            return bytes(self._buf[offset : offset + size])
        if self._fd < 0:
            raise ValueError("read from a closed ElfFile")
        data = os.pread(self._fd, size, offset)
        if len(data) < size:
            parts = [data]
            got = len(data)
            while got < size:
                more = os.pread(self._fd, size - got, offset + got)
                if not more:
                    raise ElfError(f"{what}: the file ended {size - got} bytes early (truncated?)", TRUNCATED)
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def _parse(self) -> None:
        if self._size < _EHDR.size:
            raise ElfError("not an ELF file (shorter than an ELF header)")
        ehdr = self._read(0, _EHDR.size, "ELF header")
        if ehdr[:4] != b"\x7fELF":
            raise ElfError("not an ELF file")
        (
            ident,
            e_type,
            machine,
            _ver,
            _entry,
            phoff,
            shoff,
            _flags,
            _ehsize,
            phentsize,
            phnum,
            shentsize,
            shnum,
            shstrndx,
        ) = _EHDR.unpack(ehdr)
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError("only ELF64 little-endian files are supported")
        self.e_type: int = e_type
        # The instruction set (EM_X86_64, EM_AARCH64, ...): symbols and load segments read the same on
        # every little-endian ELF64 machine, but call-frame information names registers by its numbers.
        self.machine: int = machine

        # Extended numbering: counts that overflow 16 bits live in section header 0.
        sh0 = None
        if shoff:
            sh0 = _SHDR.unpack(self._read(shoff, _SHDR.size, "section header 0"))
            if shnum == 0:
                shnum = sh0[5]
            if shstrndx == SHN_XINDEX:
                shstrndx = sh0[6]
        if phnum == PN_XNUM and sh0 is not None:
            phnum = sh0[7]

        segments: list[Segment] = []
        note_segments: list[tuple[int, int]] = []
        if phoff and phnum:
            if phentsize < _PHDR.size:
                raise ElfError(f"bad program header size {phentsize}")
            raw = self._read(
                phoff, _capped(phentsize * phnum, MAX_HEADER_BYTES, "program headers"), "program headers"
            )
            for i in range(phnum):
                p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, p_memsz, _al = _PHDR.unpack_from(
                    raw, i * phentsize
                )
                if p_type == PT_LOAD:
                    segments.append(Segment(p_offset, p_vaddr, p_filesz, p_memsz, p_flags))
                elif p_type == PT_NOTE:
                    note_segments.append((p_offset, p_filesz))
        self.load_segments: tuple[Segment, ...] = tuple(segments)

        sections: list[Section] = []
        if shoff and shnum:
            if shentsize < _SHDR.size:
                raise ElfError(f"bad section header size {shentsize}")
            table = self._read(
                shoff, _capped(shentsize * shnum, MAX_HEADER_BYTES, "section headers"), "section headers"
            )
            raw_sections = [_SHDR.unpack_from(table, i * shentsize) for i in range(shnum)]
            names = b""
            if 0 < shstrndx < shnum and raw_sections[shstrndx][1] != SHT_NOBITS:
                _n, _t, _f, _a, off, sz, *_ = raw_sections[shstrndx]
                names = self._read(
                    off, _capped(sz, MAX_HEADER_BYTES, "section name table"), "section name table"
                )
            for name_off, *rest in raw_sections:
                end = names.find(b"\0", name_off)
                name = names[name_off:end].decode("ascii", "replace") if end >= 0 else ""
                sections.append(Section(name, *rest[:7], rest[8]))
        self.sections: tuple[Section, ...] = tuple(sections)

        self.build_id: str | None = self._find_build_id(note_segments)
        # .gnu_debuglink: the separate debug file's name, and the CRC-32 of that file's whole contents.
        self.debuglink: str | None = None
        self.debuglink_crc: int | None = None
        self._find_debuglink()

    def section(self, name: str) -> Section | None:
        """The first section called `name`, or None."""
        for sec in self.sections:
            if sec.name == name:
                return sec
        return None

    def section_data(self, sec: Section, limit: int = MAX_SECTION_BYTES) -> bytes | bytearray:
        """The section's bytes, decompressed when SHF_COMPRESSED (zlib; zstd where Python has it). Neither
        the bytes read nor the bytes decompressed may exceed `limit` (ElfError otherwise)."""
        if sec.type == SHT_NOBITS:
            return b""
        what = f"section {sec.name}"
        data = self._read(sec.offset, _capped(sec.size, limit, what), what)
        if sec.flags & SHF_COMPRESSED:
            data = _decompress_section(what, data, limit)
        return data

    def read(self, offset: int, size: int) -> bytes:
        """`size` raw bytes of the file at `offset` (e.g. initialised data of a PT_LOAD segment)."""
        return self._read(offset, _capped(size, MAX_SECTION_BYTES, "the bytes read"), "the bytes read")

    def _find_build_id(self, note_segments: list[tuple[int, int]]) -> str | None:
        # Sections first: debug files keep .note.gnu.build-id while their PT_NOTE may point at nothing.
        blobs = [self.section_data(s, MAX_NOTE_BYTES) for s in self.sections if s.type == SHT_NOTE]
        if not blobs:
            for off, sz in note_segments:
                if off + sz <= self._size and sz <= MAX_NOTE_BYTES:
                    blobs.append(self._read(off, sz, "note segment"))
        for blob in blobs:
            for n_type, name, desc in _iter_notes(blob):
                if n_type == NT_GNU_BUILD_ID and name == b"GNU\0" and desc:
                    return desc.hex()
        return None

    def _find_debuglink(self) -> None:
        sec = self.section(".gnu_debuglink")
        if sec is None:
            return
        data = self.section_data(sec, MAX_NOTE_BYTES)
        end = data.find(b"\0")
        if end <= 0:
            return
        self.debuglink = data[:end].decode("utf-8", "replace")
        # The name, its NUL, padding to 4 bytes, then the CRC in the file's byte order (little-endian here).
        at = (end + 4) & ~3
        if at + 4 <= len(data):
            self.debuglink_crc = int.from_bytes(data[at : at + 4], "little")


def _capped(size: int, limit: int, what: str) -> int:
    if size > limit:
        raise ElfError(f"{what}: {size} bytes, over the {limit}-byte cap", TOO_LARGE)
    return size


def _decompress_capped(decompressor: Decompressor, data: Buffer, limit: int) -> tuple[bytearray, bool]:
    """At most limit + 1 bytes of what `decompressor` (zlib's, lzma's or zstd's) makes of `data`, and
    whether the stream ended. Output is asked for a step at a time and appended to one bytearray: one
    decompress(data, limit + 1) call would hold its output pieces and their joined copy at once, twice
    the memory (and large bytearrays grow in place, by mremap)."""
    out = bytearray()
    pending: Buffer = data
    while len(out) <= limit:
        piece = decompressor.decompress(pending, min(_INFLATE_STEP, limit + 1 - len(out)))
        out += piece
        if decompressor.eof:
            return out, True
        if isinstance(decompressor, _ZlibDecompressor):
            pending = decompressor.unconsumed_tail  # zlib hands back the input it did not get to
            if not pending and not piece:
                break  # all input used, no output left: the stream is cut short
        else:
            pending = b""  # lzma and zstd keep unused input themselves
            if decompressor.needs_input:
                break
    return out, False


def _decompress_section(what: str, data: bytes, limit: int) -> bytearray:
    """An SHF_COMPRESSED section's contents: exactly its declared ch_size bytes, which must be <= limit.
    The decompressor is never allowed to produce more than ch_size + 1 bytes (the one byte tells a bomb
    that inflates past its declared size)."""
    if len(data) < _CHDR.size:
        raise ElfError(f"{what}: truncated compression header", TRUNCATED)
    ch_type, _res, ch_size, _align = _CHDR.unpack_from(data)
    if ch_type == ELFCOMPRESS_ZLIB:
        decompressor, errors = zlib.decompressobj(), (zlib.error,)
    elif ch_type == ELFCOMPRESS_ZSTD:
        if _zstd is None:
            raise ElfError(
                f"{what}: zstd-compressed, and this Python has no zstd module (compression.zstd, 3.14+)",
                UNSUPPORTED_COMPRESSION,
            )
        decompressor, errors = _zstd.ZstdDecompressor(), (_zstd.ZstdError,)
    else:
        raise ElfError(f"{what}: unsupported compression type {ch_type}", UNSUPPORTED_COMPRESSION)
    if ch_size > limit:
        raise ElfError(
            f"{what}: declares {ch_size} bytes uncompressed, over the {limit}-byte cap", DECOMPRESSION_BOMB
        )
    try:
        out, ended = _decompress_capped(decompressor, memoryview(data)[_CHDR.size :], ch_size)
    except errors as e:
        raise ElfError(f"{what}: {e}") from e
    if len(out) > ch_size:
        raise ElfError(f"{what}: inflates past its declared {ch_size} bytes", DECOMPRESSION_BOMB)
    if len(out) < ch_size or not ended:
        raise ElfError(
            f"{what}: inflated to {len(out)} bytes of {ch_size}, and the stream ended early", TRUNCATED
        )
    return out


def _iter_notes(blob: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    pos = 0
    while pos + _NHDR.size <= len(blob):
        namesz, descsz, n_type = _NHDR.unpack_from(blob, pos)
        pos += _NHDR.size
        name = blob[pos : pos + namesz]
        pos += (namesz + 3) & ~3
        desc = blob[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        if pos > len(blob):
            return
        yield n_type, name, desc


class SymbolTable:
    """Function symbols of one ELF file: sorted start addresses plus undecoded names, looked up by address.

    Names stay as raw bytes until a lookup needs one. Small tables keep the file's string table as one
    bytes object indexed by offset; tables whose string table exceeds `compress_above` bytes (C++ libraries
    with megabytes of mangled names) keep only function names, deflate-compressed in blocks of NAME_BLOCK.
    """

    __slots__ = ("_starts", "_sizes", "_names", "_strings", "_block")

    NAME_BLOCK = 32

    def __init__(self, starts: array, sizes: array, names: array, strings: bytes, block: int = 0) -> None:
        """Plain mode (block=0): names[i] is symbol i's offset into strings. Compressed mode: names holds
        the offsets of compressed blocks of `block` NUL-separated names each, plus the end offset."""
        expected = len(starts) if block == 0 else -(-len(starts) // block) + 1
        if len(sizes) != len(starts) or len(names) != expected:
            raise ValueError("starts, sizes and names do not describe the same symbols")
        self._starts = starts
        self._sizes = sizes
        self._names = names
        self._strings = strings
        self._block = block

    @classmethod
    def from_sections(
        cls,
        sources: Iterable[tuple[bytes, bytes]],
        compress_above: int = COMPRESS_NAMES_ABOVE,
        section_ends: Sequence[int] = (),
    ) -> SymbolTable:
        """Build from (symbol section bytes, its string table bytes) pairs, e.g. .symtab with .strtab.

        `section_ends[shndx]` is the end address of section shndx. A zero-size symbol (`_init`, hand-written
        assembly) otherwise covers everything up to the next symbol, and with only .dynsym that can be a
        run of unexported static functions in another section: it is capped at its own section's end.
        """
        # Arrays only: a list of per-symbol tuples here fragmented the agent's heap by tens of MB once
        # a few dozen libraries were loaded.
        c_value, c_rank, c_name, c_size = array("Q"), array("B"), array("Q"), array("Q")
        tables: list[bytes] = []
        base = 0
        rank = _BIND_RANK
        for symdata, strdata in sources:
            whole = len(symdata) - len(symdata) % _SYM.size
            for name, info, _other, shndx, value, size in _SYM.iter_unpack(memoryview(symdata)[:whole]):
                kind = info & 0xF
                # Undefined symbols can carry a PLT address in non-PIE executables; they are not ours.
                if (kind == STT_FUNC or kind == STT_GNU_IFUNC) and value and shndx != SHN_UNDEF and name:
                    if size == 0 and shndx < len(section_ends) and section_ends[shndx] > value:
                        size = section_ends[shndx] - value
                    c_value.append(value)
                    c_rank.append(rank[info >> 4])
                    c_name.append(name + base)
                    c_size.append(size)
            tables.append(strdata)
            base += len(strdata)
        strings = b"".join(tables)
        order = sorted(range(len(c_value)), key=c_value.__getitem__)

        starts = array("Q")
        sizes = array("I")
        offsets = array("I")
        i, n = 0, len(order)
        while i < n:
            j = i + 1
            value = c_value[order[i]]
            while j < n and c_value[order[j]] == value:
                j += 1
            if j - i == 1:
                best = order[i]
                size = c_size[best]
            else:
                group = order[i:j]
                best = min(group, key=lambda k: (c_rank[k], *_name_key(strings, c_name[k])))
                size = c_size[best] or max(c_size[k] for k in group)
            starts.append(value)
            sizes.append(min(size, _MAX_SIZE))
            offsets.append(c_name[best])
            i = j
        if len(strings) <= compress_above:
            return cls(starts, sizes, offsets, strings)
        return cls(starts, sizes, *_compress_names(strings, offsets, cls.NAME_BLOCK), block=cls.NAME_BLOCK)

    @classmethod
    def from_elf(cls, elf: ElfFile) -> SymbolTable:
        """Build from the file's .symtab if present, else .dynsym (merged with a MiniDebugInfo .symtab)."""
        ends = [sec.addr + sec.size if sec.addr else 0 for sec in elf.sections]
        symtab = _symbol_source(elf, SHT_SYMTAB)
        if symtab is not None:
            return cls.from_sections([symtab], section_ends=ends)
        sources = []
        dynsym = _symbol_source(elf, SHT_DYNSYM)
        if dynsym is not None:
            sources.append(dynsym)
        mini = _mini_debuginfo_symtab(elf)
        if mini is not None:
            sources.append(mini)
        return cls.from_sections(sources, section_ends=ends)

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def compressed(self) -> bool:
        """Whether names are held zlib-compressed (large string tables)."""
        return self._block != 0

    @property
    def nbytes(self) -> int:
        """Approximate memory held by the table's arrays and names."""
        return (
            sys.getsizeof(self._starts)
            + sys.getsizeof(self._sizes)
            + sys.getsizeof(self._names)
            + sys.getsizeof(self._strings)
        )

    def _name(self, index: int) -> str:
        strings = self._strings
        if self._block:
            b, k = divmod(index, self._block)
            packed = strings[self._names[b] : self._names[b + 1]]
            raw = zlib.decompressobj(-15).decompress(packed).split(b"\0")[k]
        else:
            off = self._names[index]
            end = strings.find(b"\0", off)
            raw = strings[off : end if end >= 0 else len(strings)]
        return raw.decode("utf-8", "replace")

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(function name, offset into it) for an ELF virtual address, or None if no function covers it."""
        starts, sizes = self._starts, self._sizes
        i = bisect_right(starts, vaddr) - 1
        if i < 0:
            return None
        size = sizes[i]
        if size == 0 or vaddr - starts[i] < size:
            return self._name(i), vaddr - starts[i]
        for k in range(i - 1, max(i - 1 - _ENCLOSING_SCAN, -1), -1):
            if vaddr - starts[k] < sizes[k]:
                return self._name(k), vaddr - starts[k]
        return None

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        """(start, size, name) of every symbol in address order; decodes every name, so meant for tools."""
        for i in range(len(self._starts)):
            yield self._starts[i], self._sizes[i], self._name(i)


def _compress_names(strings: bytes, offsets: array, block: int) -> tuple[array, bytes]:
    # One raw-deflate stream with a full flush after each block: every block decompresses on its own (the
    # flush empties the history window) while zlib's per-stream setup is paid once, not once per block.
    packer = zlib.compressobj(6, zlib.DEFLATED, -15)
    blocks: list[bytes] = []
    starts = array("Q", [0])
    pos = 0
    find = strings.find
    for b in range(0, len(offsets), block):
        names = []
        for off in offsets[b : b + block]:
            end = find(b"\0", off)
            names.append(strings[off : end if end >= 0 else len(strings)])
        packed = packer.compress(b"\0".join(names)) + packer.flush(zlib.Z_FULL_FLUSH)
        blocks.append(packed)
        pos += len(packed)
        starts.append(pos)
    return starts, b"".join(blocks)


def _name_key(strings: bytes, off: int) -> tuple[int, bytes]:
    end = strings.find(b"\0", off)
    name = strings[off : end if end >= 0 else len(strings)]
    return len(name), name


def _symbol_source(elf: ElfFile, sh_type: int) -> tuple[bytes, bytes] | None:
    for sec in elf.sections:
        if sec.type == sh_type and sec.size:
            if not 0 < sec.link < len(elf.sections):
                raise ElfError(f"{sec.name}: string table index {sec.link} out of range")
            return elf.section_data(sec), elf.section_data(elf.sections[sec.link])
    return None


def _mini_debuginfo_symtab(elf: ElfFile) -> tuple[bytes, bytes] | None:
    # Fedora/RHEL ship local function symbols as an xz-compressed ELF in .gnu_debugdata ("MiniDebugInfo").
    sec = elf.section(".gnu_debugdata")
    if sec is None:
        return None
    what = "section .gnu_debugdata"
    xz = lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=_XZ_MEMLIMIT)
    try:
        inner, ended = _decompress_capped(xz, elf.section_data(sec), MAX_MINI_DEBUGINFO_BYTES)
    except lzma.LZMAError as e:
        # liblzma's LZMA_MEMLIMIT_ERROR: the stream asks for a dictionary larger than any real one.
        reason = DECOMPRESSION_BOMB if "memory" in str(e).lower() else MALFORMED
        raise ElfError(f"{what}: {e}", reason) from e
    if len(inner) > MAX_MINI_DEBUGINFO_BYTES:
        raise ElfError(f"{what}: inflates past the {MAX_MINI_DEBUGINFO_BYTES}-byte cap", DECOMPRESSION_BOMB)
    if not ended:
        raise ElfError(f"{what}: the xz stream ends early", TRUNCATED)
    return _symbol_source(ElfFile(inner), SHT_SYMTAB)


def debug_file_path(build_id: str, root: str = "/") -> str:
    """Where a separate debug file for `build_id` lives under `root` (the .build-id convention)."""
    return os.path.join(root, DEBUG_BUILD_ID_DIR, build_id[:2], build_id[2:] + ".debug")


def debug_symbols(dbg: ElfFile, build_id: str | None) -> SymbolTable | None:
    """The .symtab of a separate debug file `dbg`, if it has one and, where `build_id` is given, it is that
    build's (a stale debug file from another build would name the wrong functions)."""
    if build_id is not None and dbg.build_id != build_id:
        return None
    source = _symbol_source(dbg, SHT_SYMTAB)
    if source is None:
        return None
    # A debug file keeps its sections' addresses (as NOBITS): they bound zero-size symbols as in the file.
    ends = [sec.addr + sec.size if sec.addr else 0 for sec in dbg.sections]
    return SymbolTable.from_sections([source], section_ends=ends)


def has_symtab(elf: ElfFile) -> bool:
    """Whether the file keeps its full symbol table (.symtab): not stripped."""
    return any(sec.type == SHT_SYMTAB and sec.size for sec in elf.sections)


def build_id_symbols(
    elf: ElfFile,
    debug_roots: Sequence[str] = ("/",),
    on_error: Callable[[Exception], object] | None = None,
) -> SymbolTable | None:
    """The .symtab of the debug file for `elf`'s build id under the first of `debug_roots` that has one
    (/usr/lib/debug/.build-id/xx/yyyy.debug), or None.

    Each of `debug_roots` is a directory that stands for `/` (the host's, or a process's /proc/PID/root):
    the debug file is looked up inside it and never outside (agent/process/rootfs.py). A debug file that
    cannot be used is skipped; `on_error` is given the exception (a missing file's included)."""
    if not elf.build_id or len(elf.build_id) <= 2:
        return None
    path = debug_file_path(elf.build_id)  # a hex build id: no "/" or ".." of its own
    for root in debug_roots:
        try:
            with ElfFile(open_in_root(root, path)) as dbg:
                table = debug_symbols(dbg, elf.build_id)
                if table is not None:
                    return table
        except (OSError, ElfError) as e:
            if on_error is not None:
                on_error(e)
    return None


def load_symbols(
    elf: ElfFile,
    debug_roots: Sequence[str] = ("/",),
    on_error: Callable[[Exception], object] | None = None,
) -> SymbolTable:
    """The best symbol table for `elf` from its build id's debug file (build_id_symbols) or the file itself;
    agent/symbols/debuginfo.py looks in more places (.gnu_debuglink, debuginfod)."""
    table = build_id_symbols(elf, debug_roots, on_error)
    return table if table is not None else SymbolTable.from_elf(elf)
