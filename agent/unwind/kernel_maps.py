"""The face of the unwinder's BPF maps (agent/bpf/unwind.h): rows, files, mappings and processes written as
plain values. Mirrors the C structs with `struct` layouts; nothing else touches those maps."""

from __future__ import annotations

import ctypes as ct
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fleetprof.agent.bpfmaps import drain_map_bytes, read_map_bytes, write_array

FILE = struct.Struct("=IIIIq")  # struct unwind_file: first, pages, page_base, pad, delta
PAGE_SHIFT = 16  # UNWIND_PAGE_SHIFT: a file's rows are indexed by 64 KB page
MAP = struct.Struct("=QQQII")  # struct unwind_map: start, end, bias, file, pad
PROC = struct.Struct("=II")  # struct unwind_proc: first, n
FILE_JIT = 0xFFFFFFFF  # unwind_map.file of anonymous executable memory (UNWIND_FILE_JIT)


class MapEntry(tuple):
    """One executable mapping as BPF searches it: (start, end, bias, file id)."""

    __slots__ = ()

    def __new__(cls, start: int, end: int, bias: int, file: int) -> MapEntry:
        return super().__new__(cls, (start, end, bias, file))


class PagedTable(NamedTuple):
    """A file's table in unwind_rows' layout (agent/bpf/unwind.h), as `paged` makes it."""

    base: int  # the first page (file address >> PAGE_SHIFT)
    index: np.ndarray  # u32, pages + 1: where each page's rows start among `rows`, and where the last ends
    rows: np.ndarray  # u32: page offset | rule id << 16

    @property
    def pages(self) -> int:
        return len(self.index) - 1

    def __len__(self) -> int:
        """Words of unwind_rows it takes."""
        return len(self.index) + len(self.rows)


def paged(pcs: np.ndarray, rule_ids: np.ndarray, no_info_id: int) -> PagedTable:
    """A table (rows sorted by pc; each row's rule as its id, u32) in unwind_rows' layout. A page with no row
    at its start gets one there with the rule in effect (the last row before it, or `no_info_id` below the
    first row), so BPF searches one page's rows only. Past the last page BPF reads NO_INFO, as a built
    table's last row says anyway (each FDE's end gets one: table.py). In u32 columns, one new array of rows
    (libtorch_cpu.so's 2.6 M rows: ~10 MB each, and the agent's peak while it lays them out)."""
    pcs = np.asarray(pcs, dtype=np.uint32)
    n = len(pcs)
    base = int(pcs[0]) >> PAGE_SHIFT
    pages = (int(pcs[-1]) >> PAGE_SHIFT) - base + 1
    starts = (np.arange(pages, dtype=np.int64) + base) << PAGE_SHIFT
    at = np.searchsorted(pcs, starts)  # each page's first row, or n
    lacking = (at == n) | (pcs[np.minimum(at, n - 1)] != starts)  # no row at the page's start
    before = at[lacking] - 1  # the row in effect there, or -1
    ids = np.asarray(rule_ids, dtype=np.uint32)
    filler = np.where(before < 0, no_info_id, ids[np.maximum(before, 0)]).astype(np.uint32) << 16
    rows = np.bitwise_and(pcs, (1 << PAGE_SHIFT) - 1)
    rows |= ids << 16
    rows = np.insert(rows, at[lacking], filler)  # each before the row it precedes, in page order
    # A page's first row moves up by the rows put in before it: one for each lacking page before it.
    index = np.empty(pages + 1, dtype=np.uint32)
    index[:-1] = at + np.concatenate(([0], np.cumsum(lacking)[:-1]))
    index[-1] = len(rows)
    return PagedTable(base, index, rows)


class UnwindMaps:
    """The four maps of a loaded sampler (BCC tables), written by the agent's unwinder thread only."""

    def __init__(self, rows, rules, files, maps, procs, wanted, unmapped=None) -> None:  # BCC tables
        self._rows, self._rules, self._files, self._maps, self._procs = rows, rules, files, maps, procs
        self._wanted = wanted
        self._unmapped = unmapped
        self.row_capacity = rows.max_entries  # words: a file takes its rows, its pages and one more
        self.rule_capacity = rules.max_entries
        self.file_capacity = files.max_entries
        self.map_capacity = maps.max_entries
        self.proc_capacity = procs.max_entries

    def write_table(self, first: int, table: PagedTable) -> None:
        """A file's table at unwind_rows[first, first + len(table)): its page index, then its rows."""
        write_array(self._rows, first, table.index.astype("<u4", copy=False).tobytes(), 4)
        write_array(self._rows, first + len(table.index), table.rows.astype("<u4", copy=False).tobytes(), 4)

    def write_rules(self, first_id: int, rules: Sequence[int]) -> None:
        """Rules new to the node under ids first_id, first_id + 1, ... (before any row names them)."""
        write_array(self._rules, first_id, np.asarray(rules, dtype="<u4").tobytes(), 4)

    def set_file(self, file_id: int, first: int, pages: int, page_base: int, delta: int) -> None:
        """Point file `file_id` at its table (pages = 0: no table; BPF walks its frames by frame pointer)."""
        value = FILE.pack(first, pages, page_base, 0, delta)
        self._files[ct.c_uint32(file_id)] = self._files.Leaf.from_buffer_copy(value)

    def write_maps(self, first: int, entries: Sequence[MapEntry]) -> None:
        write_array(self._maps, first, b"".join(MAP.pack(*e, 0) for e in entries), MAP.size)

    def set_process(self, tgid: int, first: int, n: int) -> None:
        self._procs[ct.c_uint32(tgid)] = self._procs.Leaf.from_buffer_copy(PROC.pack(first, n))

    def take_wanted(self) -> list[int]:
        """The file ids walks met without a table since the last call (their flags cleared)."""
        keys, values = read_map_bytes(self._wanted, 4, 1)
        ids = [k for (k,), v in zip(struct.iter_unpack("=I", keys), values, strict=True) if v]
        for i in ids:
            self._wanted[ct.c_int(i)] = ct.c_uint8(0)
        return ids

    def take_unmapped(self) -> list[int]:
        """The processes whose walks met an address outside their known mappings since the last call."""
        if self._unmapped is None:
            return []
        keys, _ = drain_map_bytes(self._unmapped, 4, 1)
        return [k for (k,) in struct.iter_unpack("=I", keys)]

    def clear_unmapped(self, tgid: int) -> None:
        """Let the next walk of `tgid` that leaves its mappings say so again (they were just read)."""
        if self._unmapped is not None:
            try:
                del self._unmapped[ct.c_uint32(tgid)]
            except KeyError:
                pass

    def clear_process(self, tgid: int) -> None:
        try:
            del self._procs[ct.c_uint32(tgid)]
        except KeyError:
            pass
