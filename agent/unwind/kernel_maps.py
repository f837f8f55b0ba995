"""The face of the unwinder's BPF maps (agent/bpf/unwind.h): rows, files, mappings and processes written as
plain values. Mirrors the C structs with `struct` layouts; nothing else touches those maps."""

from __future__ import annotations

import ctypes as ct
import struct
from collections.abc import Sequence

import numpy as np

from fleetprof.agent.bpfmaps import drain_map_bytes, read_map_bytes, write_array

FILE = struct.Struct("=IIIIq")  # struct unwind_file: first, pages, page_base, pad, delta
PAGE_SHIFT = 16  # UNWIND_PAGE_SHIFT: a file's rows are indexed by 64 KB page
RULE_IDS = 1 << 16  # UNWIND_RULE_IDS: distinct rules of all files together (a row holds its rule's id)
MAP = struct.Struct("=QQQII")  # struct unwind_map: start, end, bias, file, pad
PROC = struct.Struct("=II")  # struct unwind_proc: first, n
FILE_JIT = 0xFFFFFFFF  # unwind_map.file of anonymous executable memory (UNWIND_FILE_JIT)


class MapEntry(tuple):
    """One executable mapping as BPF searches it: (start, end, bias, file id)."""

    __slots__ = ()

    def __new__(cls, start: int, end: int, bias: int, file: int) -> MapEntry:
        return super().__new__(cls, (start, end, bias, file))


def paged(pcs: np.ndarray, rule_ids: np.ndarray, no_info_id: int) -> tuple[int, int, np.ndarray]:
    """A table (rows sorted by pc, each rule as its id) in unwind_rows' layout (agent/bpf/unwind.h): (the
        first page, the number of pages, the words: the page index, then the rows). A page that has no row at its
        start gets one there with the rule in effect (the last row before it, or `no_info_id` where there is
        none: below the first row), so BPF searches one page's rows only. Past the last page BPF reads NO_INFO,
    as a built table's last row says anyway (each FDE's end gets one: table.py)."""
    pcs = np.asarray(pcs, dtype=np.int64)
    ids = np.asarray(rule_ids, dtype=np.int64)
    base = int(pcs[0]) >> PAGE_SHIFT
    pages = (int(pcs[-1]) >> PAGE_SHIFT) - base + 1
    starts = (np.arange(pages, dtype=np.int64) + base) << PAGE_SHIFT
    before = np.searchsorted(pcs, starts, side="right") - 1  # the row in effect at each page's start
    lacking = (before < 0) | (pcs[np.maximum(before, 0)] != starts)
    filler = np.where(before[lacking] < 0, no_info_id, ids[np.maximum(before[lacking], 0)])
    all_pcs = np.concatenate((pcs, starts[lacking]))
    all_ids = np.concatenate((ids, filler))
    order = np.argsort(all_pcs, kind="stable")
    all_pcs, all_ids = all_pcs[order], all_ids[order]
    index = np.searchsorted(all_pcs, np.append(starts, starts[-1] + (1 << PAGE_SHIFT)))
    rows = (all_pcs & ((1 << PAGE_SHIFT) - 1)) | (all_ids << 16)
    return base, pages, np.concatenate((index, rows)).astype(np.uint32)


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

    def write_words(self, first: int, words: np.ndarray) -> None:
        """A file's table as `paged` lays it out, at unwind_rows[first, first + len(words))."""
        write_array(self._rows, first, np.asarray(words, dtype="<u4").tobytes(), 4)

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
