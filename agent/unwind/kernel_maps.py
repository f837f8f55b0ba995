"""The face of the unwinder's BPF maps (agent/bpf/unwind.h): rows, files, mappings and processes written as
plain values. Mirrors the C structs with `struct` layouts; nothing else touches those maps."""

from __future__ import annotations

import ctypes as ct
import struct
from collections.abc import Sequence

import numpy as np

from fleetprof.agent.bpfmaps import drain_map_bytes, read_map_bytes, write_array

ROW = struct.Struct("=II")  # struct unwind_row: pc, rule
FILE = struct.Struct("=IIq")  # struct unwind_file: first, n, delta
MAP = struct.Struct("=QQQII")  # struct unwind_map: start, end, bias, file, pad
PROC = struct.Struct("=II")  # struct unwind_proc: first, n
FILE_JIT = 0xFFFFFFFF  # unwind_map.file of anonymous executable memory (UNWIND_FILE_JIT)


class MapEntry(tuple):
    """One executable mapping as BPF searches it: (start, end, bias, file id)."""

    __slots__ = ()

    def __new__(cls, start: int, end: int, bias: int, file: int) -> MapEntry:
        return super().__new__(cls, (start, end, bias, file))


class UnwindMaps:
    """The four maps of a loaded sampler (BCC tables), written by the agent's unwinder thread only."""

    def __init__(self, rows, files, maps, procs, wanted, unmapped=None) -> None:  # BCC tables
        self._rows, self._files, self._maps, self._procs = rows, files, maps, procs
        self._wanted = wanted
        self._unmapped = unmapped
        self.row_capacity = rows.max_entries
        self.file_capacity = files.max_entries
        self.map_capacity = maps.max_entries
        self.proc_capacity = procs.max_entries

    def write_rows(self, first: int, pcs: np.ndarray, rules: np.ndarray) -> None:
        rows = np.empty(len(pcs), dtype=[("pc", "<u4"), ("rule", "<u4")])
        rows["pc"], rows["rule"] = pcs, rules
        write_array(self._rows, first, rows.tobytes(), ROW.size)

    def set_file(self, file_id: int, first: int, n: int, delta: int) -> None:
        """Point file `file_id` at its rows (n = 0: no table; BPF walks its frames by frame pointer)."""
        self._files[ct.c_uint32(file_id)] = self._files.Leaf.from_buffer_copy(FILE.pack(first, n, delta))

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
