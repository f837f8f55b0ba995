"""Draining BPF hash maps into plain values: batched lookup-and-delete through small fixed buffers."""

from __future__ import annotations

import array
import ctypes as ct
import errno
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache

DRAIN_CHUNK = 1024  # entries per batch call
MAX_CHUNK_BYTES = 4 << 20  # per-CPU values grow with the CPU count: cap one chunk's value buffer


@cache
def possible_cpus() -> int:
    """Per-CPU maps hold one value per *possible* CPU (not online), as the kernel counts them."""
    from bcc.utils import get_possible_cpus

    return len(get_possible_cpus())


def drain_map(table, key_type, value_type, chunk: int = DRAIN_CHUNK) -> list:  # BCC table
    """Look up and delete every entry with BPF_MAP_LOOKUP_AND_DELETE_BATCH, `chunk` at a time.

    BCC's own helper allocates buffers for max_entries on every call (16 MB for a stack map); this keeps
    a fixed small buffer. Falls back to per-key lookup/delete on kernels without batch ops (< 5.6).
    """
    out: list = []
    try:
        for n, keys, values in _batches(table, lambda c: ((key_type * c)(), (value_type * c)()), chunk):
            out.extend((_copy(keys[i]), _copy(values[i])) for i in range(n))
    except _NoBatchOps:
        return _drain_map_slow(table)
    return out


def drain_map_bytes(table, key_size: int, value_size: int, chunk: int = DRAIN_CHUNK) -> tuple[bytes, bytes]:
    """drain_map for callers that parse entries with struct.iter_unpack: all keys and all values as two
    byte strings (n x key_size, n x value_size); ~10x faster than ctypes objects for a 16k-entry map."""
    return _map_bytes(table, key_size, value_size, chunk, delete=True)


def drain_map_chunks(
    table, key_size: int, value_size: int, chunk: int = DRAIN_CHUNK
) -> Iterator[tuple[bytes, bytes]]:
    """drain_map_bytes a batch at a time: (keys, values) of up to `chunk` entries each, so a caller that
    parses as it goes never holds the whole map's bytes (a full stack map is ~1 KB an entry: tens of MB)."""

    def buffers(c: int) -> tuple:
        return (ct.c_char * (key_size * c))(), (ct.c_char * (value_size * c))()

    try:
        for n, keys, values in _batches(table, buffers, chunk, delete=True):
            yield keys.raw[: n * key_size], values.raw[: n * value_size]
    except _NoBatchOps:
        entries = _drain_map_slow(table)
        yield (
            b"".join(_as_bytes(k, key_size) for k, _ in entries),
            b"".join(_as_bytes(v, value_size) for _, v in entries),
        )


def read_map_bytes(table, key_size: int, value_size: int, chunk: int = DRAIN_CHUNK) -> tuple[bytes, bytes]:
    """drain_map_bytes that leaves the entries in place (BPF_MAP_LOOKUP_BATCH): a map BPF owns, read."""
    return _map_bytes(table, key_size, value_size, chunk, delete=False)


def _map_bytes(table, key_size: int, value_size: int, chunk: int, delete: bool) -> tuple[bytes, bytes]:
    def buffers(c: int) -> tuple:
        return (ct.c_char * (key_size * c))(), (ct.c_char * (value_size * c))()

    key_parts, value_parts = [], []
    try:
        for n, keys, values in _batches(table, buffers, chunk, delete):
            key_parts.append(keys.raw[: n * key_size])
            value_parts.append(values.raw[: n * value_size])
    except _NoBatchOps:
        for k, v in _drain_map_slow(table) if delete else _read_map_slow(table):
            key_parts.append(_as_bytes(k, key_size))
            value_parts.append(_as_bytes(v, value_size))
    return b"".join(key_parts), b"".join(value_parts)


def drain_percpu_sums(table, key_layout: struct.Struct, words: int) -> list[tuple[tuple, tuple[int, ...]]]:
    """Drain a per-CPU hash whose value is `words` u64s: each key, unpacked with `key_layout`, with its
    values summed over CPUs, as a tuple of `words` ints."""
    ncpus = possible_cpus()
    stride = words * ncpus  # u64s per entry: the kernel hands out one value per possible CPU
    chunk = max(64, min(DRAIN_CHUNK, MAX_CHUNK_BYTES // (8 * stride)))
    keys, values = drain_map_bytes(table, key_layout.size, 8 * stride, chunk)
    u64s = array.array("Q", values)  # CPU-major within an entry: cpu0's words, cpu1's words, ...
    out = []
    for i, key in enumerate(key_layout.iter_unpack(keys)):
        base = i * stride
        if words == 1:
            out.append((key, (sum(u64s[base : base + stride]),)))
        else:
            out.append((key, tuple(sum(u64s[base + w : base + stride : words]) for w in range(words))))
    return out


def write_array(table, first: int, values: bytes, value_size: int, chunk: int = 65536) -> None:
    """Write consecutive entries [first, first + n) of a BPF array map from `values` (n x value_size bytes)
    with BPF_MAP_UPDATE_BATCH, `chunk` entries a call: a million 8-byte rows in a few system calls, where
    BCC's per-key update takes ~5 us each. Raises OSError naming the map when the kernel refuses."""
    from bcc.libbcc import lib as bcclib

    total = len(values) // value_size
    done = 0
    while done < total:
        n = min(chunk, total - done)
        keys = array.array("I", range(first + done, first + done + n))
        vals = values[done * value_size : (done + n) * value_size]
        count = ct.c_uint32(n)
        key_buf = (ct.c_char * len(keys.tobytes())).from_buffer_copy(keys.tobytes())
        val_buf = (ct.c_char * len(vals)).from_buffer_copy(vals)
        if bcclib.bpf_update_batch(table.map_fd, key_buf, val_buf, ct.byref(count)) != 0:
            err = ct.get_errno()
            raise OSError(err, f"writing BPF map {table.name!r}: {os.strerror(err)}")
        done += n


class _NoBatchOps(Exception):
    """The kernel has no batch lookup-and-delete for this map (< 5.6)."""


def _batches(table, buffers: Callable[[int], tuple], chunk: int, delete: bool = True) -> Iterator[tuple]:
    """Yield (entries, keys buffer, values buffer) per batch call, deleting what it read unless told not
    to. Buffers are reused, so consume each batch before asking for the next; `buffers(n)` makes a pair
    that holds n entries."""
    from bcc.libbcc import lib as bcclib

    batch_call = bcclib.bpf_lookup_and_delete_batch if delete else bcclib.bpf_lookup_batch
    keys, values = buffers(chunk)
    token = ct.c_uint32(0)  # hash maps resume from a bucket index
    count = ct.c_uint32(0)
    first = True
    seen = False
    while True:
        count.value = chunk
        res = batch_call(
            table.map_fd,
            None if first else ct.byref(token),
            ct.byref(token),
            ct.byref(keys),
            ct.byref(values),
            ct.byref(count),
        )
        err = ct.get_errno()
        if count.value:
            seen = True
            yield count.value, keys, values
        first = False
        if res != 0:
            if err == errno.ENOENT:
                return  # done
            if err == errno.ENOSPC and count.value == 0:
                # One hash bucket holds more entries than the buffer: grow it and resume at that bucket.
                chunk *= 2
                keys, values = buffers(chunk)
                continue
            if err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) and not seen:
                raise _NoBatchOps
            raise OSError(err, f"draining BPF map {table.name!r}: {os.strerror(err)}")
        if count.value == 0:
            return


def _as_bytes(value, size: int) -> bytes:  # int or ctypes value
    return value.to_bytes(size, sys.byteorder) if isinstance(value, int) else bytes(value)


def _copy(value):  # ctypes value
    """ctypes array elements alias the buffer that the next chunk overwrites: copy them out.

    (Elements of arrays of simple types already come back as Python ints.)
    """
    if isinstance(value, int):
        return value
    return type(value).from_buffer_copy(value)


def _value(obj):  # BCC hands out c_uint64 wrappers here, not ints
    return obj.value if isinstance(obj, ct._SimpleCData) else _copy(obj)


def _read_map_slow(table):
    return [(_value(k), _value(v)) for k, v in table.items()]


def _drain_map_slow(table):
    out = []
    for k in list(table.keys()):
        try:
            v = table[k]
        except KeyError:
            continue
        out.append((_value(k), _value(v)))
        del table[k]
    return out


class CounterDeltas:
    """Reads a per-CPU array of cumulative counters (never cleared by BPF) and returns, per call, how much
    each grew since the previous call, named by `names` (index i is counter i).

    One lookup per counter, so the counters are read at slightly different times. They are read from the
    last index to the first: a counter of what follows an event (how a walk ended, of which a sampled
    switch-out was runnable) comes after the event's own counter in the layout, so it is read earlier, and
    every follow-up read has its event read too: never more walk ends than walks (a fresh-clone run read
    42,704 ends of 42,703 walks when they were read in index order).

    That keeps the totals consistent, not each window: events counted at one read whose follow-ups came
    after it show in the next window, which can then hold more follow-ups than events (the arm64 guest's
    agent sent 242 launches sampled of 240 launches, and the collector refused the batch). `follow_ups`
    names such pairs (follow-up: event, an event before its follow-ups); each window reports at most its
    event's delta of the follow-up and carries the rest to the next (_bounded_follow_up)."""

    def __init__(self, table, names: Sequence[str], follow_ups: Mapping[str, str] | None = None):
        # table: a BCC per-CPU array
        self._table = table
        self._names = tuple(names)
        self._last = [0] * len(self._names)
        self._follow_ups = dict(follow_ups or {})
        for follow_up, event in self._follow_ups.items():
            if follow_up not in self._names or event not in self._names:
                raise ValueError(f"unknown counter in follow-up pair {follow_up!r}: {event!r}")
        self._carry = dict.fromkeys(self._follow_ups, 0)

    def __call__(self) -> dict[str, int]:
        totals = [0] * len(self._names)
        for i in reversed(range(len(self._names))):
            totals[i] = sum(self._table[ct.c_int(i)])
        deltas = {n: total - last for n, total, last in zip(self._names, totals, self._last, strict=True)}
        self._last = totals
        for follow_up, event in self._follow_ups.items():  # in order: an event may be a follow-up above
            deltas[follow_up], self._carry[follow_up] = _bounded_follow_up(
                deltas[follow_up], deltas[event], self._carry[follow_up]
            )
        return deltas


def _bounded_follow_up(follow_up: int, event: int, carry: int) -> tuple[int, int]:
    """A follow-up counter's window delta plus what earlier windows carried, kept at or under its event's
    delta: (reported, new carry). Totals stay exact, a window late at most."""
    wanted = follow_up + carry
    reported = min(wanted, max(event, 0))
    return reported, wanted - reported


class DoubleBuffer:
    """The two-map-set discipline shared by the BPF programs: they write the set named by control[0];
    `flip()` points them at the other set, waits until programs that read the old index have finished
    (they run for microseconds; the grace is generous), and returns (idle set, window start ns, window
    end ns). The idle set can then be drained and emptied with no writer racing the drain."""

    GRACE_S = 0.02

    def __init__(self, control) -> None:  # the BCC array "control"
        self._control = control
        self._active = 0
        self._control[ct.c_int(0)] = ct.c_uint32(0)
        self._window_start_ns = time.time_ns()

    def flip(self) -> tuple[int, int, int]:
        idle, self._active = self._active, 1 - self._active
        self._control[ct.c_int(0)] = ct.c_uint32(self._active)
        end_ns = time.time_ns()
        start_ns, self._window_start_ns = self._window_start_ns, end_ns
        time.sleep(self.GRACE_S)
        return idle, start_ns, end_ns
