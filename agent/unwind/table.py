"""The compact unwind table of one ELF file: sorted (pc, rule) rows that the BPF unwinder binary-searches.

The table (agent/bpf C code mirrors this; keep both in step)
------------------------------------------------------------
Two arrays of equal length, sorted by pc, both u32:
  pcs[i]    the ELF virtual address (not the runtime one: subtract the mapping's load bias first) where
            row i starts; it applies up to pcs[i + 1]. An address below pcs[0] has no information.
  rules[i]  the rule for those addresses:
      bits 0-2   kind
                 0 CFA_RSP      CFA = rsp + off; the return address is at CFA - 8
                 1 CFA_RBP      CFA = rbp + off; the return address is at CFA - 8
                 2 END          the return address is undefined: the outermost frame (_start, a thread's
                                entry); stop unwinding
                 3 UNSUPPORTED  CFI exists but not in a form this table holds: a CFA computed by a DWARF
                                expression (PLT stubs), from another register, or with an offset outside
                                0 .. 2^17-1; a return address not saved at CFA - 8; a CFA from rbp while
                                this frame's save of rbp is not representable
                 4 SIGNAL       a signal trampoline's frame (CIE augmentation "S", e.g. glibc __restore_rt):
                                the interrupted registers are in the ucontext on the stack
                 5 NO_INFO      no FDE covers these addresses (a gap between functions, code without CFI):
                                fall back to frame pointers
      bits 3-19  off: the CFA offset in bytes (CFA_RSP, CFA_RBP; 0 for every other kind)
      bits 20-31 the rbp rule, a signed 12-bit count of 8-byte slots: 0 means this frame leaves rbp as the
                 caller's (no rule, same_value or undefined, or the save is not representable); v != 0
                 means the caller's rbp was saved at CFA + 8*v (-2 after the usual `push rbp`). 0 for
                 every kind but CFA_RSP and CFA_RBP.
Rows with equal rules are merged; each FDE's end gets a NO_INFO row unless the next FDE starts there.

AArch64 files (e_machine 183) have rules of their own layout, same kinds (CFA_RSP: the CFA is sp + off,
CFA_RBP: x29 + off), for what differs there: `bl` leaves the return address in x30 (the link register),
which a function saves wherever its prologue puts it (GCC 12's frame record lies at the bottom of the frame:
x30 at CFA - 264 in a 272-byte frame), or never saves if it calls nothing:
      bits 0-2   kind, as above
      bits 3-14  off: the CFA offset in 8-byte units (0 .. 32,760 bytes)
      bit 15     where the two save slots count from: 0 down from the CFA (at CFA - 8*v), 1 up from the
                 register the CFA comes from (sp or x29: at reg + 8*(v - 1)); the encoder takes the first
                 in which both fit, so a frame record at either end of a large frame fits
      bits 16-23 v of the return address (x30): 0 means it is still in x30, not saved (a leaf, or a
                 prologue before its save): the walk takes x30 of the sampled registers, at the first frame
                 only
      bits 24-31 v of x29: 0 means this frame leaves x29 as the caller's
The walk strips pointer-authentication signatures from every return address (bits above the 48-bit user
address space), so rows do not say which are signed (DW_CFA_AARCH64_negate_ra_state is read and dropped).

.eh_frame is the source; .debug_frame fills only the addresses .eh_frame does not cover. FDEs that do not
start inside an executable PT_LOAD segment are dropped: linkers point the FDEs of discarded functions in
.debug_frame at 0 (plus the function's offset) or at -1, and the BPF side never looks there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fleetprof.agent.process.rootfs import MALFORMED
from fleetprof.agent.symbols.elf import PF_X, ElfError, ElfFile, SymbolTable
from fleetprof.agent.unwind.cfi import (
    RBP,
    RSP,
    RULE_OFFSET,
    RULE_SAME,
    RULE_UNDEFINED,
    SP_AARCH64,
    X29,
    FrameRows,
    parse_debug_frame,
    parse_eh_frame,
)

CFA_RSP = 0
CFA_RBP = 1
END = 2
UNSUPPORTED = 3
SIGNAL = 4
NO_INFO = 5
KIND_NAMES = ("CFA_RSP", "CFA_RBP", "END", "UNSUPPORTED", "SIGNAL", "NO_INFO")

MAX_CFA_OFFSET = (1 << 17) - 1
_OFF_SHIFT = 3
_RBP_SHIFT = 20
_RBP_MIN, _RBP_MAX = -(1 << 11), (1 << 11) - 1
_U32_LIMIT = 1 << 32
EM_X86_64 = 62
EM_AARCH64 = 183

# AArch64's layout (module doc).
MAX_CFA_OFFSET_AARCH64 = ((1 << 12) - 1) * 8
_A64_SLOTS_FROM_REG = 1 << 15
_A64_RA_SHIFT = 16
_A64_FP_SHIFT = 24

# The one rule x86-64 code uses for its return address: pushed by `call`, right below the CFA.
_RA_AT_CFA_MINUS_8 = (-8 << 3) | RULE_OFFSET


@dataclass(frozen=True, eq=False)
class UnwindTable:
    """One ELF file's unwind rows: `pcs` and `rules`, uint32 numpy arrays of equal length (module doc)."""

    pcs: np.ndarray
    rules: np.ndarray

    def __len__(self) -> int:
        return len(self.pcs)

    @property
    def nbytes(self) -> int:
        """Bytes both arrays hold (what the BPF map needs for this file)."""
        return self.pcs.nbytes + self.rules.nbytes


def kind(rule: int) -> int:
    """The rule's kind: CFA_RSP, CFA_RBP, END, UNSUPPORTED, SIGNAL or NO_INFO."""
    return rule & 7


def cfa_offset(rule: int) -> int:
    """The CFA offset in bytes (CFA_RSP and CFA_RBP rows)."""
    return (rule >> _OFF_SHIFT) & MAX_CFA_OFFSET


def rbp_offset(rule: int) -> int:
    """Where the caller's rbp was saved, in bytes from the CFA; 0 when this frame leaves rbp unchanged."""
    v = (rule >> _RBP_SHIFT) & 0xFFF
    return (v - 0x1000 if v & 0x800 else v) * 8


def lookup(table: UnwindTable, vaddr: int) -> int | None:
    """The rule of the row with the largest pc <= vaddr (what the BPF side finds), None below the first."""
    pcs = table.pcs
    if not len(pcs) or vaddr < int(pcs[0]):
        return None
    i = int(np.searchsorted(pcs, min(vaddr, _U32_LIMIT - 1), side="right")) - 1
    return int(table.rules[i])


def encode_rule(signal: bool, cfa_reg: int, cfa_off: int, rbp: int, ra: int) -> int:
    """The u32 rule for one CFI row: cfa_reg/cfa_off the CFA rule (cfa_reg CFA_EXPRESSION for an
    expression); rbp and ra the register rules of agent/unwind/cfi.py (value << 3 | tag)."""
    if signal:
        return SIGNAL
    if ra != _RA_AT_CFA_MINUS_8:
        return END if ra == RULE_UNDEFINED else UNSUPPORTED
    if rbp == RULE_SAME or rbp == RULE_UNDEFINED:
        slot = 0
    elif rbp & 7 == RULE_OFFSET and not (rbp >> 3) & 7 and _RBP_MIN <= rbp >> 6 <= _RBP_MAX and rbp >> 6:
        slot = (rbp >> 6) & 0xFFF
    else:
        if cfa_reg == RBP:
            return UNSUPPORTED  # the caller's rbp cannot be restored, yet this frame's CFA needs it
        slot = 0
    if not 0 <= cfa_off <= MAX_CFA_OFFSET:
        return UNSUPPORTED
    if cfa_reg == RSP:
        return CFA_RSP | cfa_off << _OFF_SHIFT | slot << _RBP_SHIFT
    if cfa_reg == RBP:
        return CFA_RBP | cfa_off << _OFF_SHIFT | slot << _RBP_SHIFT
    return UNSUPPORTED  # CFA_EXPRESSION, or another register


def _a64_slot(rule: int, cfa_off: int, from_reg: bool) -> int | None:
    """The 8-bit v of one register's save in AArch64's layout (module doc): 0 for no save, None when the
    rule is a save that does not fit (or is no plain save at CFA + n)."""
    if rule == RULE_SAME or rule == RULE_UNDEFINED:
        return 0
    if rule & 7 != RULE_OFFSET:
        return None
    off = rule >> 3  # from the CFA
    if off % 8:
        return None
    v = (off + cfa_off) // 8 + 1 if from_reg else -off // 8
    return v if 0 < v <= 0xFF else None


def encode_rule_aarch64(signal: bool, cfa_reg: int, cfa_off: int, fp: int, ra: int) -> int:
    """The u32 rule of one AArch64 CFI row (module doc): fp and ra are the rules of x29 and x30."""
    if signal:
        return SIGNAL
    if ra == RULE_UNDEFINED:
        return END  # _start's, a thread's entry: .cfi_undefined x30
    if cfa_reg == SP_AARCH64:
        kind_ = CFA_RSP
    elif cfa_reg == X29:
        kind_ = CFA_RBP
    else:
        return UNSUPPORTED  # CFA_EXPRESSION, or another register
    if not 0 <= cfa_off <= MAX_CFA_OFFSET_AARCH64 or cfa_off % 8:
        return UNSUPPORTED
    base = kind_ | (cfa_off // 8) << 3
    for from_reg in (False, True):
        ra_v = _a64_slot(ra, cfa_off, from_reg)
        fp_v = _a64_slot(fp, cfa_off, from_reg)
        if ra_v is not None and fp_v is not None:
            flags = _A64_SLOTS_FROM_REG if from_reg else 0
            return base | flags | ra_v << _A64_RA_SHIFT | fp_v << _A64_FP_SHIFT
    if kind_ == CFA_RBP:
        return UNSUPPORTED  # this frame's CFA needs x29, whose save the table cannot hold
    for from_reg in (False, True):
        # As on x86-64: a save of x29 the table cannot hold leaves the caller's x29 as this frame's.
        ra_v = _a64_slot(ra, cfa_off, from_reg)
        if ra_v is not None:
            return base | (_A64_SLOTS_FROM_REG if from_reg else 0) | ra_v << _A64_RA_SHIFT
    return UNSUPPORTED  # x30 held in another register, by expression, or saved out of reach


def aarch64_fields(rule: int) -> tuple[int, int, int | None, int | None]:
    """(kind, CFA offset, where x30 was saved, where x29 was saved) of an AArch64 rule, both saves in bytes
    from the CFA: x30's None while it is still in x30, x29's None when it is the caller's."""
    k = rule & 7
    if k not in (CFA_RSP, CFA_RBP):
        return k, 0, None, None
    cfa_off = ((rule >> 3) & 0xFFF) * 8
    from_reg = bool(rule & _A64_SLOTS_FROM_REG)

    def slot(v: int) -> int | None:
        if not v:
            return None
        return 8 * (v - 1) - cfa_off if from_reg else -8 * v

    return k, cfa_off, slot((rule >> _A64_RA_SHIFT) & 0xFF), slot((rule >> _A64_FP_SHIFT) & 0xFF)


def build_table(elf: ElfFile) -> UnwindTable:
    """The unwind table of an x86-64 or AArch64 ELF file from its .eh_frame, with .debug_frame filling the
    addresses .eh_frame does not cover; empty when it has neither. ElfError when the CFI is malformed or
    the file's code lies at or above 4 GiB (the table's pcs are u32). The rules' layout is the file's
    architecture's (module doc)."""
    machine = int.from_bytes(elf.read(18, 2), "little")
    if machine == EM_X86_64:
        encode, aarch64 = encode_rule, False
    elif machine == EM_AARCH64:
        encode, aarch64 = encode_rule_aarch64, True
    else:
        raise ElfError(
            f"unwind tables are built for x86-64 and AArch64 files only (this one is e_machine {machine})"
        )
    exec_ranges = [(s.vaddr, s.vaddr + s.memsz) for s in elf.load_segments if s.flags & PF_X]
    pcs = rules = np.zeros(0, np.uint32)
    eh = elf.section(".eh_frame")
    if eh is not None and eh.size:
        got = elf.section(".got.plt") or elf.section(".got")
        frames = parse_eh_frame(elf.section_data(eh), eh.addr, got.addr if got else 0, encode, aarch64)
        pcs, rules = _rows(frames, exec_ranges, ".eh_frame")
    dbg = elf.section(".debug_frame")
    if dbg is not None and dbg.size:
        frames = parse_debug_frame(elf.section_data(dbg), encode, aarch64)
        dpcs, drules = _rows(frames, exec_ranges, ".debug_frame")
        pcs, rules = _overlay(pcs, rules, dpcs, drules) if len(pcs) else (dpcs, drules)
    if aarch64 and (eh is None or not eh.size) and (dbg is None or not dbg.size):
        pcs, rules = _frameless_leaves_aarch64(elf)
    return UnwindTable(pcs, rules)


# AArch64 instructions that make a function more than a frameless leaf (masks, values): calls (bl; blr and
# its pointer-authenticated forms), and writes of sp or x29 (add/sub immediate or extended register with
# Rd sp or x29; loads and stores that write back their base register sp).
_A64_CALLS = ((0xFC000000, 0x94000000), (0xFEFFF000, 0xD63F0000))
_A64_ADD_SUB_IMM = (0xBF000000, 0x91000000)  # add/sub (not adds/subs), 64-bit, immediate
_A64_ADD_SUB_EXT = (0xBFE00000, 0x8B200000)  # add/sub (not adds/subs), 64-bit, extended register
_A64_PAIR_WRITEBACK = (0x3A800000, 0x28800000)  # ldp/stp post- (index 01) or pre-indexed (11)
_A64_SINGLE_WRITEBACK = (0x3B200400, 0x38000400)  # ldr/str (immediate) post- or pre-indexed


def _frameless(code: bytes) -> bool:
    """Whether AArch64 code never calls and never moves sp or x29: its return address stays in x30 and its
    CFA is sp throughout."""
    w = np.frombuffer(code[: len(code) // 4 * 4], dtype="<u4").astype(np.uint32)
    rd, rn = w & 31, (w >> 5) & 31
    bad = np.zeros(len(w), dtype=bool)
    for mask, value in _A64_CALLS:
        bad |= (w & mask) == value
    for mask, value in (_A64_ADD_SUB_IMM, _A64_ADD_SUB_EXT):
        bad |= ((w & mask) == value) & ((rd == 31) | (rd == 29))
    for mask, value in (_A64_PAIR_WRITEBACK, _A64_SINGLE_WRITEBACK):
        bad |= ((w & mask) == value) & (rn == 31)
    return not bad.any()


def _frameless_leaves_aarch64(elf: ElfFile) -> tuple[np.ndarray, np.ndarray]:
    """Rows for an AArch64 file without any CFI (the arm64 kernel's vDSO has none): each function of its
    symbol table whose code is a frameless leaf (_frameless) has CFA = sp and its return address in x30 (the
    kernel's clock_gettime signs and checks it with paciasp/autiasp, and never saves it); the signal
    trampoline (`*sigreturn`) is a signal frame. Other functions have no rows: frame pointers there."""
    leaf = encode_rule_aarch64(False, SP_AARCH64, 0, RULE_SAME, RULE_SAME)
    rows: dict[int, int] = {}
    for start, size, name in sorted(SymbolTable.from_elf(elf)):
        seg = next(
            (g for g in elf.load_segments if g.vaddr <= start and start + size <= g.vaddr + g.filesz), None
        )
        if not size or seg is None or not seg.flags & PF_X or start + size > 0xFFFFFFFF:
            continue
        if name.split("@", 1)[0].endswith("sigreturn"):
            rule = SIGNAL
        elif _frameless(elf.read(seg.offset + start - seg.vaddr, size)):
            rule = leaf
        else:
            continue
        rows.setdefault(start + size, NO_INFO)
        rows[start] = rule  # over the end row of a function just before it
    if not rows:
        return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
    pcs = np.array(sorted(rows), dtype=np.uint32)
    return _merge(pcs, np.array([rows[int(pc)] for pc in pcs], dtype=np.uint32))


def load_table(source: str | os.PathLike[str] | int) -> UnwindTable:
    """build_table() of the file at a path (of the agent's own filesystem) or an open file descriptor,
    which is closed afterwards (ElfFile owns it)."""
    with ElfFile(source) as elf:
        return build_table(elf)


def _rows(frames: FrameRows, exec_ranges: list[tuple[int, int]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, merged (pcs, rules) of one section's FDEs, with NO_INFO rows at their ends."""
    begins = np.frombuffer(frames.begins, np.uint64)
    sizes = np.frombuffer(frames.sizes, np.uint64)
    progs = np.frombuffer(frames.progs, np.uint64)
    keep = sizes > 0
    if exec_ranges:
        inside = np.zeros(len(begins), bool)
        for lo, hi in exec_ranges:
            inside |= (begins >= lo) & (begins < hi)
        keep &= inside
    if not keep.all():
        begins, sizes, progs = begins[keep], sizes[keep], progs[keep]
    if not len(begins):
        return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
    sizes = np.minimum(sizes, np.uint64(2**64 - 1) - begins)  # no end past 2^64 (it would wrap)
    ends = begins + sizes
    final_locs = np.frombuffer(frames.final_locs, np.uint32)[progs]
    over = final_locs > sizes
    if over.any():
        i = int(np.argmax(over))
        raise ElfError(
            f"{name}: the FDE for {int(begins[i]):#x} advances {int(final_locs[i])} bytes, past its "
            f"{int(sizes[i])}-byte range",
            MALFORMED,
        )
    top = int(ends.max())
    if top >= _U32_LIMIT:
        raise ElfError(
            f"{name}: code up to {top:#x}: unwind tables hold 32-bit addresses, and this file's code lies "
            "at or above 4 GiB",
            MALFORMED,
        )
    # From here every address fits in 32 bits (an FDE's rows lie below its end).
    order = np.argsort(begins, kind="stable")
    begins, ends, progs = begins[order].astype(np.uint32), ends[order].astype(np.uint32), progs[order]
    # Overlapping FDEs (never written by a compiler): the later start wins.
    ends = np.minimum(ends, np.append(begins[1:], ends[-1]))
    keep = ends > begins
    if not keep.all():
        begins, ends, progs = begins[keep], ends[keep], progs[keep]

    # Each FDE's rows are its program's slice of the pool, shifted to the FDE's start; 32-bit indexes (the
    # pool is smaller than the section) keep this, the agent's peak, at ~20 bytes per row.
    n = len(begins)
    starts = np.frombuffer(frames.starts, np.uint64).astype(np.int64)
    first = starts[progs]
    counts = starts[progs + 1] - first
    row_fde = np.repeat(np.arange(n, dtype=np.int32), counts)
    pool_index = np.arange(len(row_fde), dtype=np.int32)
    pool_index -= np.repeat((np.cumsum(counts) - counts - first).astype(np.int32), counts)
    row_pcs = np.frombuffer(frames.offsets, np.uint32)[pool_index]
    in_range = row_pcs < (ends - begins)[row_fde]
    if not in_range.all():  # rows at or past the FDE's end (a final advance to it, an overlap cut short)
        row_fde, pool_index, row_pcs = row_fde[in_range], pool_index[in_range], row_pcs[in_range]
    del in_range
    row_pcs += begins[row_fde]
    row_rules = np.frombuffer(frames.rules, np.uint32)[pool_index]
    del pool_index

    # Interleave a NO_INFO row after each FDE that the next one does not follow directly.
    gap = np.append(ends[:-1] != begins[1:], True)
    markers_before = np.cumsum(gap, dtype=np.int64) - gap
    kept = np.bincount(row_fde, minlength=n)
    out_pcs = np.empty(len(row_pcs) + int(gap.sum()), np.uint32)
    out_rules = np.empty(len(out_pcs), np.uint32)
    row_pos = np.arange(len(row_pcs), dtype=np.int32)
    row_pos += markers_before.astype(np.int32)[row_fde]
    del row_fde
    out_pcs[row_pos] = row_pcs
    out_rules[row_pos] = row_rules
    del row_pos, row_pcs, row_rules
    marker_pos = (np.cumsum(kept) + markers_before)[gap]
    out_pcs[marker_pos] = ends[gap]
    out_rules[marker_pos] = NO_INFO
    return _merge(out_pcs, out_rules)


def _merge(pcs: np.ndarray, rules: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop each row whose rule equals the row before it."""
    if len(rules) < 2:
        return pcs, rules
    keep = np.empty(len(rules), bool)
    keep[0] = True
    np.not_equal(rules[1:], rules[:-1], out=keep[1:])
    return pcs[keep], rules[keep]


def _overlay(
    top_pcs: np.ndarray, top_rules: np.ndarray, pcs: np.ndarray, rules: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `top` where it has information (not NO_INFO, not below its first row), else the other's."""
    if not len(pcs):
        return top_pcs, top_rules
    every = np.union1d(top_pcs, pcs)
    ti = np.searchsorted(top_pcs, every, side="right") - 1
    top = np.where(ti >= 0, top_rules[np.maximum(ti, 0)], NO_INFO).astype(np.uint32)
    bi = np.searchsorted(pcs, every, side="right") - 1
    bottom = np.where(bi >= 0, rules[np.maximum(bi, 0)], NO_INFO).astype(np.uint32)
    merged = np.where(top & 7 == NO_INFO, bottom, top).astype(np.uint32)
    known = np.flatnonzero(merged != NO_INFO)
    if not len(known):
        return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
    every, merged = every[known[0] :], merged[known[0] :]
    return _merge(every, merged)
