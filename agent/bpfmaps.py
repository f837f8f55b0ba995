"""Draining BPF hash maps into plain values: batched lookup-and-delete through small fixed buffers."""

from __future__ import annotations

import array
import ctypes as ct
import errno
import os
from functools import cache

DRAIN_CHUNK = 1024  # entries per batch call
MAX_CHUNK_BYTES = 4 << 20  # per-CPU values grow with the CPU count: cap one chunk's value buffer


@cache
def possible_cpus() -> int:
    """Per-CPU maps hold one value per *possible* CPU (not online), as the kernel counts them."""
    from bcc.utils import get_possible_cpus

    return len(get_possible_cpus())


def drain_map(table, key_type, value_type, chunk: int = DRAIN_CHUNK) -> list:  # noqa: ANN001 - BCC table
    """Look up and delete every entry with BPF_MAP_LOOKUP_AND_DELETE_BATCH, `chunk` at a time.

    BCC's own helper allocates buffers for max_entries on every call (16 MB for a stack map); this keeps
    a fixed small buffer. Falls back to per-key lookup/delete on kernels without batch ops (< 5.6).
    """
    from bcc.libbcc import lib as bcclib

    keys = (key_type * chunk)()
    values = (value_type * chunk)()
    token = ct.c_uint32(0)  # hash maps resume from a bucket index
    count = ct.c_uint32(0)
    first = True
    out: list = []
    while True:
        count.value = chunk
        res = bcclib.bpf_lookup_and_delete_batch(
            table.map_fd,
            None if first else ct.byref(token),
            ct.byref(token),
            ct.byref(keys),
            ct.byref(values),
            ct.byref(count),
        )
        err = ct.get_errno()
        for i in range(count.value):
            out.append((_copy(keys[i]), _copy(values[i])))
        first = False
        if res != 0:
            if err == errno.ENOENT:
                break  # done
            if err == errno.ENOSPC and count.value == 0:
                # One hash bucket holds more entries than the buffer: grow it and resume at that bucket.
                chunk *= 2
                keys = (key_type * chunk)()
                values = (value_type * chunk)()
                continue
            if err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) and not out:
                return _drain_map_slow(table)
            raise OSError(err, f"draining BPF map {table.name!r}: {os.strerror(err)}")
        if count.value == 0:
            break
    return out


def drain_percpu_sums(table, key_type, words: int) -> list[tuple]:  # noqa: ANN001 - BCC table
    """Drain a per-CPU hash whose value is `words` u64s; each key comes back with its values summed
    over CPUs, as a tuple of `words` ints."""
    ncpus = possible_cpus()
    value_type = (ct.c_uint64 * words) * ncpus
    chunk = max(64, min(DRAIN_CHUNK, MAX_CHUNK_BYTES // ct.sizeof(value_type)))
    out = []
    for key, value in drain_map(table, key_type, value_type, chunk):
        flat = array.array("Q", bytes(value))  # CPU-major: cpu0 words, cpu1 words, ...
        out.append((key, tuple(sum(flat[w::words]) for w in range(words))))
    return out


def _copy(value):  # noqa: ANN001 - ctypes value
    """ctypes array elements alias the buffer that the next chunk overwrites: copy them out.

    (Elements of arrays of simple types already come back as Python ints.)
    """
    if isinstance(value, int):
        return value
    return type(value).from_buffer_copy(value)


def _value(obj):  # noqa: ANN001 - BCC hands out c_uint64 wrappers here, not ints
    return obj.value if isinstance(obj, ct._SimpleCData) else _copy(obj)


def _drain_map_slow(table):  # noqa: ANN001
    out = []
    for k in list(table.keys()):
        try:
            v = table[k]
        except KeyError:
            continue
        out.append((_value(k), _value(v)))
        del table[k]
    return out
