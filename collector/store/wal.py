"""The write-ahead log: each accepted batch's wire bytes, appended before its ack, replayed at start.

Records live in numbered segment files `wal-NNNNNNNNNNNN.log`. A record is
`u32 length | u32 crc32(body) | body`, body = `u16 len(source) | source | u64 sequence | payload`.

A record is never left torn in front of good ones. When an append fails part-way (ENOSPC, EIO, a short
write) the segment is truncated back to its last good record; if even that fails, the segment is closed
for good and the next append opens a new one. Either way the failed append raises `WalError`, its batch
is not acknowledged, and the agent resends it. Only a crash mid-write can leave a torn record, always at
the end of a segment: replay stops reading that segment there and goes on with the next one.

A flush rotates to a new segment; once every chunk with records in the older segments is committed to the
database, the durable store deletes them.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_SOURCE_LEN = struct.Struct("<H")
_SEQUENCE = struct.Struct("<Q")

# os.write's shape: the one seam tests use to inject EIO and short writes.
WriteFn = Callable[[int, memoryview], int]


class WalError(OSError):
    """An append that did not make it to the log; nothing of it is left in the log."""


@dataclass(frozen=True)
class WalRecord:
    source: str
    sequence: int
    payload: bytes


class WriteAheadLog:
    """Not thread-safe: the durable store calls it under its own lock.

    `fsync=False` (the default) makes a record safe against the collector being killed (it is in the
    kernel's page cache once write() returns); `fsync=True` also against the machine losing power, at the
    cost of one fsync per batch. Segments are created on their first append, so rotating never writes.
    """

    def __init__(self, directory: Path, fsync: bool = False, write: WriteFn = os.write):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._write = write
        existing = self.segments()
        self._current = (existing[-1] + 1) if existing else 1
        self._fd: int | None = None
        self._good = 0  # bytes of whole records in the current segment
        self.bytes_written = 0
        self.append_errors = 0

    def _path(self, segment: int) -> Path:
        return self.directory / f"wal-{segment:012d}.log"

    def segments(self) -> list[int]:
        out = []
        for p in self.directory.glob("wal-*.log"):
            try:
                out.append(int(p.stem[4:]))
            except ValueError:
                continue
        return sorted(out)

    @property
    def current(self) -> int:
        """The segment the next append goes to."""
        return self._current

    def append(self, source: str, sequence: int, payload: bytes) -> None:
        """Log one record, or raise WalError with the log as it was before the call."""
        src = source.encode()
        body = b"".join((_SOURCE_LEN.pack(len(src)), src, _SEQUENCE.pack(sequence), payload))
        record = _HEADER.pack(len(body), zlib.crc32(body)) + body
        try:
            if self._fd is None:
                self._fd = os.open(self._path(self._current), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._good = os.fstat(self._fd).st_size
            view = memoryview(record)
            while view:
                n = self._write(self._fd, view)
                if n <= 0:  # a write that makes no progress would loop for ever
                    raise OSError(errno.EIO, "write wrote nothing")
                view = view[n:]
            if self._fsync:
                os.fsync(self._fd)
        except OSError as err:
            self.append_errors += 1
            self._undo()
            raise WalError(
                err.errno, f"write-ahead log {self._path(self._current)}: {err.strerror or err}"
            ) from err
        self._good += len(record)
        self.bytes_written += len(record)

    def _undo(self) -> None:
        """Cut a failed append off the segment; if that fails too, never write to that segment again."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._good)
            return
        except OSError as err:
            log.warning(
                "%s: cannot truncate a failed append (%s); starting a new segment",
                self._path(self._current),
                err,
            )
        self._close_segment()
        self._current += 1

    def _close_segment(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as err:  # the records are in the page cache; only a power loss could lose them
            log.warning("%s: fsync at close failed: %s", self._path(self._current), err)
        os.close(fd)

    def rotate(self) -> int:
        """Start a new segment; returns the number of the last closed one (all older ones included)."""
        self._close_segment()
        closed = self._current
        self._current += 1
        self._good = 0
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
        total = 0
        for s in self.segments():
            try:
                total += self._path(s).stat().st_size
            except FileNotFoundError:  # dropped by the flusher meanwhile
                continue
        return total

    def close(self) -> None:
        self._close_segment()
