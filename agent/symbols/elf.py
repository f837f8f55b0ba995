"""Minimal ELF64 little-endian reader: load segments, build id, debuglink and compact function symbols."""

from __future__ import annotations

import lzma
import mmap
import os
import struct
import sys
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

ET_EXEC = 2
ET_DYN = 3

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

Buffer = bytes | bytearray | memoryview | mmap.mmap


class ElfError(Exception):
    """The data is not a well-formed ELF64 little-endian file (or uses a feature this reader lacks)."""


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
    """Headers of one ELF64 LE file; data is read lazily from an mmap (path) or the given buffer."""

    def __init__(self, source: str | os.PathLike[str] | Buffer) -> None:
        self._mmap: mmap.mmap | None = None
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise ElfError(f"{os.fspath(source)}: empty file")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._buf: Buffer = self._mmap
        else:
            self._buf = source
        try:
            self._parse()
        except struct.error as e:
            self.close()
            raise ElfError(f"truncated ELF header data: {e}") from e
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file if this object opened it; headers stay usable, section data does not."""
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def _parse(self) -> None:
        buf = self._buf
        size = len(buf)
        if size < _EHDR.size or bytes(buf[:4]) != b"\x7fELF":
            raise ElfError("not an ELF file")
        (
            ident,
            e_type,
            _mach,
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
        ) = _EHDR.unpack_from(buf, 0)
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError("only ELF64 little-endian files are supported")
        self.e_type: int = e_type
        self._size = size

        # Extended numbering: counts that overflow 16 bits live in section header 0.
        sh0 = None
        if shoff:
            self._check_range(shoff, _SHDR.size, "section header 0")
            sh0 = _SHDR.unpack_from(buf, shoff)
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
            self._check_range(phoff, phentsize * phnum, "program headers")
            for i in range(phnum):
                p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, p_memsz, _al = _PHDR.unpack_from(
                    buf, phoff + i * phentsize
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
            self._check_range(shoff, shentsize * shnum, "section headers")
            raw = [_SHDR.unpack_from(buf, shoff + i * shentsize) for i in range(shnum)]
            names = b""
            if 0 < shstrndx < shnum and raw[shstrndx][1] != SHT_NOBITS:
                _n, _t, _f, _a, off, sz, *_ = raw[shstrndx]
                self._check_range(off, sz, "section name table")
                names = bytes(buf[off : off + sz])
            for name_off, *rest in raw:
                end = names.find(b"\0", name_off)
                name = names[name_off:end].decode("ascii", "replace") if end >= 0 else ""
                sections.append(Section(name, *rest[:7], rest[8]))
        self.sections: tuple[Section, ...] = tuple(sections)

        self.build_id: str | None = self._find_build_id(note_segments)
        self.debuglink: str | None = self._find_debuglink()

    def _check_range(self, offset: int, length: int, what: str) -> None:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise ElfError(f"{what} extend past the end of the file")

    def section(self, name: str) -> Section | None:
        """The first section called `name`, or None."""
        for sec in self.sections:
            if sec.name == name:
                return sec
        return None

    def section_data(self, sec: Section) -> bytes:
        """The section's bytes, decompressed when SHF_COMPRESSED (zlib only)."""
        if sec.type == SHT_NOBITS:
            return b""
        self._check_range(sec.offset, sec.size, f"section {sec.name}")
        data = bytes(self._buf[sec.offset : sec.offset + sec.size])
        if sec.flags & SHF_COMPRESSED:
            if len(data) < _CHDR.size:
                raise ElfError(f"section {sec.name}: truncated compression header")
            ch_type, _res, ch_size, _align = _CHDR.unpack_from(data)
            if ch_type != ELFCOMPRESS_ZLIB:
                raise ElfError(f"section {sec.name}: unsupported compression type {ch_type}")
            try:
                data = zlib.decompress(data[_CHDR.size :])
            except zlib.error as e:
                raise ElfError(f"section {sec.name}: {e}") from e
            if len(data) != ch_size:
                raise ElfError(f"section {sec.name}: decompressed to {len(data)} bytes, expected {ch_size}")
        return data

    def read(self, offset: int, size: int) -> bytes:
        """`size` raw bytes of the file at `offset` (e.g. initialised data of a PT_LOAD segment)."""
        self._check_range(offset, size, "the bytes read")
        return bytes(self._buf[offset : offset + size])

    def file_offset_to_vaddr(self, offset: int) -> int | None:
        """The virtual address that file offset `offset` is loaded at, or None outside every PT_LOAD."""
        return offset_to_vaddr(self.load_segments, offset)

    def _find_build_id(self, note_segments: list[tuple[int, int]]) -> str | None:
        # Sections first: debug files keep .note.gnu.build-id while their PT_NOTE may point at nothing.
        blobs = [self.section_data(s) for s in self.sections if s.type == SHT_NOTE]
        if not blobs:
            for off, sz in note_segments:
                if off + sz <= self._size:
                    blobs.append(bytes(self._buf[off : off + sz]))
        for blob in blobs:
            for n_type, name, desc in _iter_notes(blob):
                if n_type == NT_GNU_BUILD_ID and name == b"GNU\0" and desc:
                    return desc.hex()
        return None

    def _find_debuglink(self) -> str | None:
        sec = self.section(".gnu_debuglink")
        if sec is None:
            return None
        data = self.section_data(sec)
        end = data.find(b"\0")
        return data[:end].decode("utf-8", "replace") if end > 0 else None


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
    try:
        inner = ElfFile(lzma.decompress(elf.section_data(sec)))
    except lzma.LZMAError as e:
        raise ElfError(f".gnu_debugdata: {e}") from e
    return _symbol_source(inner, SHT_SYMTAB)


def debug_file_path(build_id: str, root: str = "/") -> str:
    """Where a separate debug file for `build_id` lives under `root` (the .build-id convention)."""
    return os.path.join(root, DEBUG_BUILD_ID_DIR, build_id[:2], build_id[2:] + ".debug")


def load_symbols(elf: ElfFile, debug_roots: Sequence[str] = ("/",)) -> SymbolTable:
    """The best symbol table for `elf`: a matching build-id debug file's .symtab, else the file's own."""
    if elf.build_id and len(elf.build_id) > 2:
        for root in debug_roots:
            try:
                with ElfFile(debug_file_path(elf.build_id, root)) as dbg:
                    # A stale debug file from another build would name the wrong functions.
                    if dbg.build_id == elf.build_id:
                        source = _symbol_source(dbg, SHT_SYMTAB)
                        if source is not None:
                            return SymbolTable.from_sections([source])
            except (OSError, ElfError):
                continue
    return SymbolTable.from_elf(elf)
