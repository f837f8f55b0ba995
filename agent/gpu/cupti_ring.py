"""Read the ring that our CUPTI library (agent/cupti/) keeps inside a CUDA process, through /proc/PID/mem.

The layout is agent/cupti/fleetprof_cupti_ring.h, mirrored here once (tests/agent/test_cupti_ring.py compiles
the header and compares every offset). Rules this file keeps:
  * The process is a tenant and may be hostile or dying: the library file is opened inside the process's
    root (agent/process/rootfs.py), every read is a bounded pread of /proc/PID/mem (READ_CHUNK_RECORDS at a
    time, at most one ring per poll), and every size the header states is checked against the build's.
  * The writer never waits for us, so we never trust a copy: a record counts only if its sequence number
    is its index + 1, the writer had not claimed its slot again by the time the copy ended (write_seq is
    re-read after each copy), and its check word matches. Records the writer lapped before we read them are
    `lost`; copies that raced the writer or fail their check are `torn`. Neither is ever returned.
  * A slot claimed but not yet written (a writer between its claim and its publish) stops the poll there;
    the next poll starts at it. A slot that stays unwritten for PENDING_GIVE_UP polls (a thread killed
    mid-write) is skipped and counted lost.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

import numpy as np

from fleetprof.agent.model import Mapping
from fleetprof.agent.process.rootfs import mapped_file_openers
from fleetprof.agent.symbols.elf import SHT_DYNSYM, ElfError, ElfFile
from fleetprof.agent.symbols.maps import read_maps

RING_SYMBOL = "fleetprof_cupti_ring"
MARKER_SYMBOL = "fleetprof_cupti_launch"
LIBRARY_PREFIX = "libfleetprof_cupti"

MAGIC = 0x3149545055435046  # "FPCUPTI1"
LAYOUT = 1
RECORD_SIZE = 64
WRITE_SEQ_OFFSET = 704
NAMES_USED_OFFSET = 768
HEADER_SIZE = 832
NAME_HEADER = 8
# Caps on what a header may claim: the build's values are 65,536 records (4 MiB) and 1 MiB of names. A
# hostile process could claim more to make the agent read and hold more per poll; these bound it to 16 MiB
# of records and 4 MiB of names (names are read NAMES_CHUNK at a time).
MAX_CAPACITY = 1 << 18
MAX_NAMES_BYTES = 4 << 20
NAMES_CHUNK = 1 << 20

READ_CHUNK_RECORDS = 8192  # 512 KiB per pread
PENDING_GIVE_UP = 20

# enum fp_cupti_state
STATES = {
    1: "loaded",
    2: "running",
    3: "disabled",
    4: "no_cupti",
    5: "cupti_error",
    6: "stopped",
    7: "forked",
}
# enum fp_cupti_counter, by index
COUNTERS = (
    "launches",
    "sampled",
    "sample_capped",
    "kernels",
    "copies",
    "cupti_dropped",
    "buffers_refused",
    "names_full",
    "names_cut",
    "flushes",
    "other_records",
    "nesting_repairs",
    "launches_open_at_exit",
    "sampled_weight",
    "sampled_weight_max",
)
KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_LAUNCH = 1, 2, 3, 4
DOMAINS = {0: None, 1: "driver", 2: "runtime"}

# struct fp_cupti_header up to state_message; write_seq and names_used sit on their own cache lines.
HEADER_FIELDS = (
    ("magic", "Q"), ("layout", "I"), ("header_size", "I"), ("record_size", "I"), ("capacity", "I"),
    ("records_offset", "I"), ("names_offset", "I"), ("names_size", "I"), ("state", "I"),
    ("state_detail", "i"), ("cupti_version", "I"), ("sample_every", "I"), ("sample_cap", "I"),
    ("flush_ms", "I"), ("clock_id", "I"), ("init_ns", "Q"), ("flushed_ns", "Q"), ("counters", "16Q"),
    ("cupti_path", "256s"), ("state_message", "192s"),
)  # fmt: skip
_HEADER = struct.Struct("<" + "".join(f for _, f in HEADER_FIELDS))
assert _HEADER.size == 656


def header_offsets() -> dict[str, int]:
    """Each header field's offset as this module reads it (tests compare them with the C header's)."""
    out, fmt = {}, "<"
    for name, f in HEADER_FIELDS:
        out[name] = struct.calcsize(fmt)
        fmt += f
    return out | {"write_seq": WRITE_SEQ_OFFSET, "names_used": NAMES_USED_OFFSET}


_U64 = struct.Struct("<Q")

# struct fp_cupti_record, both bodies as overlapping fields.
RECORD_DTYPE = np.dtype(
    {
        "names": [
            "seq", "kind", "subkind", "correlation_id",
            "start_ns", "end_ns", "bytes", "device_id", "context_id", "stream_id", "name_ref", "name_hash",
            "enter_ns", "exit_ns", "weight", "inner_correlation_id", "tid", "inner_cbid", "domains", "result",
            "check",
        ],
        "formats": [
            "<u8", "<u2", "<u2", "<u4",
            "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u4",
            "<u8", "<u8", "<u8", "<u4", "<u4", "<u2", "<u2", "<u4",
            "<u4",
        ],
        "offsets": [0, 8, 10, 12, 16, 24, 32, 40, 44, 48, 52, 56, 16, 24, 32, 40, 44, 48, 50, 52, 60],
        "itemsize": RECORD_SIZE,
    }
)  # fmt: skip


class RingError(Exception):
    """The ring cannot be read: `reason` is "gone" (the process exited), "no_ring" (no library mapped, or
    no ring symbol in it), "bad_header" (not a ring of a layout we know) or "unreadable"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def record_checks(records: np.ndarray) -> np.ndarray:
    """fp_cupti_check() of each record: the 13 uint32 words at bytes 8..59, mixed."""
    words = records.view("<u4").reshape(-1, RECORD_SIZE // 4)[:, 2:15].astype(np.uint32)
    h = np.full(len(records), 0x9E3779B9, dtype=np.uint32)
    mul = np.uint32(0x85EBCA6B)
    for i in range(13):
        h ^= words[:, i]
        h *= mul
        h ^= h >> np.uint32(13)
    return h


@dataclass(frozen=True)
class RingHeader:
    state: str
    state_detail: int
    state_message: str
    cupti_version: int
    cupti_path: str
    sample_every: int
    sample_cap: int
    flush_ms: int
    init_ns: int
    flushed_ns: int  # every activity CUPTI had complete at this CLOCK_MONOTONIC time is in the ring
    counters: dict[str, int]
    capacity: int
    records_offset: int
    names_offset: int
    names_size: int
    write_seq: int
    names_used: int


def parse_header(data: bytes) -> RingHeader:
    """The header's fields; RingError("bad_header") when it is not a ring of our layout."""
    if len(data) < HEADER_SIZE:
        raise RingError("bad_header", f"header is {len(data)} bytes, expected {HEADER_SIZE}")
    fields = _HEADER.unpack_from(data)
    (magic, layout, header_size, record_size, capacity, records_offset, names_offset, names_size, state,
     detail, version, every, cap, flush_ms, _clock, init_ns, flushed_ns) = fields[:17]  # fmt: skip
    rest = fields[17:]
    counters, path, message = rest[:16], rest[16], rest[17]
    if magic != MAGIC:
        raise RingError("bad_header", f"magic {magic:#x} is not {MAGIC:#x} (library not initialised yet?)")
    if layout != LAYOUT or header_size != HEADER_SIZE or record_size != RECORD_SIZE:
        raise RingError("bad_header", f"layout {layout} (header {header_size} B, records {record_size} B)")
    if not (0 < capacity <= MAX_CAPACITY and capacity & (capacity - 1) == 0):
        raise RingError("bad_header", f"capacity {capacity} is not a power of two up to {MAX_CAPACITY}")
    if records_offset < HEADER_SIZE or names_offset < records_offset + capacity * RECORD_SIZE:
        raise RingError("bad_header", f"records at {records_offset}, names at {names_offset} overlap")
    if names_size > MAX_NAMES_BYTES:
        raise RingError("bad_header", f"names area of {names_size} bytes")
    return RingHeader(
        state=STATES.get(state, f"unknown({state})"),
        state_detail=detail,
        state_message=message.split(b"\0", 1)[0].decode("utf-8", "replace"),
        cupti_version=version,
        cupti_path=path.split(b"\0", 1)[0].decode("utf-8", "replace"),
        sample_every=every,
        sample_cap=cap,
        flush_ms=flush_ms,
        init_ns=init_ns,
        flushed_ns=flushed_ns,
        counters=dict(zip(COUNTERS, counters, strict=False)),
        capacity=capacity,
        records_offset=records_offset,
        names_offset=names_offset,
        names_size=names_size,
        write_seq=_U64.unpack_from(data, WRITE_SEQ_OFFSET)[0],
        names_used=_U64.unpack_from(data, NAMES_USED_OFFSET)[0],
    )


# ---- finding the ring in a process -----------------------------------------------------------------------


@dataclass(frozen=True)
class RingLocation:
    pid: int
    path: str  # the library as the process maps it
    address: int  # of fleetprof_cupti_ring in the process
    size: int  # the symbol's size


def _dynamic_symbol(elf: ElfFile, name: str) -> tuple[int, int] | None:
    """(st_value, st_size) of a defined dynamic symbol, or None."""
    for sec in elf.sections:
        if sec.type != SHT_DYNSYM or not (0 < sec.link < len(elf.sections)):
            continue
        symbols = elf.section_data(sec, 16 << 20)
        strings = elf.section_data(elf.sections[sec.link], 16 << 20)
        wanted = name.encode()
        for off in range(0, len(symbols) - len(symbols) % 24, 24):
            st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", symbols, off)
            if shndx == 0 or not value:
                continue
            end = strings.find(b"\0", st_name)
            if strings[st_name:end] == wanted:
                return value, size
    return None


def _library_mappings(maps: list[Mapping]) -> dict[tuple[int, str], list[Mapping]]:
    found: dict[tuple[int, str], list[Mapping]] = {}
    for m in maps:
        if m.is_file and os.path.basename(m.file_path).startswith(LIBRARY_PREFIX):
            found.setdefault((m.inode, m.file_path), []).append(m)
    return found


def find_ring(pid: int, proc_root: str = "/proc") -> RingLocation:
    """Where the process keeps its ring: the library's mappings, its ELF read inside the process's root."""
    try:
        maps = read_maps(pid, proc_root)
    except FileNotFoundError as e:
        raise RingError("gone", f"pid {pid}: {e}") from e
    except OSError as e:
        raise RingError("unreadable", f"pid {pid}: maps: {e}") from e
    libraries = _library_mappings(maps)
    if not libraries:
        raise RingError("no_ring", f"pid {pid} maps no {LIBRARY_PREFIX}*.so")
    page = os.sysconf("SC_PAGE_SIZE")
    errors = []
    for (inode, path), mappings in libraries.items():
        first = min(mappings, key=lambda m: m.start)
        for opener in mapped_file_openers(proc_root, pid, path, first.start, first.end, inode):
            try:
                with ElfFile(opener()) as elf:
                    symbol = _dynamic_symbol(elf, RING_SYMBOL)
                    segments = sorted(elf.load_segments, key=lambda s: s.vaddr)
            except (OSError, ElfError) as e:  # UnsafeFile is an OSError
                errors.append(f"{path}: {e}")
                continue
            if symbol is None or not segments:
                errors.append(f"{path}: no {RING_SYMBOL} symbol")
                break
            # The lowest PT_LOAD is mapped at bias + its page-aligned vaddr, from its page-aligned offset.
            seg = segments[0]
            base = [m for m in mappings if m.offset == seg.offset & ~(page - 1)]
            if not base:
                errors.append(f"{path}: its first segment is not mapped")
                break
            bias = min(m.start for m in base) - (seg.vaddr & ~(page - 1))
            return RingLocation(pid, path, bias + symbol[0], symbol[1])
    raise RingError("no_ring", f"pid {pid}: " + "; ".join(errors))


class ProcessMemory:
    """Bounded reads of another process's memory through /proc/PID/mem (ptrace access: root here)."""

    def __init__(self, pid: int, proc_root: str = "/proc") -> None:
        try:
            self._fd = os.open(f"{proc_root}/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise RingError("gone", f"pid {pid}: {e}") from e
        except OSError as e:
            raise RingError("unreadable", f"pid {pid}: mem: {e}") from e
        self.pid = pid

    def read(self, address: int, size: int) -> bytes:
        try:
            data = os.pread(self._fd, size, address)
        except OSError as e:
            # The fd names the process's address space: once it has exited, reads fail (ESRCH/EIO).
            reason = "gone" if e.errno in (errno.ESRCH, errno.EIO) else "unreadable"
            raise RingError(reason, f"pid {self.pid}: read {size} B at {address:#x}: {e}") from e
        if len(data) != size:
            raise RingError("gone", f"pid {self.pid}: read {len(data)} of {size} B at {address:#x}")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


# ---- reading --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelRecord:
    name: str | None  # None: the library could not store it (names area full); see name_hash
    name_hash: int
    start_ns: int
    end_ns: int
    device_id: int
    context_id: int
    stream_id: int
    correlation_id: int


@dataclass(frozen=True)
class CopyRecord:
    kind: str  # "memcpy" or "memset"
    copy_kind: int  # memcpy: CUpti_ActivityMemcpyKind (1 HtoD, 2 DtoH, 8 DtoD, ...)
    bytes: int
    start_ns: int
    end_ns: int
    device_id: int
    context_id: int
    stream_id: int
    correlation_id: int


@dataclass(frozen=True)
class LaunchRecord:
    correlation_id: int  # the outermost launch call's (the marker's argument)
    inner_correlation_id: int  # the first nested launch call's (0: none)
    weight: int  # launches of its thread this one stands for
    tid: int
    enter_ns: int
    exit_ns: int
    cbid: int  # the outermost call's CUPTI callback id
    domain: str | None  # "runtime" or "driver"
    inner_cbid: int
    inner_domain: str | None
    result: int


@dataclass(frozen=True)
class RingBatch:
    """What one poll got: new records (as numpy rows of RECORD_DTYPE, split by kind) and the header."""

    pid: int
    header: RingHeader
    activities: np.ndarray  # kernels, memcpys and memsets
    launches: np.ndarray  # sampled launches
    names: dict[int, str]  # every name the reader knows for this process, by name_ref
    lost: int  # records overwritten before this poll could read them
    torn: int  # records whose copy raced the writer or failed its check
    # CLOCK_MONOTONIC: every record the library had handed over by then is in this batch or an earlier one.
    # The header's flushed_ns when the poll read up to the header's write_seq; short of it (a record claimed
    # but not yet published, or max_records), the last such time of a poll that did (None: flushed_ns).
    complete_ns: int | None = None

    @property
    def complete_until(self) -> int:
        return self.header.flushed_ns if self.complete_ns is None else self.complete_ns

    def kernels(self) -> list[KernelRecord]:
        rows = self.activities[self.activities["kind"] == KIND_KERNEL]
        return [
            KernelRecord(self.names.get(int(r["name_ref"])), int(r["name_hash"]), int(r["start_ns"]),
                         int(r["end_ns"]), int(r["device_id"]), int(r["context_id"]), int(r["stream_id"]),
                         int(r["correlation_id"]))
            for r in rows
        ]  # fmt: skip

    def copies(self) -> list[CopyRecord]:
        rows = self.activities[self.activities["kind"] != KIND_KERNEL]
        return [
            CopyRecord("memcpy" if r["kind"] == KIND_MEMCPY else "memset", int(r["subkind"]), int(r["bytes"]),
                       int(r["start_ns"]), int(r["end_ns"]), int(r["device_id"]), int(r["context_id"]),
                       int(r["stream_id"]), int(r["correlation_id"]))
            for r in rows
        ]  # fmt: skip

    def launch_records(self) -> list[LaunchRecord]:
        return [
            LaunchRecord(int(r["correlation_id"]), int(r["inner_correlation_id"]), int(r["weight"]),
                         int(r["tid"]), int(r["enter_ns"]), int(r["exit_ns"]), int(r["subkind"]),
                         DOMAINS.get(int(r["domains"]) & 0xFF), int(r["inner_cbid"]),
                         DOMAINS.get(int(r["domains"]) >> 8), int(r["result"]))
            for r in self.launches
        ]  # fmt: skip


@dataclass
class ReaderStats:
    read: int = 0  # records returned
    lost: int = 0
    torn: int = 0
    polls: int = 0


class RingReader:
    """Reads one process's ring, poll after poll, from where the last poll stopped. Not thread-safe: one
    reader per process, on one thread."""

    def __init__(self, location: RingLocation, memory: ProcessMemory) -> None:
        self.location = location
        self.memory = memory
        self.stats = ReaderStats()
        self._next: int | None = None  # the next record index to read
        self._stuck_at = -1
        self._stuck_polls = 0
        self._names: dict[int, str] = {}
        self._names_read = 0
        self._complete_ns = 0  # the flushed_ns of the last poll that read every record published before it

    @classmethod
    def open(cls, pid: int, proc_root: str = "/proc") -> RingReader:
        location = find_ring(pid, proc_root)
        return cls(location, ProcessMemory(pid, proc_root))

    def close(self) -> None:
        self.memory.close()

    @property
    def position(self) -> int | None:
        """The index of the next record this reader will read (None before its first poll)."""
        return self._next

    def header(self) -> RingHeader:
        return parse_header(self.memory.read(self.location.address, HEADER_SIZE))

    def _write_seq(self) -> int:
        return _U64.unpack(self.memory.read(self.location.address + WRITE_SEQ_OFFSET, 8))[0]

    def poll(self, max_records: int | None = None) -> RingBatch:
        """New records since the last poll (at most one ring's worth, or `max_records`). The first poll
        returns what the ring holds now."""
        h = self.header()
        end_bytes = h.names_offset + h.names_size
        if self.location.size and end_bytes > self.location.size:
            raise RingError(
                "bad_header", f"the header describes {end_bytes} B in a {self.location.size} B symbol"
            )
        cap, w = h.capacity, h.write_seq
        if h.state == "forked":  # the parent's records, copied by fork(): the parent's reader has them
            empty = np.empty(0, dtype=RECORD_DTYPE)
            return RingBatch(self.location.pid, h, empty, empty, self._names, 0, 0)
        if self._next is None or w < self._next:
            self._next = max(0, w - cap)  # first poll, or the ring started over (a new process image)
        lost = torn = 0
        oldest = max(0, w - cap)
        if self._next < oldest:
            lost += oldest - self._next
            self._next = oldest
        stop = w if max_records is None else min(w, self._next + max_records)
        parts: list[np.ndarray] = []
        while self._next < stop:
            first = self._next
            slot = first & (cap - 1)
            n = min(stop - first, cap - slot, READ_CHUNK_RECORDS)
            raw = self.memory.read(
                self.location.address + h.records_offset + slot * RECORD_SIZE, n * RECORD_SIZE
            )
            w_after = self._write_seq()
            rows = np.frombuffer(raw, dtype=RECORD_DTYPE)
            index = np.arange(first, first + n, dtype=np.uint64)
            lapped = index + np.uint64(cap) < np.uint64(w_after)  # the writer may have rewritten it mid-copy
            complete = rows["seq"] == index + np.uint64(1)
            # Not written yet: the slot still holds the previous lap (or its busy mark).
            unwritten = ~lapped & (rows["seq"] < index + np.uint64(1))
            take = n
            if unwritten.any():
                take = int(np.argmax(unwritten))
                if take == 0:
                    if self._stuck_at == first:
                        self._stuck_polls += 1
                    else:
                        self._stuck_at, self._stuck_polls = first, 1
                    if self._stuck_polls < PENDING_GIVE_UP:
                        break
                    lost += 1  # given up: a writer died between its claim and its publish
                    self._next = first + 1
                    continue
            good = complete[:take] & ~lapped[:take]
            checked = np.zeros(take, dtype=bool)
            if good.any():
                checked[good] = record_checks(rows[:take][good]) == rows["check"][:take][good]
            torn += int((lapped[:take] & (rows["seq"][:take] <= index[:take] + np.uint64(1))).sum())
            torn += int((good & ~checked).sum())
            lost += int((rows["seq"][:take] > index[:take] + np.uint64(1)).sum())  # lapped before the copy
            parts.append(rows[:take][checked])
            self._next = first + take
            if take < n:
                break
        # Joined as bytes: np.concatenate would repack the dtype without its overlapping fields.
        records = np.frombuffer(b"".join(p.tobytes() for p in parts), dtype=RECORD_DTYPE)
        is_launch = records["kind"] == KIND_LAUNCH
        activities = records[~is_launch & (records["kind"] >= KIND_KERNEL) & (records["kind"] <= KIND_MEMSET)]
        wanted = int(activities["name_ref"].max()) if len(activities) else 0
        while wanted > self._names_read and self._read_names(h):
            pass
        self.stats.read += len(records)
        self.stats.lost += lost
        self.stats.torn += torn
        self.stats.polls += 1
        # A flush publishes its records before its flushed_ns, but a launch record claimed earlier by another
        # thread may still be unwritten: the poll stops there, and the flush's records after it come with a
        # later poll. Until one reads up to write_seq, flushed_ns does not hold for what was read.
        if self._next >= w:
            self._complete_ns = max(self._complete_ns, h.flushed_ns)
        return RingBatch(
            self.location.pid, h, activities, records[is_launch], self._names, lost, torn, self._complete_ns
        )

    def _read_names(self, h: RingHeader) -> bool:
        """Parse the next NAMES_CHUNK of the names area, up to names_used (re-read now: it covers every
        name a record we hold refers to, since names are published before their records). Whether it got
        further."""
        used = min(
            _U64.unpack(self.memory.read(self.location.address + NAMES_USED_OFFSET, 8))[0], h.names_size
        )
        if used <= self._names_read:
            return False
        base = self.location.address + h.names_offset
        data = self.memory.read(base + self._names_read, min(used - self._names_read, NAMES_CHUNK))
        off = 0
        while off + NAME_HEADER <= len(data):
            length, _hash = struct.unpack_from("<II", data, off)
            entry = (NAME_HEADER + length + 1 + 7) & ~7
            if off + entry > len(data):
                break
            ref = self._names_read + off + 1
            self._names[ref] = data[off + NAME_HEADER : off + NAME_HEADER + length].decode("utf-8", "replace")
            off += entry
        self._names_read += off
        return off > 0


__all__ = [
    "CopyRecord",
    "KernelRecord",
    "LaunchRecord",
    "ProcessMemory",
    "RingBatch",
    "RingError",
    "RingHeader",
    "RingLocation",
    "RingReader",
    "find_ring",
    "parse_header",
]
