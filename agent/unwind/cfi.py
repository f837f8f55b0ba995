"""Our own x86-64 and AArch64 .eh_frame / .debug_frame reader: runs each FDE's CFA program into rows.

Sources: the DWARF 5 standard, section 6.4 (call frame information), and the Linux Standard Base's
description of .eh_frame (its CIE/FDE layout, augmentation letters and DW_EH_PE_* pointer encodings).

The sections come from tenants' files (see agent/symbols/elf.py), so rules this file keeps:
  * every malformed input is an ElfError (reason "malformed", or "truncated" where a length runs past the
    section's end); no IndexError, struct.error or OverflowError leaves this module;
  * the work is bounded by the section: each instruction consumes at least one byte, every length is
    checked against its entry, at most MAX_FDES FDEs are read and the remember_state stack holds at
    most MAX_STATE_DEPTH entries, so a hostile section costs what its size costs, never more;
  * only what an unwinder needs is tracked: the CFA rule, the rule of the frame pointer (rbp, register 6,
    on x86-64; x29 on AArch64) and of the CIE's return-address column (16 on x86-64; x30, the link
    register, on AArch64); other registers' operands are read and dropped.
  * AArch64's DW_CFA_AARCH64_negate_ra_state (0x2d, which SPARC files use as DW_CFA_GNU_window_save) is
    read in AArch64 sections only: it says whether the return address is signed (pointer
    authentication), and the BPF walk strips signatures from every return address whatever the rows say.

Speed: a 5 MB libLLVM .eh_frame has ~100,000 FDEs, most of whose CFA programs are byte-for-byte equal
to another's. Each distinct (CIE, program) runs once; its rows (offsets from the FDE's start) are kept in
one pool and every FDE just names its program. The numpy expansion is the caller's (agent/unwind/table.py).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from typing import NamedTuple

from fleetprof.agent.process.rootfs import MALFORMED, TRUNCATED
from fleetprof.agent.symbols.elf import ElfError

# x86-64 DWARF register numbers (System V psABI, figure 3.36).
RBP = 6
RSP = 7
RETURN_ADDRESS = 16
# AArch64's (DWARF for the Arm 64-bit Architecture, "DWARF register names"): x29 the frame pointer, x30 the
# link register (where `bl` leaves the return address), 31 sp.
X29 = 29
X30 = 30
SP_AARCH64 = 31

# A register's rule is one int, value << 3 | tag (value signed: Python's shifts keep the sign).
RULE_SAME = 0  # no rule, or DW_CFA_same_value: the caller's value is this frame's value
RULE_UNDEFINED = 1  # DW_CFA_undefined: not recoverable (for the return address: the outermost frame)
RULE_OFFSET = 2  # saved at CFA + value
RULE_VAL_OFFSET = 3  # the value is CFA + value
RULE_REGISTER = 4  # held in register `value`
RULE_EXPRESSION = 5  # saved at an address a DWARF expression computes
RULE_VAL_EXPRESSION = 6  # the value is what a DWARF expression computes
# cfa_reg when the CFA is computed by a DWARF expression (DW_CFA_def_cfa_expression).
CFA_EXPRESSION = -1

# What a reader holds to: far above real files (libLLVM: ~100,000 FDEs; GCC nests remember_state 1-2 deep).
MAX_FDES = 1 << 22
MAX_STATE_DEPTH = 64
# Code alignment factors are 1 on x86-64; one this large only makes advances overflow.
_MAX_CODE_ALIGN = 1 << 16
_MAX_DATA_ALIGN = 1 << 16
# Row offsets are kept as u32 (the table's addresses are u32 too): a program that advances further is refused.
_MAX_LOC = (1 << 32) - 1
_U64 = (1 << 64) - 1

# DW_EH_PE_* pointer encodings (LSB): the low nibble is the format, bits 4-6 the application, bit 7 indirect.
DW_EH_PE_absptr = 0x00
DW_EH_PE_uleb128 = 0x01
DW_EH_PE_udata2 = 0x02
DW_EH_PE_udata4 = 0x03
DW_EH_PE_udata8 = 0x04
DW_EH_PE_sleb128 = 0x09
DW_EH_PE_sdata2 = 0x0A
DW_EH_PE_sdata4 = 0x0B
DW_EH_PE_sdata8 = 0x0C
DW_EH_PE_pcrel = 0x10
DW_EH_PE_datarel = 0x30
DW_EH_PE_indirect = 0x80
DW_EH_PE_omit = 0xFF
_PCREL_SDATA4 = DW_EH_PE_pcrel | DW_EH_PE_sdata4  # what GCC, clang and both linkers write on x86-64

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64S = struct.Struct("<Q")
# length, CIE pointer, pc_begin, pc_range of an .eh_frame FDE with pcrel|sdata4 pointers.
_EH_FDE_HEAD = struct.Struct("<IIii")
_FIXED = {
    DW_EH_PE_udata2: struct.Struct("<H"),
    DW_EH_PE_udata4: struct.Struct("<I"),
    DW_EH_PE_udata8: struct.Struct("<Q"),
    DW_EH_PE_sdata2: struct.Struct("<h"),
    DW_EH_PE_sdata4: struct.Struct("<i"),
    DW_EH_PE_sdata8: struct.Struct("<q"),
}
_ABSPTR = {4: struct.Struct("<I"), 8: struct.Struct("<Q")}

# (signal frame, cfa_reg, cfa_offset, rbp rule, return-address rule) -> the table's u32 rule.
RuleEncoder = Callable[[bool, int, int, int, int], int]


class FrameRows(NamedTuple):
    """The CFI of one section as plain arrays. FDE i covers sizes[i] bytes from begins[i] (their sum can
    pass 2^64: linkers' tombstones put discarded functions at -1) and runs program progs[i];
    program k's rows are offsets/rules[starts[k]:starts[k + 1]] (offsets from the FDE's start, ascending,
    equal neighbours merged) and its last location, where its final advance leads, is final_locs[k]."""

    begins: array  # "Q"
    sizes: array  # "Q"
    progs: array  # "Q"
    starts: array  # "Q", one more than there are programs
    offsets: array  # "I"
    rules: array  # "I"
    final_locs: array  # "I"


class _Cie:
    __slots__ = (
        "code_align",
        "data_align",
        "ra_reg",
        "fde_enc",
        "has_aug_data",
        "signal",
        "addr_size",
        "initial",
        "programs",
    )

    def __init__(self) -> None:
        self.code_align = 1
        self.data_align = 1
        self.ra_reg = RETURN_ADDRESS
        self.fde_enc = DW_EH_PE_absptr
        self.has_aug_data = False
        self.signal = False
        self.addr_size = 8
        # (cfa_reg, cfa_offset, rbp rule, ra rule) after the initial instructions.
        self.initial = (CFA_EXPRESSION, 0, RULE_SAME, RULE_SAME)
        # This CIE's FDE programs seen so far -> program index (see the module docstring).
        self.programs: dict[bytes, int] = {}


def _bad(message: str) -> ElfError:
    return ElfError(message, MALFORMED)


def _uleb(d: bytes, p: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, p
        shift += 7
        if shift > 70:  # no real value needs more than 64 bits; a run of 0x80 bytes is an attack
            raise _bad(f"LEB128 number at {p} runs over 10 bytes")


def _sleb(d: bytes, p: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return (result - (1 << shift) if b & 0x40 else result), p
        if shift > 70:
            raise _bad(f"LEB128 number at {p} runs over 10 bytes")


def _check_encoding(enc: int, what: str) -> None:
    if enc == DW_EH_PE_omit:
        raise _bad(f"{what}: pointer encoding 'omit' where a pointer is required")
    if enc & DW_EH_PE_indirect:
        raise _bad(f"{what}: indirect pointer encoding {enc:#x} is not supported for code addresses")
    if enc & 0x70 not in (DW_EH_PE_absptr, DW_EH_PE_pcrel, DW_EH_PE_datarel):
        raise _bad(f"{what}: pointer application {enc & 0x70:#x} is not supported")
    if enc & 0x0F not in (DW_EH_PE_absptr, DW_EH_PE_uleb128, DW_EH_PE_sleb128, *_FIXED):
        raise _bad(f"{what}: unknown pointer format {enc & 0x0F:#x}")


def _read_value(d: bytes, p: int, fmt: int, addr_size: int) -> tuple[int, int]:
    """An encoded value's format part (the low nibble of a DW_EH_PE_* byte), unapplied."""
    if fmt == DW_EH_PE_absptr:
        return _ABSPTR[addr_size].unpack_from(d, p)[0], p + addr_size
    if fmt == DW_EH_PE_uleb128:
        return _uleb(d, p)
    if fmt == DW_EH_PE_sleb128:
        return _sleb(d, p)
    s = _FIXED.get(fmt)
    if s is None:
        raise _bad(f"unknown pointer format {fmt:#x}")
    return s.unpack_from(d, p)[0], p + s.size


def _read_pointer(
    d: bytes, p: int, enc: int, addr_size: int, section_addr: int, data_base: int
) -> tuple[int, int]:
    """An encoded pointer at section offset p: pcrel is relative to its own address, datarel to data_base."""
    value, end = _read_value(d, p, enc & 0x0F, addr_size)
    app = enc & 0x70
    if app == DW_EH_PE_pcrel:
        value += section_addr + p
    elif app == DW_EH_PE_datarel:
        value += data_base
    return value & _U64, end


class _Reader:
    """One section's CIEs and FDEs; `eh` selects .eh_frame's rules over .debug_frame's."""

    def __init__(
        self, data: bytes, eh: bool, section_addr: int, data_base: int, encode: RuleEncoder, aarch64: bool
    ) -> None:
        self.d = data
        self.eh = eh
        self.aarch64 = aarch64
        self.fp_reg = X29 if aarch64 else RBP
        self.section_addr = section_addr
        self.data_base = data_base
        self.encode = encode
        self.cies: dict[int, _Cie] = {}
        self.plain_rules: dict[tuple[int, int, int, int], int] = {}
        self.signal_rules: dict[tuple[int, int, int, int], int] = {}
        self.starts = array("Q", [0])
        self.offsets = array("I")
        self.rules = array("I")
        self.final_locs = array("I")

    def entry_bounds(self, pos: int) -> tuple[int, int, bool]:
        """(start of the entry's body, its end, whether 64-bit DWARF) for the entry at pos."""
        d = self.d
        length = _U32.unpack_from(d, pos)[0]
        body = pos + 4
        wide = length == 0xFFFFFFFF
        if wide:
            length = _U64S.unpack_from(d, body)[0]
            body += 8
        end = body + length
        if end > len(d):
            raise ElfError(f"entry at {pos:#x}: its length {length} runs past the section's end", TRUNCATED)
        return body, end, wide

    def cie(self, pos: int) -> _Cie:
        cie = self.cies.get(pos)
        if cie is None:
            cie = self.cies[pos] = self.parse_cie(pos)
        return cie

    def parse_cie(self, pos: int) -> _Cie:
        d = self.d
        if not 0 <= pos < len(d) - 4:
            raise _bad(f"CIE pointer {pos:#x} is outside the section")
        body, end, wide = self.entry_bounds(pos)
        if self.eh:
            cie_id, p = _U32.unpack_from(d, body)[0], body + 4
            is_cie = cie_id == 0
        elif wide:
            cie_id, p = _U64S.unpack_from(d, body)[0], body + 8
            is_cie = cie_id == _U64
        else:
            cie_id, p = _U32.unpack_from(d, body)[0], body + 4
            is_cie = cie_id == 0xFFFFFFFF
        if not is_cie:
            raise _bad(f"entry at {pos:#x} is named as a CIE but is not one")
        cie = _Cie()
        version = d[p]
        p += 1
        if version not in ((1, 3) if self.eh else (1, 3, 4)):
            raise _bad(f"CIE at {pos:#x}: unsupported version {version}")
        nul = d.find(b"\0", p, end)
        if nul < 0:
            raise _bad(f"CIE at {pos:#x}: its augmentation string is not terminated")
        aug = d[p:nul]
        p = nul + 1
        if aug == b"eh":
            raise _bad(f"CIE at {pos:#x}: legacy 'eh' augmentation is not supported")
        if aug and aug[0] != 0x7A:  # "z": without it, unknown augmentation data cannot even be skipped
            raise _bad(f"CIE at {pos:#x}: unsupported augmentation {aug!r}")
        if version == 4:
            cie.addr_size = d[p]
            seg_size = d[p + 1]
            p += 2
            if cie.addr_size not in _ABSPTR or seg_size:
                raise _bad(f"CIE at {pos:#x}: address size {cie.addr_size}, segment size {seg_size}")
        cie.code_align, p = _uleb(d, p)
        cie.data_align, p = _sleb(d, p)
        if (
            not 0 < cie.code_align <= _MAX_CODE_ALIGN
            or not -_MAX_DATA_ALIGN <= cie.data_align <= _MAX_DATA_ALIGN
        ):
            raise _bad(f"CIE at {pos:#x}: alignment factors {cie.code_align}, {cie.data_align}")
        if version == 1:
            cie.ra_reg = d[p]
            p += 1
        else:
            cie.ra_reg, p = _uleb(d, p)
        if aug:
            cie.has_aug_data = True
            aug_len, p = _uleb(d, p)
            aug_end = p + aug_len
            if aug_end > end:
                raise _bad(f"CIE at {pos:#x}: augmentation data runs past the entry")
            for letter in aug[1:]:
                if letter == 0x52:  # "R": the FDEs' pointer encoding
                    cie.fde_enc = d[p]
                    p += 1
                    _check_encoding(cie.fde_enc, f"CIE at {pos:#x}")
                elif letter == 0x50:  # "P": personality routine (encoding, pointer); never followed here
                    enc = d[p]
                    if enc & 0x70 not in (DW_EH_PE_absptr, DW_EH_PE_pcrel, DW_EH_PE_datarel):
                        raise _bad(f"CIE at {pos:#x}: personality encoding {enc:#x}")
                    _value, p = _read_value(d, p + 1, enc & 0x0F, cie.addr_size)
                elif letter == 0x4C:  # "L": the FDEs' LSDA pointer encoding (their aug data skips it)
                    p += 1
                elif letter == 0x53:  # "S": a signal trampoline's frame
                    cie.signal = True
                elif letter == 0x42:  # "B": AArch64 branch target identification; nothing to read
                    pass
                else:
                    raise _bad(f"CIE at {pos:#x}: unsupported augmentation {aug!r}")
                if p > aug_end:
                    raise _bad(f"CIE at {pos:#x}: augmentation data runs past its length")
            p = aug_end
        if p > end:
            raise _bad(f"CIE at {pos:#x}: its header runs past its length")
        state = (CFA_EXPRESSION, 0, RULE_SAME, RULE_SAME)
        sink_offsets, sink_rules = array("I"), array("I")
        cfa_reg, cfa_off, rbp, ra, _loc, _set = self.execute(
            d[p:end], p, cie, state, RULE_SAME, RULE_SAME, 0, sink_offsets, sink_rules
        )
        cie.initial = (cfa_reg, cfa_off, rbp, ra)
        return cie

    def read(self) -> FrameRows:
        d = self.d
        n = len(d)
        section_addr = self.section_addr
        begins, sizes, progs = array("Q"), array("Q"), array("Q")
        add_begin, add_size, add_prog = begins.append, sizes.append, progs.append
        unpack_head = _EH_FDE_HEAD.unpack_from
        cies = self.cies
        run = self.run_program
        entry = self.entry
        fast = self.eh
        pos = 0
        count = 0
        while pos + 4 <= n:
            # Fast path, the layout GCC, clang and both linkers write: an .eh_frame FDE of 32-bit DWARF
            # whose CIE, already read, says pcrel|sdata4 pointers. Anything else goes through entry().
            cie = None
            if fast and pos + 16 <= n:
                length, cie_id, begin, size = unpack_head(d, pos)
                if cie_id and 12 <= length < 0xFFFFFFF0:
                    cie = cies.get(pos + 4 - cie_id)
                    if cie is not None and cie.fde_enc != _PCREL_SDATA4:
                        cie = None
            if cie is not None:
                end = pos + 4 + length
                if end > n:
                    raise ElfError(
                        f"entry at {pos:#x}: its length {length} runs past the section's end", TRUNCATED
                    )
                if size < 0:
                    raise _bad(f"FDE at {pos:#x}: negative address range {size}")
                begin = (begin + section_addr + pos + 8) & _U64
                p = pos + 16
                if cie.has_aug_data:
                    aug_len = d[p]
                    if aug_len < 0x80:
                        p += 1 + aug_len
                    else:
                        aug_len, p = _uleb(d, p)
                        p += aug_len
                    if p > end:
                        raise _bad(f"FDE at {pos:#x}: its header runs past its length")
            else:
                end, fde = entry(pos)
                if end < 0:
                    break
                if fde is None:
                    pos = end
                    continue
                begin, size, p, cie = fde
            count += 1
            if count > MAX_FDES:
                raise _bad(f"more than {MAX_FDES} FDEs")
            prog = d[p:end]
            pid = cie.programs.get(prog)
            if pid is None:
                pid = run(prog, p, cie, begin)
            add_begin(begin)
            add_size(size)
            add_prog(pid)
            pos = end
        if 0 < n - pos < 4:
            raise ElfError(f"the section ends inside the length of an entry at {pos:#x}", TRUNCATED)
        return FrameRows(begins, sizes, progs, self.starts, self.offsets, self.rules, self.final_locs)

    def entry(self, pos: int) -> tuple[int, tuple[int, int, int, _Cie] | None]:
        """Any entry at pos, in any layout: (its end, None) for a CIE or padding, (-1, None) for the
        .eh_frame terminator, (its end, (begin, size, program offset, CIE)) for an FDE."""
        d = self.d
        eh = self.eh
        if _U32.unpack_from(d, pos)[0] == 0:
            return (-1 if eh else pos + 4), None  # .eh_frame's terminator (crtend.o's zero word)
        body, end, wide = self.entry_bounds(pos)
        if wide and not eh:
            cie_id, p = _U64S.unpack_from(d, body)[0], body + 8
            is_cie = cie_id == _U64
        else:
            cie_id, p = _U32.unpack_from(d, body)[0], body + 4
            is_cie = cie_id == 0 if eh else cie_id == 0xFFFFFFFF
        if p > end:
            raise _bad(f"entry at {pos:#x} is shorter than its CIE pointer")
        if is_cie:
            return end, None
        cie = self.cie(body - cie_id if eh else cie_id)
        enc = cie.fde_enc
        begin, p = _read_pointer(d, p, enc, cie.addr_size, self.section_addr, self.data_base)
        size, p = _read_value(d, p, enc & 0x0F, cie.addr_size)
        if size < 0:
            raise _bad(f"FDE at {pos:#x}: negative address range {size}")
        if cie.has_aug_data:
            aug_len, p = _uleb(d, p)
            p += aug_len
        if p > end:
            raise _bad(f"FDE at {pos:#x}: its header runs past its length")
        return end, (begin, size, p, cie)

    def run_program(self, prog: bytes, prog_pos: int, cie: _Cie, begin: int) -> int:
        """Run one FDE's program, pool its rows and return its index; cached unless it uses set_loc, whose
        targets are absolute."""
        initial = cie.initial
        *_final_state, final_loc, used_set_loc = self.execute(
            prog, prog_pos, cie, initial, initial[2], initial[3], begin, self.offsets, self.rules
        )
        pid = len(self.final_locs)
        self.final_locs.append(final_loc)
        self.starts.append(len(self.offsets))
        if not used_set_loc:
            cie.programs[prog] = pid
        return pid

    def execute(
        self,
        prog: bytes,
        prog_pos: int,
        cie: _Cie,
        state: tuple[int, int, int, int],
        restore_rbp: int,
        restore_ra: int,
        begin: int,
        out_offsets: array,
        out_rules: array,
    ) -> tuple[int, int, int, int, int, bool]:
        """Run a CFA program from `state`; append (offset, rule) rows to the outputs, merging equal
        neighbours. Returns the final (cfa_reg, cfa_offset, rbp rule, ra rule), the final location and
        whether set_loc was used. `prog_pos` is the program's offset in the section: error messages name
        it ("CFA program at 0x..."), and pcrel set_loc operands are relative to it."""
        try:
            return self._execute(
                prog, prog_pos, cie, state, restore_rbp, restore_ra, begin, out_offsets, out_rules
            )
        except (IndexError, struct.error) as e:
            raise _bad(f"CFA program at {prog_pos:#x} is truncated ({e})") from e
        except OverflowError as e:  # a row's offset did not fit the u32 array
            raise _bad(f"CFA program at {prog_pos:#x} advances past 4 GiB") from e

    def _execute(
        self,
        prog: bytes,
        prog_pos: int,
        cie: _Cie,
        state: tuple[int, int, int, int],
        restore_rbp: int,
        restore_ra: int,
        begin: int,
        out_offsets: array,
        out_rules: array,
    ) -> tuple[int, int, int, int, int, bool]:
        cfa_reg, cfa_off, rbp, ra = state
        caf = cie.code_align
        daf = cie.data_align
        ra_reg = cie.ra_reg
        fp_reg = self.fp_reg
        signal = cie.signal
        encode = self.encode
        # Rows repeat a few hundred distinct states across a whole library: encode each once.
        memo = self.signal_rules if signal else self.plain_rules
        rule_of = memo.get
        add_offset = out_offsets.append
        add_rule = out_rules.append
        stack: list[tuple[int, int, int, int]] = []
        last = -1
        loc = 0
        used_set_loc = False
        n = len(prog)
        p = 0
        # The most frequent instructions first (libLLVM's: def_cfa_offset 38%, advance_loc 35%, offset 13%,
        # nop 10%); each branch either `continue`s or sets `adv` and falls through to the row emission.
        while p < n:
            op = prog[p]
            p += 1
            if op >= 0x40:
                if op < 0x80:  # DW_CFA_advance_loc
                    adv = (op & 0x3F) * caf
                elif op < 0xC0:  # DW_CFA_offset
                    b = prog[p]
                    if b < 0x80:
                        p += 1
                    else:
                        b, p = _uleb(prog, p)
                    reg = op & 0x3F
                    if reg == fp_reg:  # locals and literals here, not globals: this loop runs a million times
                        rbp = (b * daf) << 3 | 2  # RULE_OFFSET
                    elif reg == ra_reg:
                        ra = (b * daf) << 3 | 2
                    continue
                else:  # DW_CFA_restore
                    reg = op & 0x3F
                    if reg == fp_reg:
                        rbp = restore_rbp
                    elif reg == ra_reg:
                        ra = restore_ra
                    continue
            elif op == 0x0E:  # DW_CFA_def_cfa_offset
                b = prog[p]
                if b < 0x80:
                    cfa_off = b
                    p += 1
                else:
                    cfa_off, p = _uleb(prog, p)
                continue
            elif op == 0x00:  # DW_CFA_nop: every program's padding to the entry's alignment
                continue
            elif op == 0x0A:  # DW_CFA_remember_state
                if len(stack) >= MAX_STATE_DEPTH:
                    raise _bad(f"CFA program at {prog_pos:#x}: remember_state nests over {MAX_STATE_DEPTH}")
                stack.append((cfa_reg, cfa_off, rbp, ra))
                continue
            elif op == 0x0B:  # DW_CFA_restore_state
                if not stack:
                    raise _bad(f"CFA program at {prog_pos:#x}: restore_state without remember_state")
                cfa_reg, cfa_off, rbp, ra = stack.pop()
                continue
            elif op == 0x0C:  # DW_CFA_def_cfa
                cfa_reg = prog[p]
                cfa_off = prog[p + 1]
                if cfa_reg < 0x80 and cfa_off < 0x80:
                    p += 2
                else:
                    cfa_reg, p = _uleb(prog, p)
                    cfa_off, p = _uleb(prog, p)
                continue
            elif op == 0x0D:  # DW_CFA_def_cfa_register
                cfa_reg = prog[p]
                if cfa_reg < 0x80:
                    p += 1
                else:
                    cfa_reg, p = _uleb(prog, p)
                continue
            elif op == 0x02:  # DW_CFA_advance_loc1
                adv = prog[p] * caf
                p += 1
            elif op == 0x03:  # DW_CFA_advance_loc2
                adv = _U16.unpack_from(prog, p)[0] * caf
                p += 2
            elif op == 0x04:  # DW_CFA_advance_loc4
                adv = _U32.unpack_from(prog, p)[0] * caf
                p += 4
            elif op == 0x2E:  # DW_CFA_GNU_args_size: the callee pops arguments; irrelevant to the CFA
                _v, p = _uleb(prog, p)
                continue
            elif op == 0x01:  # DW_CFA_set_loc
                if self.eh:
                    target, p2 = _read_pointer(
                        prog, p, cie.fde_enc, cie.addr_size, self.section_addr + prog_pos, self.data_base
                    )
                else:
                    target, p2 = _read_value(prog, p, DW_EH_PE_absptr, cie.addr_size)
                p = p2
                used_set_loc = True
                adv = target - begin - loc
                if adv < 0:
                    raise _bad(f"CFA program at {prog_pos:#x}: set_loc moves backwards")
            else:
                reg = -1
                rule = RULE_SAME
                if op == 0x05 or op == 0x11 or op == 0x14 or op == 0x15 or op == 0x2F:
                    reg, p = _uleb(prog, p)
                    if op == 0x05 or op == 0x14:  # DW_CFA_offset_extended, DW_CFA_val_offset
                        v, p = _uleb(prog, p)
                    elif op == 0x2F:  # DW_CFA_GNU_negative_offset_extended
                        v, p = _uleb(prog, p)
                        v = -v
                    else:  # DW_CFA_offset_extended_sf, DW_CFA_val_offset_sf
                        v, p = _sleb(prog, p)
                    tag = RULE_VAL_OFFSET if op == 0x14 or op == 0x15 else RULE_OFFSET
                    rule = (v * daf) << 3 | tag
                elif op == 0x06:  # DW_CFA_restore_extended
                    reg, p = _uleb(prog, p)
                    rule = restore_rbp if reg == fp_reg else restore_ra
                elif op == 0x07 or op == 0x08:  # DW_CFA_undefined, DW_CFA_same_value
                    reg, p = _uleb(prog, p)
                    rule = RULE_UNDEFINED if op == 0x07 else RULE_SAME
                elif op == 0x09:  # DW_CFA_register
                    reg, p = _uleb(prog, p)
                    v, p = _uleb(prog, p)
                    rule = v << 3 | RULE_REGISTER
                elif op == 0x10 or op == 0x16:  # DW_CFA_expression, DW_CFA_val_expression
                    reg, p = _uleb(prog, p)
                    size, p = _uleb(prog, p)
                    p += size
                    if p > n:
                        raise _bad(f"CFA program at {prog_pos:#x}: an expression runs past the program")
                    rule = RULE_EXPRESSION if op == 0x10 else RULE_VAL_EXPRESSION
                elif op == 0x0F:  # DW_CFA_def_cfa_expression
                    size, p = _uleb(prog, p)
                    p += size
                    if p > n:
                        raise _bad(f"CFA program at {prog_pos:#x}: an expression runs past the program")
                    cfa_reg = CFA_EXPRESSION
                    continue
                elif op == 0x12:  # DW_CFA_def_cfa_sf
                    cfa_reg, p = _uleb(prog, p)
                    v, p = _sleb(prog, p)
                    cfa_off = v * daf
                    continue
                elif op == 0x13:  # DW_CFA_def_cfa_offset_sf
                    v, p = _sleb(prog, p)
                    cfa_off = v * daf
                    continue
                elif op == 0x2D and self.aarch64:
                    # DW_CFA_AARCH64_negate_ra_state: the return address is now signed (or no longer); no
                    # operand. The walk strips every return address, so the rows need not carry it.
                    continue
                else:
                    raise _bad(f"CFA program at {prog_pos:#x}: unknown instruction {op:#04x}")
                if reg == fp_reg:
                    rbp = rule
                elif reg == ra_reg:
                    ra = rule
                continue
            if adv:
                key = (cfa_reg, cfa_off, rbp, ra)
                rule = rule_of(key)
                if rule is None:
                    rule = memo[key] = encode(signal, cfa_reg, cfa_off, rbp, ra)
                if rule != last:
                    add_offset(loc)
                    add_rule(rule)
                    last = rule
                loc += adv
        if loc > _MAX_LOC:
            raise _bad(f"CFA program at {prog_pos:#x} advances past 4 GiB ({loc:#x} bytes)")
        key = (cfa_reg, cfa_off, rbp, ra)
        rule = rule_of(key)
        if rule is None:
            rule = memo[key] = encode(signal, cfa_reg, cfa_off, rbp, ra)
        if rule != last:
            add_offset(loc)
            add_rule(rule)
        return cfa_reg, cfa_off, rbp, ra, loc, used_set_loc


def parse_eh_frame(
    data: bytes | bytearray, section_addr: int, data_base: int, encode: RuleEncoder, aarch64: bool = False
) -> FrameRows:
    """Rows of every FDE in an .eh_frame section loaded at `section_addr`. `data_base` is what
    DW_EH_PE_datarel pointers are relative to (no x86-64 compiler writes them in .eh_frame). `aarch64`:
    the section is an AArch64 file's (its frame pointer is x29, and negate_ra_state is an instruction)."""
    return _read(bytes(data), True, section_addr, data_base, encode, ".eh_frame", aarch64)


def parse_debug_frame(data: bytes | bytearray, encode: RuleEncoder, aarch64: bool = False) -> FrameRows:
    """Rows of every FDE in a .debug_frame section (32- or 64-bit DWARF, CIE versions 1, 3 and 4)."""
    return _read(bytes(data), False, 0, 0, encode, ".debug_frame", aarch64)


def _read(
    data: bytes, eh: bool, section_addr: int, data_base: int, encode: RuleEncoder, name: str, aarch64: bool
) -> FrameRows:
    try:
        return _Reader(data, eh, section_addr, data_base, encode, aarch64).read()
    except ElfError as e:
        raise ElfError(f"{name}: {e}", e.reason) from e
    except (IndexError, struct.error, OverflowError) as e:
        raise ElfError(f"{name}: truncated or malformed entry ({e})", MALFORMED) from e
