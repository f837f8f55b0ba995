"""The write-ahead log: each accepted batch's wire bytes, appended before its ack, replayed at start.

Records live in numbered segment files `wal-NNNNNNNNNNNN.log`. A record is
`u32 length | u32 crc32(body) | body`, body = `u16 len(source) | source | u64 sequence | payload`.
A crash can leave a torn record at the end of the newest segment: replay stops there and the next open
starts a new segment (the torn record was never acknowledged, so the agent resends it).
A checkpoint rotates to a new segment and, once the older segments' contents are committed to the
database, deletes them.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_SOURCE_LEN = struct.Struct("<H")
_SEQUENCE = struct.Struct("<Q")


@dataclass(frozen=True)
class WalRecord:
    source: str
    sequence: int
    payload: bytes


class WriteAheadLog:
    """Not thread-safe: the durable store calls it under its own lock.

    `fsync=False` (the default) makes a record safe against the collector being killed (it is in the
    kernel's page cache once write() returns); `fsync=True` also against the machine losing power, at the
    cost of one fsync per batch.
    """

    def __init__(self, directory: Path, fsync: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        existing = self.segments()
        self._current = (existing[-1] + 1) if existing else 1
        self._file = self._open(self._current)
        self.bytes_written = 0

    def _path(self, segment: int) -> Path:
        return self.directory / f"wal-{segment:012d}.log"

    def _open(self, segment: int):  # noqa: ANN202
        return open(self._path(segment), "ab", buffering=0)  # noqa: SIM115 - held until rotate/close

    def segments(self) -> list[int]:
        out = []
        for p in self.directory.glob("wal-*.log"):
            try:
                out.append(int(p.stem[4:]))
            except ValueError:
                continue
        return sorted(out)

    def append(self, source: str, sequence: int, payload: bytes) -> None:
        src = source.encode()
        body = b"".join((_SOURCE_LEN.pack(len(src)), src, _SEQUENCE.pack(sequence), payload))
        record = _HEADER.pack(len(body), zlib.crc32(body)) + body
        # One unbuffered write per record: a kill after it returns loses nothing of this record.
        view = memoryview(record)
        while view:
            view = view[self._file.write(view) :]
        if self._fsync:
            os.fsync(self._file.fileno())
        self.bytes_written += len(record)

    def rotate(self) -> int:
        """Start a new segment; returns the number of the last closed one (all older ones included)."""
        os.fsync(self._file.fileno())
        self._file.close()
        closed = self._current
        self._current += 1
        self._file = self._open(self._current)
        return closed

    def drop_through(self, segment: int) -> None:
        """Delete segments up to and including `segment`: their contents are committed elsewhere."""
        for s in self.segments():
            if s <= segment and s != self._current:
                self._path(s).unlink(missing_ok=True)

    def replay(self) -> Iterator[WalRecord]:
        """Every intact record of the closed segments, oldest first (call before appending)."""
        for s in self.segments():
            if s == self._current:
                continue
            yield from self._read_segment(self._path(s))

    @staticmethod
    def _read_segment(path: Path) -> Iterator[WalRecord]:
        data = path.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, pos)
            body = data[pos + _HEADER.size : pos + _HEADER.size + length]
            if len(body) < length or zlib.crc32(body) != crc:
                log.warning("%s: torn record at byte %d (a crash mid-write); ignoring the rest", path, pos)
                return
            (slen,) = _SOURCE_LEN.unpack_from(body, 0)
            source = body[2 : 2 + slen].decode()
            (sequence,) = _SEQUENCE.unpack_from(body, 2 + slen)
            yield WalRecord(source, sequence, bytes(body[2 + slen + _SEQUENCE.size :]))
            pos += _HEADER.size + length
        if pos != len(data):
            log.warning("%s: %d trailing bytes of a torn record ignored", path, len(data) - pos)

    def size_bytes(self) -> int:
        return sum(self._path(s).stat().st_size for s in self.segments() if self._path(s).exists())

    def close(self) -> None:
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()
