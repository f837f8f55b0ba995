"""AArch64 unwind tables (agent/unwind/, AArch64's rule layout in table.py's module doc) agree with binutils'
reading of real aarch64 files, row for row: workloads cross-built with aarch64-linux-gnu-gcc (signing their
return addresses, so their CFI holds DW_CFA_AARCH64_negate_ra_state) and Debian's arm64 glibc of the
cross toolchain (libc6-arm64-cross)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fleetprof.agent.process.rootfs import MALFORMED
from fleetprof.agent.symbols.elf import PF_X, ElfError, ElfFile, SymbolTable
from fleetprof.agent.unwind.cfi import RULE_SAME
from fleetprof.agent.unwind.table import (
    CFA_RBP,
    CFA_RSP,
    END,
    MAX_CFA_OFFSET_AARCH64,
    NO_INFO,
    SIGNAL,
    UNSUPPORTED,
    UnwindTable,
    aarch64_fields,
    encode_rule_aarch64,
    load_table,
    lookup,
)
from tests.conftest import WORKLOADS

READELF = shutil.which("readelf")
CROSS_GCC = shutil.which("aarch64-linux-gnu-gcc")
CROSS_LIBC = Path("/usr/aarch64-linux-gnu/lib/libc.so.6")
PAC = ["-mbranch-protection=standard"]

pytestmark = pytest.mark.skipif(
    READELF is None or CROSS_GCC is None, reason="needs binutils' readelf and aarch64-linux-gnu-gcc"
)

# (kind, CFA offset, x30's save from the CFA or None while in x30, x29's save or None): a rule as compared.
Expect = tuple[int, int, int | None, int | None]

_FDE_LINE = re.compile(r"^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ FDE cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_CIE_LINE = re.compile(r'^([0-9a-f]+) [0-9a-f]+ [0-9a-f]+ CIE "([^"]*)"')
_ADVANCE = re.compile(r"DW_CFA_(?:advance_loc\d?|set_loc): .* to ([0-9a-f]+)$")


def readelf_a64(path: Path) -> tuple[dict[int, str], list[dict]]:
    """(CIE augmentations by offset, FDEs) of the file's .eh_frame: each FDE's interpreted rows (readelf
    --debug-dump=frames-interp) and, from its raw instructions (--debug-dump=frames), the first location
    where it makes x30 undefined. frames-interp prints "u" both for a register with no rule (x30 at a
    function's entry: the return address is still in it) and for DW_CFA_undefined (the outermost frame):
    only the raw dump tells them apart."""
    interp = subprocess.run(
        [READELF, "--debug-dump=frames-interp", str(path)], capture_output=True, text=True
    )
    raw = subprocess.run([READELF, "--debug-dump=frames", str(path)], capture_output=True, text=True)
    undefined_at: dict[int, int] = {}
    offset = loc = -1
    for line in raw.stdout.split("Contents of the .debug_frame")[0].splitlines():
        if m := _FDE_LINE.match(line):
            offset, loc = int(m[1], 16), int(m[3], 16)
        elif m := _CIE_LINE.match(line):
            offset = -1
        elif offset >= 0 and (m := _ADVANCE.search(line.strip())):
            loc = int(m[1], 16)
        elif offset >= 0 and line.strip().startswith("DW_CFA_undefined: r30"):
            undefined_at.setdefault(offset, loc)
    cies: dict[int, str] = {}
    fdes: list[dict] = []
    fde: dict | None = None
    columns: list[str] = []
    for line in interp.stdout.split("Contents of the .debug_frame")[0].splitlines():
        if m := _CIE_LINE.match(line):
            cies[int(m[1], 16)] = m[2]
            fde = None
        elif m := _FDE_LINE.match(line):
            off = int(m[1], 16)
            fde = {"cie": int(m[2], 16), "begin": int(m[3], 16), "end": int(m[4], 16), "rows": []}
            fde["undefined_at"] = undefined_at.get(off)
            fdes.append(fde)
            columns = []
        elif line.startswith("   LOC"):
            columns = line.split()[1:]
        elif "ZERO terminator" in line:
            fde = None
        elif fde is not None and columns and re.match(r"^[0-9a-f]+ +\S", line):
            loc_text, *values = line.split()
            assert len(values) == len(columns), (line, columns)
            fde["rows"].append(
                (int(loc_text, 16), values[0], dict(zip(columns[1:], values[1:], strict=True)))
            )
    assert fdes, f"readelf printed no .eh_frame FDEs for {path}"
    return cies, fdes


def _save(text: str) -> int | None:
    m = re.fullmatch(r"c([+-]\d+)", text)
    return int(m[1]) if m else None


def _fits(off: int, cfa_off: int) -> tuple[bool, bool]:
    """Whether a save at CFA + off fits the slots counted down from the CFA, and those counted up from the
    CFA's register (table.py's module doc: 8-bit counts of 8 bytes, 0 meaning no save)."""
    if off % 8:
        return False, False
    return -255 * 8 <= off <= -8, 0 <= off + cfa_off <= 254 * 8


def expected_rule(
    augmentation: str, loc: int, cfa: str, regs: dict[str, str], undefined_at: int | None
) -> Expect:
    """What the table must say for one readelf row, from the layout table.py's module doc describes."""
    if "S" in augmentation:
        return SIGNAL, 0, None, None
    ra_text = regs.get("ra", "u")
    if ra_text in ("u", "s") and undefined_at is not None and loc >= undefined_at:
        return END, 0, None, None
    m = re.fullmatch(r"(sp|x29)\+(\d+)", cfa)
    if not m or int(m[2]) % 8 or int(m[2]) > MAX_CFA_OFFSET_AARCH64:
        return UNSUPPORTED, 0, None, None
    k, cfa_off = (CFA_RSP if m[1] == "sp" else CFA_RBP), int(m[2])
    ra = None if ra_text in ("u", "s") else _save(ra_text)
    if ra is None and ra_text not in ("u", "s"):
        return UNSUPPORTED, 0, None, None  # x30 in another register, by expression
    fp_text = regs.get("x29", "u")
    fp = None if fp_text in ("u", "s") else _save(fp_text)
    fp_known = fp is not None or fp_text in ("u", "s")
    ra_fits = (True, True) if ra is None else _fits(ra, cfa_off)
    fp_fits = (False, False) if not fp_known else (True, True) if fp is None else _fits(fp, cfa_off)
    if any(r and f for r, f in zip(ra_fits, fp_fits, strict=True)):
        return k, cfa_off, ra, fp
    if k == CFA_RBP or not any(ra_fits):
        return UNSUPPORTED, 0, None, None
    return k, cfa_off, ra, None  # x29's save out of reach: the caller's x29 stays (as on x86-64)


def assert_agrees_with_readelf(path: Path, table: UnwindTable) -> list[tuple[int, Expect]]:
    """Every readelf row of every .eh_frame FDE in executable code looks up to the same rule in `table`;
    returns the rows compared, (pc, rule)."""
    cies, fdes = readelf_a64(path)
    with ElfFile(path) as elf:
        ranges = [(s.vaddr, s.vaddr + s.memsz) for s in elf.load_segments if s.flags & PF_X]
    compared: list[tuple[int, Expect]] = []
    wrong = []
    for fde in fdes:
        if fde["end"] <= fde["begin"] or not any(lo <= fde["begin"] < hi for lo, hi in ranges):
            continue
        by_loc: dict[int, Expect] = {}
        for loc, cfa, regs in fde["rows"]:
            if fde["begin"] <= loc < fde["end"]:
                by_loc[loc] = expected_rule(cies[fde["cie"]], loc, cfa, regs, fde["undefined_at"])
        if not by_loc:  # no instructions of its own: the CIE's initial row (CFA sp+0, x30 not saved)
            by_loc[fde["begin"]] = (CFA_RSP, 0, None, None)
        for loc, want in sorted(by_loc.items()):
            rule = lookup(table, loc)
            got = aarch64_fields(rule) if rule is not None else None
            compared.append((loc, want))
            if got != want:
                wrong.append((hex(loc), want, got))
    assert not wrong, (
        f"{len(wrong)} of {len(compared)} rows differ from readelf, e.g. (pc, readelf, ours): {wrong[:5]}"
    )
    return compared


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, list[str]], Path]:
    out = tmp_path_factory.mktemp("a64")

    def build(name: str, flags: list[str]) -> Path:
        exe = out / name
        if not exe.exists():
            subprocess.run(
                [CROSS_GCC, *flags, "-o", str(exe), str(WORKLOADS / f"{name.split('-')[0]}.c")], check=True
            )
        return exe

    return build


def raw_frames(path: Path) -> str:
    return subprocess.run([READELF, "--debug-dump=frames", str(path)], capture_output=True, text=True).stdout


def test_signed_frames_without_frame_pointers_agree_with_readelf(
    build: Callable[[str, list[str]], Path],
) -> None:
    """-O2 without frame pointers, return addresses signed: negate_ra_state in every non-leaf function (a
    reader that does not know it refuses the file), rows as readelf reads them, x30's save at the top of
    small frames and at the bottom of the 8 KB one."""
    exe = build("frames_a64-nofp", ["-O2", "-fomit-frame-pointer", *PAC])
    assert "DW_CFA_AARCH64_negate_ra_state" in raw_frames(exe)
    table = load_table(exe)
    compared = assert_agrees_with_readelf(exe, table)
    assert len(compared) > 20
    kinds = {want[0] for _pc, want in compared}
    assert {CFA_RSP, END, UNSUPPORTED} <= kinds  # frames, _start, the 70 KB frame
    rules = [aarch64_fields(int(r)) for r in table.rules]
    # x30 still in x30 (the leaf, every prologue before its save), saved near the CFA, and saved 8 KB below
    # it (counted up from sp: its slot from the CFA would need 11 bits).
    assert any(k == CFA_RSP and ra is None for k, _o, ra, _fp in rules)
    assert any(k == CFA_RSP and ra is not None and -64 <= ra < 0 for k, _o, ra, _fp in rules)
    assert any(k == CFA_RSP and ra is not None and ra < -8000 for k, _o, ra, _fp in rules)


def test_frame_records_of_o0_code_agree_with_readelf(build: Callable[[str, list[str]], Path]) -> None:
    """-O0 with frame pointers: every function saves x29 and x30 as a pair (its frame record), at the
    bottom of the 8 KB frame too, where both slots count up from sp."""
    exe = build("frames_a64-fp", ["-O0", "-fno-omit-frame-pointer", *PAC])
    table = load_table(exe)
    compared = assert_agrees_with_readelf(exe, table)
    pairs = [w for _pc, w in compared if w[0] in (CFA_RSP, CFA_RBP) and w[2] is not None]
    assert len(pairs) >= 4, compared
    assert all(fp is not None and ra == fp + 8 for _k, _o, ra, fp in pairs), pairs
    assert any(fp < -8000 for _k, _o, _ra, fp in pairs), pairs


def test_debians_arm64_glibc_agrees_with_readelf() -> None:
    if not CROSS_LIBC.exists():
        pytest.skip(f"{CROSS_LIBC} is not installed (libc6-arm64-cross)")
    table = load_table(CROSS_LIBC)
    compared = assert_agrees_with_readelf(CROSS_LIBC, table)
    assert len(compared) > 5000
    kinds = np.bincount(table.rules & 7, minlength=6)
    assert kinds[END] >= 1  # thread entries: .cfi_undefined x30
    assert kinds[CFA_RSP] > 1000 and kinds[NO_INFO] > 100
    assert kinds[CFA_RBP] > 10  # hand-written and alloca functions: CFA from x29


def test_aarch64_rule_layout() -> None:
    """The fields the BPF walk reads (cpu_sampler.c, ARCH_ARM64), by value."""
    same, undefined = 0, 1
    at = lambda off: off << 3 | 2  # noqa: E731 -- RULE_OFFSET: saved at CFA + off
    # stp x29, x30, [sp, -32]!: CFA sp + 32, x29 at CFA - 32, x30 at CFA - 24: counted down (4 and 3).
    rule = encode_rule_aarch64(False, 31, 32, at(-32), at(-24))
    assert rule == CFA_RSP | 4 << 3 | 3 << 16 | 4 << 24
    assert aarch64_fields(rule) == (CFA_RSP, 32, -24, -32)
    # GCC 12's large frame, record at sp: CFA sp + 8224, x29 at CFA - 8224, x30 at CFA - 8216: counted up
    # from sp (bit 15): x29 at sp + 0 (v 1), x30 at sp + 8 (v 2).
    rule = encode_rule_aarch64(False, 31, 8224, at(-8224), at(-8216))
    assert rule == CFA_RSP | 1028 << 3 | 1 << 15 | 2 << 16 | 1 << 24
    assert aarch64_fields(rule) == (CFA_RSP, 8224, -8216, -8224)
    # A leaf: CFA sp + 0, x30 not saved.
    assert encode_rule_aarch64(False, 31, 0, same, same) == CFA_RSP
    assert encode_rule_aarch64(False, 29, 16, at(-16), at(-8)) == CFA_RBP | 2 << 3 | 1 << 16 | 2 << 24
    assert encode_rule_aarch64(False, 31, 0, same, undefined) == END
    assert encode_rule_aarch64(True, 31, 0, same, same) == SIGNAL
    assert encode_rule_aarch64(False, 31, MAX_CFA_OFFSET_AARCH64 + 8, same, same) == UNSUPPORTED
    assert encode_rule_aarch64(False, 31, 12, same, same) == UNSUPPORTED  # not a multiple of 8
    assert encode_rule_aarch64(False, 31, 16, same, 30 << 3 | 4) == UNSUPPORTED  # x30 in another register
    assert encode_rule_aarch64(False, 1, 16, same, same) == UNSUPPORTED  # CFA from x1


def test_x86_64_files_still_refuse_negate_ra_state() -> None:
    """0x2d is AArch64's negate_ra_state only in AArch64 files (SPARC's window_save elsewhere): an x86-64
    section that holds it is malformed, as before."""
    from fleetprof.agent.unwind.cfi import parse_eh_frame
    from fleetprof.agent.unwind.table import encode_rule

    # One CIE (zR, pcrel|sdata4; CFA rsp + 8, return address at CFA - 8) and one FDE whose program is 0x2d.
    cie_body = b"\0\0\0\0" + bytes([1]) + b"zR\0" + bytes([1, 0x78, 16, 1, 0x1B]) + b"\x0c\x07\x08\x90\x01"
    cie_body += b"\0" * (-len(cie_body) % 4)
    cie_entry = len(cie_body).to_bytes(4, "little") + cie_body
    at = len(cie_entry)
    fde_body = (at + 4).to_bytes(4, "little") + (0).to_bytes(4, "little") + (16).to_bytes(4, "little")
    fde_body += b"\0" + b"\x2d\0\0"
    section = cie_entry + len(fde_body).to_bytes(4, "little") + fde_body + b"\0\0\0\0"
    with pytest.raises(ElfError, match="unknown instruction 0x2d") as e:
        parse_eh_frame(section, 0x1000, 0, encode_rule)
    assert e.value.reason == MALFORMED
    rows = parse_eh_frame(section, 0x1000, 0, encode_rule_aarch64, aarch64=True)
    assert len(rows.begins) == 1


LEAVES_C = """
long ext(long);
long add3(long a) { return a + 3; }
long loop_sum(const long *p, long n) { long s = 0; for (long i = 0; i < n; i++) s += p[i]; return s; }
long calls(long a) { return ext(a) + 1; }
long framed(long a) { volatile long buf[64]; buf[a & 63] = a; return buf[(a + 1) & 63]; }
"""


def test_a_file_without_cfi_gets_rows_for_its_frameless_leaves_only(tmp_path: Path) -> None:
    """The arm64 kernel's vDSO has neither .eh_frame nor .debug_frame; its functions sign x30 and never save
    it, move sp or call. Such leaves get CFA = sp with the return address in x30; a function that calls or
    makes a frame gets no rows (frame pointers there). Built as the kernel builds its vDSO: no unwind
    tables, return addresses signed."""
    src = tmp_path / "leaves.c"
    src.write_text(LEAVES_C)
    lib = tmp_path / "libleaves.so"
    no_cfi = ["-nostdlib", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"]  # crt files bring some
    subprocess.run(
        [CROSS_GCC, "-O2", "-shared", "-fPIC", *no_cfi, *PAC, "-o", str(lib), str(src)], check=True
    )
    with ElfFile(lib) as elf:
        assert elf.section(".eh_frame") is None and elf.section(".debug_frame") is None
        symbols = {name: (start, size) for start, size, name in SymbolTable.from_elf(elf)}
    table = load_table(lib)
    for name, rows in (("add3", True), ("loop_sum", True), ("calls", False), ("framed", False)):
        start, size = symbols[name]
        got = {lookup(table, pc) for pc in range(start, start + size, 4)}
        want = {encode_rule_aarch64(False, 31, 0, RULE_SAME, RULE_SAME)} if rows else {None, NO_INFO}
        assert got <= want and got, (name, got)
    assert aarch64_fields(encode_rule_aarch64(False, 31, 0, RULE_SAME, RULE_SAME)) == (CFA_RSP, 0, None, None)
