"""Offsets of kernel struct fields from the running kernel's BTF (/sys/kernel/btf/vmlinux), read through
libbpf, which BCC itself links: a BPF program reads the field with one bpf_probe_read_kernel at the offset
passed in as a macro, without including the kernel header that declares the struct (linux/sched.h adds ~1 s
to BCC's compile of a program at every agent start)."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

_KIND_STRUCT, _KIND_UNION = 4, 5
_KIND_ALIASES = {8, 9, 10, 11, 18}  # typedef, volatile, const, restrict, type tag: their type is the target


class _BtfType(ctypes.Structure):
    # struct btf_type (uapi/linux/btf.h): name_off, info (vlen: bits 0-15, kind: 24-28, kind_flag: 31),
    # size; a struct's or union's members follow it.
    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32), ("size", ctypes.c_uint32)]


class _BtfMember(ctypes.Structure):
    # struct btf_member: name_off, type, offset (in bits; with kind_flag, bits 0-23 only)
    _fields_ = [("name_off", ctypes.c_uint32), ("type", ctypes.c_uint32), ("offset", ctypes.c_uint32)]


@cache
def _libbpf() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.btf__load_vmlinux_btf.restype = ctypes.c_void_p
    lib.btf__find_by_name_kind.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    lib.btf__find_by_name_kind.restype = ctypes.c_int32
    lib.btf__type_by_id.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__type_by_id.restype = ctypes.POINTER(_BtfType)
    lib.btf__name_by_offset.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__name_by_offset.restype = ctypes.c_char_p
    lib.btf__free.argtypes = [ctypes.c_void_p]
    return lib


def _member_bits(lib: ctypes.CDLL, btf: int, type_id: int, name: bytes) -> tuple[int, int] | None:
    """(bit offset, type id) of member `name` of the struct or union `type_id`, looking through anonymous
    members (task_struct's fields sit in one where the kernel randomizes its layout)."""
    t = lib.btf__type_by_id(btf, type_id)
    while t and (t.contents.info >> 24) & 0x1F in _KIND_ALIASES:
        t = lib.btf__type_by_id(btf, t.contents.size)
    if not t or (t.contents.info >> 24) & 0x1F not in (_KIND_STRUCT, _KIND_UNION):
        return None
    kind_flag = t.contents.info >> 31
    members = ctypes.cast(ctypes.addressof(t.contents) + ctypes.sizeof(_BtfType), ctypes.POINTER(_BtfMember))
    for i in range(t.contents.info & 0xFFFF):
        m = members[i]
        bits = m.offset & 0xFFFFFF if kind_flag else m.offset
        if m.name_off == 0:
            inner = _member_bits(lib, btf, m.type, name)
            if inner is not None:
                return bits + inner[0], inner[1]
        elif lib.btf__name_by_offset(btf, m.name_off) == name:
            return bits, m.type
    return None


@cache
def field_offsets(struct: str, *paths: str) -> tuple[int, ...] | None:
    """Byte offsets in `struct` of each dotted member path (e.g. "se.sum_exec_runtime"), from the running
    kernel's BTF; None where there is no BTF, no libbpf, or a path does not resolve to a whole byte."""
    lib = _libbpf()
    if lib is None:
        return None
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return None
    try:
        root = lib.btf__find_by_name_kind(btf, struct.encode(), _KIND_STRUCT)
        if root <= 0:
            return None
        out = []
        for path in paths:
            type_id, bits = root, 0
            for name in path.split("."):
                found = _member_bits(lib, btf, type_id, name.encode())
                if found is None:
                    return None
                bits += found[0]
                type_id = found[1]
            if bits % 8:
                return None
            out.append(bits // 8)
        return tuple(out)
    finally:
        lib.btf__free(btf)
