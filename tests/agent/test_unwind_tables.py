"""CFI unwind tables (agent/unwind/) agree with binutils' reading of the same files, row for row, and
hostile CFI is refused quickly with ElfError."""

from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fleetprof.agent.process.rootfs import MALFORMED, TRUNCATED
from fleetprof.agent.symbols.elf import PF_X, ElfError, ElfFile
from fleetprof.agent.unwind.cfi import MAX_STATE_DEPTH, parse_debug_frame
from fleetprof.agent.unwind.table import (
    CFA_RBP,
    CFA_RSP,
    END,
    MAX_CFA_OFFSET,
    NO_INFO,
    SIGNAL,
    UNSUPPORTED,
    UnwindTable,
    build_table,
    cfa_offset,
    encode_rule,
    kind,
    load_table,
    lookup,
    rbp_offset,
)
from tests.conftest import WORKLOADS

READELF = shutil.which("readelf")
GCC = shutil.which("gcc")
LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
LIBPYTHON = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")

pytestmark = pytest.mark.skipif(READELF is None or GCC is None, reason="needs binutils' readelf and gcc")

# (kind, CFA offset, rbp save offset): a rule as the tests compare it.
Expect = tuple[int, int, int]


# --- binutils' view: `readelf --debug-dump=frames-interp` ---------------------------------------------------

_CIE_LINE = re.compile(r'^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE "([^"]*)"')
_FDE_LINE = re.compile(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_ROW_LINE = re.compile(r"^[0-9a-f]+ +\S")
# One column of a row: columns are padded to a width but can overflow it, so split on spaces, except that
# a rule "held in another register" prints as "r9 (r9)".
_VALUE = re.compile(r"r\d+ \([^)]*\)|\S+")


@dataclass
class Entry:
    """A CIE or FDE as readelf prints it: interpreted rows of (location, CFA column, {register: rule})."""

    section: str
    offset: int
    augmentation: str = ""
    cie: int = -1
    begin: int = 0
    end: int = 0
    rows: list[tuple[int, str, dict[str, str]]] = field(default_factory=list)


def readelf_frames(path: Path) -> tuple[dict[tuple[str, int], Entry], list[Entry]]:
    """(CIEs by (section, offset), FDEs) of every .eh_frame and .debug_frame section in the file."""
    # readelf exits 1 on files whose separate debug file it cannot find (libc's .gnu_debuglink), having
    # printed the frames all the same: judge by what it printed.
    out = subprocess.run(
        [READELF, "--debug-dump=frames-interp", str(path)], capture_output=True, text=True
    ).stdout
    assert "Contents of the " in out, f"readelf printed no frame sections for {path}"
    cies: dict[tuple[str, int], Entry] = {}
    fdes: list[Entry] = []
    section = ""
    current: Entry | None = None
    columns: list[str] = []
    for line in out.splitlines():
        if line.startswith("Contents of the "):
            section = line.split()[3]
            current = None
        elif m := _CIE_LINE.match(line):
            current = Entry(section, int(m[1], 16), augmentation=m[2])
            cies[(section, current.offset)] = current
            columns = []
        elif m := _FDE_LINE.match(line):
            current = Entry(section, int(m[1], 16), cie=int(m[2], 16), begin=int(m[3], 16), end=int(m[4], 16))
            fdes.append(current)
            columns = []
        elif line.startswith("   LOC"):
            columns = line.split()[1:]  # CFA, then one per register with a rule, "ra" last
        elif "ZERO terminator" in line:
            current = None
        elif current is not None and columns and _ROW_LINE.match(line):
            loc, rest = line.split(None, 1)
            values = _VALUE.findall(rest)
            assert len(values) == len(columns), f"readelf row {line!r} does not fit header {columns}"
            current.rows.append((int(loc, 16), values[0], dict(zip(columns[1:], values[1:], strict=True))))
    return cies, fdes


def expected_rule(augmentation: str, cfa: str, regs: dict[str, str]) -> Expect:
    """What the table must say for one readelf row (table.py's docstring, derived from readelf's text)."""
    if "S" in augmentation:
        return SIGNAL, 0, 0
    ra = regs.get("ra")
    if ra == "u":
        return END, 0, 0
    if ra != "c-8":
        return UNSUPPORTED, 0, 0
    rbp = regs.get("rbp", "u")
    rbp_known, rbp_off = True, 0
    if rbp not in ("u", "s"):
        m = re.fullmatch(r"c([+-]\d+)", rbp)
        v = int(m[1]) if m else 0
        if m and v and v % 8 == 0 and -2048 <= v // 8 <= 2047:
            rbp_off = v
        else:
            rbp_known = False  # r12, exp, v-16, c-12: not representable
    m = re.fullmatch(r"(rsp|rbp)\+(\d+)", cfa)
    if not m or int(m[2]) > MAX_CFA_OFFSET:
        return UNSUPPORTED, 0, 0  # exp, another register, a negative or too large offset
    if m[1] == "rbp" and not rbp_known:
        return UNSUPPORTED, 0, 0
    return (CFA_RSP if m[1] == "rsp" else CFA_RBP), int(m[2]), rbp_off


def fde_rows(fde: Entry, cies: dict[tuple[str, int], Entry]) -> list[tuple[int, Expect]]:
    """One FDE's rows inside its range, the last of several at one location; an FDE with no instructions of
    its own (readelf prints no rows) has the CIE's initial row."""
    cie = cies[(fde.section, fde.cie)]
    by_loc: dict[int, Expect] = {}
    for loc, cfa, regs in fde.rows:
        if fde.begin <= loc < fde.end:
            by_loc[loc] = expected_rule(cie.augmentation, cfa, regs)
    if not by_loc:
        _loc, cfa, regs = cie.rows[0]
        by_loc[fde.begin] = expected_rule(cie.augmentation, cfa, regs)
    return sorted(by_loc.items())


def executable(path: Path) -> Callable[[int], bool]:
    with ElfFile(path) as elf:
        ranges = [(s.vaddr, s.vaddr + s.memsz) for s in elf.load_segments if s.flags & PF_X]
    return lambda addr: any(lo <= addr < hi for lo, hi in ranges)


def decoded(rule: int) -> Expect:
    return kind(rule), cfa_offset(rule), rbp_offset(rule)


def rows_of(table: UnwindTable) -> list[tuple[int, Expect]]:
    return [(int(pc), decoded(int(r))) for pc, r in zip(table.pcs, table.rules, strict=True)]


def expected_table(fdes: list[Entry], cies: dict[tuple[str, int], Entry]) -> list[tuple[int, Expect]]:
    """The whole table as table.py's docstring defines it, built from readelf's rows (no overlaps)."""
    fdes = sorted(fdes, key=lambda f: f.begin)
    rows: list[tuple[int, Expect]] = []
    for i, fde in enumerate(fdes):
        rows += fde_rows(fde, cies)
        if i + 1 == len(fdes) or fdes[i + 1].begin != fde.end:
            rows.append((fde.end, (NO_INFO, 0, 0)))
    return [row for i, row in enumerate(rows) if i == 0 or row[1] != rows[i - 1][1]]


def assert_agrees_with_readelf(path: Path, table: UnwindTable) -> int:
    """Every readelf row of every used FDE (.eh_frame's, and .debug_frame's where .eh_frame has none) looks
    up to the same rule in `table`. Returns how many rows were compared."""
    cies, fdes = readelf_frames(path)
    inside = executable(path)
    fdes = [f for f in fdes if f.end > f.begin and inside(f.begin)]
    eh = [f for f in fdes if f.section == ".eh_frame"]
    spans = sorted((f.begin, f.end) for f in eh)
    starts = [b for b, _e in spans]

    def covered_by_eh(f: Entry) -> bool:
        i = int(np.searchsorted(starts, f.end, side="left"))
        return any(b < f.end and f.begin < e for b, e in spans[max(0, i - 2) : i + 1])

    used = eh + [f for f in fdes if f.section == ".debug_frame" and not covered_by_eh(f)]
    pcs, wanted = [], []
    for fde in used:
        for loc, want in fde_rows(fde, cies):
            pcs.append(loc)
            wanted.append(want)
    idx = np.searchsorted(table.pcs, np.array(pcs, np.uint64), side="right") - 1
    assert (idx >= 0).all()
    got = [decoded(int(r)) for r in table.rules[idx]]
    wrong = [(hex(pc), w, g) for pc, w, g in zip(pcs, wanted, got, strict=True) if w != g]
    assert not wrong, (
        f"{len(wrong)} of {len(pcs)} rows differ from readelf, e.g. (pc, readelf, ours): {wrong[:5]}"
    )
    return len(pcs)


# --- the compiled workload ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tests/workloads/unwind_chain.c built without frame pointers, in variants: "eh" (.eh_frame, GCC's
    default), "debug_frame" (-fno-asynchronous-unwind-tables: the program's own CFI only in .debug_frame),
    "both" (the assembler told to write each function's CFI to both sections) and "high" (a PIE linked at
    8 GiB)."""
    out = tmp_path_factory.mktemp("unwind")
    both = out / "cfi_sections_both.h"
    both.write_text('__asm__(".cfi_sections .eh_frame, .debug_frame");\n')
    flags = {
        "eh": [],
        "debug_frame": ["-fno-asynchronous-unwind-tables"],
        "both": ["-include", str(both)],
        "high": ["-Wl,-Ttext-segment=0x200000000"],
    }
    built: dict[str, Path] = {}

    def build(variant: str) -> Path:
        if variant not in built:
            exe = out / f"unwind_chain_{variant}"
            cmd = [GCC, "-O2", "-fomit-frame-pointer", "-g", *flags[variant], "-o", str(exe)]
            subprocess.run([*cmd, str(WORKLOADS / "unwind_chain.c")], check=True)
            built[variant] = exe
        return built[variant]

    return build


def test_workload_prints_the_same_checksum_every_run(chain: Callable[[str], Path]) -> None:
    runs = [subprocess.run([chain("eh"), "3"], capture_output=True, text=True, check=True) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
    assert re.fullmatch(r"checksum \d+\n", runs[0].stdout)


def test_workload_table_is_exactly_the_one_readelf_describes(chain: Callable[[str], Path]) -> None:
    exe = chain("eh")
    cies, fdes = readelf_frames(exe)
    table = load_table(exe)
    assert rows_of(table) == expected_table([f for f in fdes if f.end > f.begin], cies)
    assert table.pcs.dtype == np.uint32 and table.rules.dtype == np.uint32
    assert table.nbytes == 8 * len(table)
    kinds = {kind(int(r)) for r in table.rules}
    # _start's CIE leaves the return address undefined; PLT stubs compute the CFA by expression; chain_b's
    # VLA gives rbp-based rows.
    assert {CFA_RSP, CFA_RBP, END, UNSUPPORTED, NO_INFO} <= kinds


def test_workload_rbp_frame_saves_rbp_at_cfa_minus_16(chain: Callable[[str], Path]) -> None:
    table = load_table(chain("eh"))
    rbp_rows = [int(r) for r in table.rules if kind(int(r)) == CFA_RBP]
    assert rbp_rows, "chain_b's VLA should make rbp its frame pointer"
    assert {(cfa_offset(r), rbp_offset(r)) for r in rbp_rows} == {(16, -16)}


def test_rows_merge_and_gaps_between_fdes_are_no_info(chain: Callable[[str], Path]) -> None:
    exe = chain("eh")
    cies, fdes = readelf_frames(exe)
    fdes = [f for f in fdes if f.end > f.begin]
    table = load_table(exe)
    rules = [int(r) for r in table.rules]
    assert all(a != b for a, b in zip(rules[:-1], rules[1:], strict=True)), "equal neighbours must be merged"
    assert list(table.pcs) == sorted(set(int(p) for p in table.pcs))

    # readelf starts a row whenever any register's rule changes (rbx, r12...): rows the table merges away.
    printed = {loc for f in fdes for loc, _c, _r in f.rows if f.begin <= loc < f.end}
    merged_away = printed - {int(p) for p in table.pcs}
    assert merged_away
    for loc in merged_away:
        assert decoded(lookup(table, loc)) == decoded(lookup(table, loc - 1))

    begins = {f.begin for f in fdes}
    ends_without_next = sorted({f.end for f in fdes} - begins)
    no_info = [int(pc) for pc, r in zip(table.pcs, rules, strict=True) if kind(r) == NO_INFO]
    assert no_info == ends_without_next
    for end in ends_without_next[:-1]:  # alignment padding after a function: no FDE, no information
        assert kind(lookup(table, end)) == NO_INFO
    assert lookup(table, int(table.pcs[0]) - 1) is None
    assert kind(lookup(table, 1 << 40)) == NO_INFO


def test_debug_frame_fills_what_eh_frame_does_not_cover(chain: Callable[[str], Path]) -> None:
    exe = chain("debug_frame")
    with ElfFile(exe) as elf:
        assert elf.section(".debug_frame") is not None
    table = load_table(exe)
    assert assert_agrees_with_readelf(exe, table) > 20
    _cies, fdes = readelf_frames(exe)
    from_debug = [f for f in fdes if f.section == ".debug_frame"]
    assert from_debug and all(kind(lookup(table, f.begin)) != NO_INFO for f in from_debug)


def test_eh_frame_wins_where_both_sections_describe_an_address(chain: Callable[[str], Path]) -> None:
    exe = chain("both")
    data = bytearray(exe.read_bytes())
    with ElfFile(exe) as elf:
        sec = elf.section(".debug_frame")
        assert sec is not None and elf.section(".eh_frame") is not None
    # .debug_frame's CFA rules "rsp+8" become "rsp+24": a table that used them would show it.
    blob = bytes(data[sec.offset : sec.offset + sec.size])
    assert b"\x0c\x07\x08" in blob
    blob = blob.replace(b"\x0c\x07\x08", b"\x0c\x07\x18")
    data[sec.offset : sec.offset + sec.size] = blob
    damaged = parse_debug_frame(blob, encode_rule)
    assert 24 in {cfa_offset(r) for r in damaged.rules if kind(r) == CFA_RSP}
    with ElfFile(bytes(data)) as elf:
        assert rows_of(build_table(elf)) == rows_of(load_table(chain("eh")))


def test_debug_frame_fdes_outside_executable_code_are_dropped(chain: Callable[[str], Path]) -> None:
    """Linkers point the .debug_frame FDEs of discarded functions at 0 (plus an offset) or -1."""
    exe = chain("debug_frame")
    data = bytearray(exe.read_bytes())
    with ElfFile(exe) as elf:
        sec = elf.section(".debug_frame")
        first_fde = sec.offset + 4 + struct.unpack_from("<I", data, sec.offset)[0]
        begin = struct.unpack_from("<Q", data, first_fde + 8)[0]
    table = load_table(exe)
    assert kind(lookup(table, begin)) not in (NO_INFO, None)
    for tombstone in (0x10, (1 << 64) - 1):
        struct.pack_into("<Q", data, first_fde + 8, tombstone)
        with ElfFile(bytes(data)) as elf:
            moved = build_table(elf)
        assert lookup(moved, 0x10) is None
        assert lookup(moved, begin) is None or kind(lookup(moved, begin)) == NO_INFO
        assert len(moved) < len(table)


def test_64bit_dwarf_debug_frame_with_version_4_cies_reads_the_same(chain: Callable[[str], Path]) -> None:
    exe = chain("debug_frame")
    data = bytearray(exe.read_bytes())
    with ElfFile(exe) as elf:
        sec = elf.section(".debug_frame")
        old = elf.section_data(sec)
        index = elf.sections.index(sec)
    new = _as_dwarf64_v4(bytes(old))
    at = len(data)
    data += new
    _patch_section_header(data, index, offset=at, size=len(new))
    with ElfFile(bytes(data)) as elf:
        assert rows_of(build_table(elf)) == rows_of(load_table(exe))


def test_files_for_other_machines_are_refused(chain: Callable[[str], Path]) -> None:
    data = bytearray(chain("eh").read_bytes())
    data[18:20] = (243).to_bytes(2, "little")  # EM_RISCV (AArch64 files have tables of their own layout)
    with pytest.raises(ElfError, match="x86-64 and AArch64 files only"):
        build_table(ElfFile(bytes(data)))


def test_code_above_4_gib_is_refused(chain: Callable[[str], Path]) -> None:
    with pytest.raises(ElfError, match="4 GiB") as e:
        load_table(chain("high"))
    assert e.value.reason == MALFORMED


# --- real libraries --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [LIBC, LIBPYTHON], ids=lambda p: p.name)
def test_system_library_agrees_with_readelf(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} is not installed")
    table = load_table(path)
    assert assert_agrees_with_readelf(path, table) > 1000
    cies, fdes = readelf_frames(path)
    inside = executable(path)
    used = [f for f in fdes if f.section == ".eh_frame" and f.end > f.begin and inside(f.begin)]
    assert rows_of(table) == expected_table(used, cies)


def test_libc_has_signal_and_outermost_frames() -> None:
    if not LIBC.exists():
        pytest.skip(f"{LIBC} is not installed")
    kinds = np.bincount(load_table(LIBC).rules & 7, minlength=6)
    assert kinds[SIGNAL] >= 1  # __restore_rt
    assert kinds[END] >= 1  # clone3's child, _start-like entry points


# --- hostile CFI -------------------------------------------------------------------------------------------


def _uleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _sleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        done = (v == 0 and not b & 0x40) or (v == -1 and b & 0x40)
        out.append(b | (0 if done else 0x80))
        if done:
            return bytes(out)


_CIE_INIT = b"\x0c\x07\x08\x90\x01"  # def_cfa rsp+8; offset r16 (return address) at cfa-8


def _cie(
    aug: bytes = b"zR",
    aug_data: bytes = b"\x1b",
    version: int = 1,
    code_align: int = 1,
    init: bytes = _CIE_INIT,
) -> bytes:
    body = b"\0\0\0\0" + bytes([version]) + aug + b"\0" + _uleb(code_align) + _sleb(-8) + _uleb(16)
    if aug.startswith(b"z"):
        body += _uleb(len(aug_data)) + aug_data
    body += init
    return struct.pack("<I", len(body)) + body


def _fde(section_addr: int, at: int, cie_at: int, begin: int, size: int, program: bytes) -> bytes:
    pc = begin - (section_addr + at + 8)  # pcrel sdata4, relative to the field itself
    body = struct.pack("<Iii", at + 4 - cie_at, pc, size) + b"\0" + program
    return struct.pack("<I", len(body)) + body


def _patch_section_header(
    data: bytearray, index: int, offset: int | None = None, size: int | None = None
) -> None:
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize = int.from_bytes(data[0x3A:0x3C], "little")
    at = shoff + index * shentsize
    if offset is not None:
        data[at + 24 : at + 32] = offset.to_bytes(8, "little")
    if size is not None:
        data[at + 32 : at + 40] = size.to_bytes(8, "little")


def _as_dwarf64_v4(section: bytes) -> bytes:
    """A 32-bit DWARF .debug_frame of version 1 CIEs without augmentation, rewritten as 64-bit DWARF with
    version 4 CIEs (address size 8): same content, other layout."""
    entries, pos = [], 0
    while pos < len(section):
        length, ident = struct.unpack_from("<II", section, pos)
        entries.append((pos, ident, section[pos + 8 : pos + 4 + length]))
        pos += 4 + length
    out, moved = bytearray(), {}
    for pos, ident, rest in entries:
        moved[pos] = len(out)
        if ident == 0xFFFFFFFF:
            assert rest[:2] == b"\x01\x00", "expected a version 1 CIE without augmentation"
            body = struct.pack("<Q", (1 << 64) - 1) + b"\x04\x00\x08\x00" + rest[2:]
        else:
            body = struct.pack("<Q", moved[ident]) + rest
        out += struct.pack("<IQ", 0xFFFFFFFF, len(body)) + body
    return bytes(out)


@pytest.fixture(scope="module")
def base(chain: Callable[[str], Path]) -> tuple[bytes, int, int, int, int]:
    """(the workload's bytes, its .eh_frame's file offset, address, size and section index) and a code
    address to point crafted FDEs at."""
    exe = chain("eh")
    with ElfFile(exe) as elf:
        sec = elf.section(".eh_frame")
        text = elf.section(".text").addr
        return exe.read_bytes(), sec.offset, sec.addr, sec.size, text


def _with_eh_frame(base: tuple[bytes, int, int, int, int], content: bytes) -> ElfFile:
    """The workload with `content` as its .eh_frame (at the same address): in place when it fits, else
    appended to the file with the section header pointed at it."""
    data, offset, _addr, size, _text = base
    out = bytearray(data)
    if len(content) <= size:
        out[offset : offset + size] = content + bytes(size - len(content))
    else:
        with ElfFile(data) as elf:
            index = [s.name for s in elf.sections].index(".eh_frame")
        _patch_section_header(out, index, offset=len(out), size=len(content))
        out += content
    return ElfFile(bytes(out))


def _one_fde(base: tuple[bytes, int, int, int, int], program: bytes, size: int = 16, **cie: object) -> bytes:
    _data, _offset, addr, _size, text = base
    c = _cie(**cie)  # type: ignore[arg-type]
    return c + _fde(addr, len(c), 0, text, size, program)


def _refused(elf_or_bytes: Callable[[], object]) -> ElfError:
    t = time.monotonic()
    with pytest.raises(ElfError) as e:
        elf_or_bytes()
    assert time.monotonic() - t < 2.0, "hostile input must be refused quickly"
    assert e.value.reason in (MALFORMED, TRUNCATED)
    return e.value


def test_a_crafted_fde_gives_the_rows_it_describes(base: tuple[bytes, int, int, int, int]) -> None:
    text = base[4]
    # advance 1, def_cfa_offset 16, offset rbp at cfa-16, advance 3, def_cfa_register rbp
    program = b"\x41\x0e\x10\x86\x02\x43\x0d\x06"
    table = build_table(_with_eh_frame(base, _one_fde(base, program, size=32)))
    assert rows_of(table) == [
        (text, (CFA_RSP, 8, 0)),
        (text + 1, (CFA_RSP, 16, -16)),
        (text + 4, (CFA_RBP, 16, -16)),
        (text + 32, (NO_INFO, 0, 0)),
    ]


def test_signal_frames_and_undefined_return_addresses(base: tuple[bytes, int, int, int, int]) -> None:
    text = base[4]
    signal = build_table(_with_eh_frame(base, _one_fde(base, b"\x41\x0e\x10", aug=b"zRS")))
    assert rows_of(signal) == [(text, (SIGNAL, 0, 0)), (text + 16, (NO_INFO, 0, 0))]
    outermost = build_table(_with_eh_frame(base, _one_fde(base, b"\x07\x10")))  # undefined r16
    assert rows_of(outermost) == [(text, (END, 0, 0)), (text + 16, (NO_INFO, 0, 0))]


HOSTILE_PROGRAMS = {
    "remember_state forever": b"\x0a" * 10_000,
    "restore_state with nothing remembered": b"\x0b",
    "huge advance_loc4": b"\x04\xff\xff\xff\xff",
    "set_loc backwards": b"\x41\x01" + struct.pack("<i", -0x1000),
    "unterminated LEB128": b"\x0e" + b"\x80" * 10_000,
    "expression past the program": b"\x0f\x7f\x00",
    "operand past the program": b"\x0c\x07",
    "unknown instruction": b"\x3f",
}


@pytest.mark.parametrize("program", HOSTILE_PROGRAMS.values(), ids=HOSTILE_PROGRAMS.keys())
def test_hostile_cfa_program_is_refused(base: tuple[bytes, int, int, int, int], program: bytes) -> None:
    elf = _with_eh_frame(base, _one_fde(base, program))
    _refused(lambda: build_table(elf))


def test_remember_state_may_nest_to_its_cap(base: tuple[bytes, int, int, int, int]) -> None:
    ok = b"\x0a" * MAX_STATE_DEPTH + b"\x0b" * MAX_STATE_DEPTH
    assert len(build_table(_with_eh_frame(base, _one_fde(base, ok)))) == 2
    elf = _with_eh_frame(base, _one_fde(base, b"\x0a" * (MAX_STATE_DEPTH + 1)))
    assert "remember_state" in str(_refused(lambda: build_table(elf)))


def test_advance_scaled_by_a_huge_code_alignment_is_refused(base: tuple[bytes, int, int, int, int]) -> None:
    elf = _with_eh_frame(base, _one_fde(base, b"\x04\xff\xff\xff\x7f", code_align=1 << 16))
    _refused(lambda: build_table(elf))
    elf = _with_eh_frame(base, _one_fde(base, b"", code_align=1 << 40))
    _refused(lambda: build_table(elf))


HOSTILE_CIES = {
    "legacy eh augmentation": {"aug": b"eh", "aug_data": b""},
    "unknown augmentation letter": {"aug": b"zRX"},
    "augmentation without z": {"aug": b"R"},
    "indirect FDE pointers": {"aug_data": b"\x9b"},
    "textrel FDE pointers": {"aug_data": b"\x23"},
    "CIE version 2": {"version": 2},
}


@pytest.mark.parametrize("cie", HOSTILE_CIES.values(), ids=HOSTILE_CIES.keys())
def test_hostile_cie_is_refused(base: tuple[bytes, int, int, int, int], cie: dict) -> None:
    elf = _with_eh_frame(base, _one_fde(base, b"", **cie))
    _refused(lambda: build_table(elf))


def test_cie_pointer_out_of_range_or_at_an_fde_is_refused(base: tuple[bytes, int, int, int, int]) -> None:
    _data, _offset, addr, _size, text = base
    c = _cie()
    outside = c + _fde(addr, len(c), -0x100000, text, 16, b"")
    assert "outside" in str(_refused(lambda: build_table(_with_eh_frame(base, outside))))
    first = _fde(addr, len(c), 0, text, 16, b"")
    at_fde = c + first + _fde(addr, len(c) + len(first), len(c), text + 16, 16, b"")
    assert "not one" in str(_refused(lambda: build_table(_with_eh_frame(base, at_fde))))


def test_lengths_past_the_section_end_are_refused(base: tuple[bytes, int, int, int, int]) -> None:
    c = _cie()
    e = _refused(lambda: build_table(_with_eh_frame(base, c + struct.pack("<I", 0x7FFFFFFF) + b"\0" * 8)))
    assert e.reason == TRUNCATED
    wide = c + struct.pack("<IQ", 0xFFFFFFFF, 1 << 62)
    assert _refused(lambda: build_table(_with_eh_frame(base, wide))).reason == TRUNCATED
    # an FDE whose header (pointers, augmentation length) runs past its own short length
    short = c + struct.pack("<IIi", 8, len(c) + 4, 0)
    _refused(lambda: build_table(_with_eh_frame(base, short)))


def test_truncated_sections_are_refused(base: tuple[bytes, int, int, int, int]) -> None:
    data, offset, _addr, size, _text = base
    with ElfFile(data) as elf:
        index = [s.name for s in elf.sections].index(".eh_frame")
    cut = bytearray(data)
    _patch_section_header(cut, index, size=30)  # the section ends inside its first FDE
    assert _refused(lambda: build_table(ElfFile(bytes(cut)))).reason == TRUNCATED
    for end in (26, 27, 28, 33):  # inside the FDE's length and header fields
        cut = bytearray(data)
        _patch_section_header(cut, index, size=end)
        _refused(lambda c=cut: build_table(ElfFile(bytes(c))))
    past_eof = bytearray(data)
    _patch_section_header(past_eof, index, offset=len(data) - size // 2)
    assert _refused(lambda: build_table(ElfFile(bytes(past_eof)))).reason == TRUNCATED


def test_randomly_damaged_eh_frame_never_escapes_as_another_exception(
    base: tuple[bytes, int, int, int, int],
) -> None:
    data, offset, _addr, size, _text = base
    rng = random.Random(1234)
    outcomes = {"table": 0, "refused": 0}
    start = time.monotonic()
    for _ in range(400):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            damaged[offset + rng.randrange(size)] = rng.randrange(256)
        try:
            build_table(ElfFile(bytes(damaged)))
            outcomes["table"] += 1
        except ElfError as e:
            assert e.reason in (MALFORMED, TRUNCATED)
            outcomes["refused"] += 1
    assert time.monotonic() - start < 30
    assert outcomes["table"] and outcomes["refused"]
