"""Where CPython keeps the state the BPF walker follows, per minor version (release builds).

3.11 and 3.12 are tabled here: offsetof() against each version's internal headers gives the same values on
x86-64 and arm64 (tests/agent/test_python_offsets.py compiles it for both; the structs differ across the two
only after these fields, e.g. _PyRuntimeState is 16 bytes larger on arm64, whose pthread_mutex_t is). 3.13 and
later publish them in `_Py_DebugOffsets` at the start of `_PyRuntime`, read from the binary's .data as
64-bit words (Debian's arm64 libpython3.13 3.13.18 gives what x86-64 3.13.0 gives).
`PyProc` mirrors `struct py_proc` in agent/bpf/python_stack.h.
"""

from __future__ import annotations

import ctypes as ct
import struct
from dataclasses import dataclass

DIRECT_FRAME = 0xFFFFFFFF  # PY_DIRECT_FRAME: the thread state points at the frame itself (3.13+)
FRAME_OWNED_BY_CSTACK = 3  # 3.12+ entry shim frames (`<interpreter trampoline>`): not user code
FRAME_READ = 72  # PY_FRAME_READ: the walker reads this many bytes of each frame header
NO_FIELD = 0xFFFFFFFF  # PY_NO_FIELD
ENTRY_TAG = 1 << 31  # set in a frame's tag by the walker: the first frame a C call into the interpreter ran


class PyProc(ct.Structure):
    _fields_ = [
        ("runtime", ct.c_uint64),
        ("pidns_dev", ct.c_uint64),
        ("pidns_ino", ct.c_uint64),
        ("interp_head", ct.c_uint32),
        ("threads_head", ct.c_uint32),
        ("tstate_next", ct.c_uint32),
        ("tstate_native_tid", ct.c_uint32),
        ("tstate_frame", ct.c_uint32),
        ("cframe_frame", ct.c_uint32),
        ("frame_code", ct.c_uint32),
        ("frame_previous", ct.c_uint32),
        ("frame_instr", ct.c_uint32),
        ("frame_owner", ct.c_uint32),
        ("version", ct.c_uint32),
        ("code_qualname", ct.c_uint32),
        ("frame_entry", ct.c_uint32),
        ("code_type", ct.c_uint64),
    ]


@dataclass(frozen=True)
class Offsets:
    """Byte offsets into CPython's structs for one interpreter build."""

    interp_head: int  # _PyRuntimeState.interpreters.head
    threads_head: int  # PyInterpreterState.threads.head
    tstate_next: int
    tstate_native_tid: int
    tstate_frame: int  # PyThreadState.cframe (3.11/3.12) or .current_frame (3.13+)
    cframe_frame: int  # _PyCFrame.current_frame, or DIRECT_FRAME
    frame_code: int
    frame_previous: int
    frame_instr: int
    frame_owner: int
    code_filename: int
    code_qualname: int
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int  # co_code_adaptive: where the bytecode (and instruction offsets) start
    ascii_data: int  # sizeof(PyASCIIObject): where a compact ASCII string's bytes start
    compact_data: int  # sizeof(PyCompactUnicodeObject): the same for other compact strings
    frame_entry: int = NO_FIELD  # 3.11's _PyInterpreterFrame.is_entry; later versions push shim frames

    def check(self) -> None:
        """The walker's buffer tricks need frame fields inside the first FRAME_READ bytes."""
        for name in ("frame_code", "frame_previous", "frame_instr"):
            v = getattr(self, name)
            if v % 8 or v + 8 > FRAME_READ:
                raise ValueError(f"{name}={v}: the BPF walker needs an aligned field below {FRAME_READ}")
        for name in ("frame_owner", "frame_entry"):
            v = getattr(self, name)
            if v != NO_FIELD and v >= FRAME_READ:
                raise ValueError(f"{name}={v} lies beyond the {FRAME_READ} bytes read")


TABLE: dict[tuple[int, int], Offsets] = {
    (3, 11): Offsets(40, 16, 8, 160, 56, 8, 32, 48, 56, 69, 112, 128, 72, 136, 184, 48, 72, frame_entry=68),
    (3, 12): Offsets(40, 72, 8, 144, 56, 0, 0, 8, 56, 70, 112, 128, 68, 136, 192, 40, 56),
}
FIRST_DEBUG_OFFSETS = (3, 13)  # from here on, _Py_DebugOffsets
LAST_KNOWN = (3, 13)  # newer layouts may move what _Py_DebugOffsets does not describe: not trusted yet

DEBUG_COOKIE = b"xdebugpy"


def from_debug_offsets(blob: bytes) -> Offsets:
    """Offsets from the first bytes of a 3.13 `_PyRuntime` (its `_Py_DebugOffsets`)."""
    if not blob.startswith(DEBUG_COOKIE):
        raise ValueError("_PyRuntime does not start with the _Py_DebugOffsets cookie")
    w = struct.unpack_from("<73Q", blob, 0)
    # Word indices follow Include/internal/pycore_runtime.h (3.13): cookie, version, free_threaded, then
    # runtime_state{size, finalizing, interpreters_head}, interpreter_state{size, id, next, threads_head,
    # 9 more}, thread_state{size, prev, next, interp, current_frame, thread_id, native_thread_id,
    # datastack_chunk, status}, interpreter_frame{size, previous, executable, instr_ptr, localsplus, owner},
    # code_object{size, filename, name, qualname, linetable, firstlineno, argcount, localsplusnames,
    # localspluskinds, co_code_adaptive}, ... unicode_object{size, state, length, asciiobject_size}.
    if w[2]:
        raise ValueError("free-threaded CPython builds are not supported")
    rt, interp, ts, fr, co = 3, 6, 19, 28, 34
    uni = co + 10 + 2 + 4 + 3 + 3 + 3 + 2 + 3 + 3  # pyobject, type, tuple, list, dict, float, long, bytes
    ascii_size = w[uni + 3]
    return Offsets(
        interp_head=w[rt + 2],
        threads_head=w[interp + 3],
        tstate_next=w[ts + 2],
        tstate_native_tid=w[ts + 6],
        tstate_frame=w[ts + 4],
        cframe_frame=DIRECT_FRAME,
        frame_code=w[fr + 2],
        frame_previous=w[fr + 1],
        frame_instr=w[fr + 3],
        frame_owner=w[fr + 5],
        code_filename=w[co + 1],
        code_qualname=w[co + 3],
        code_firstlineno=w[co + 5],
        code_linetable=w[co + 4],
        code_adaptive=w[co + 9],
        ascii_data=ascii_size,
        compact_data=ascii_size + 16,  # utf8_length, utf8
    )


DEBUG_OFFSETS_BYTES = 73 * 8


def to_bpf(
    offsets: Offsets, runtime: int, pidns: tuple[int, int], version: tuple[int, int], code_type: int = 0
) -> PyProc:
    """`code_type`: PyCode_Type's address in the process (0: unknown), against which BPF checks frames."""
    return PyProc(
        runtime=runtime,
        pidns_dev=pidns[0],
        pidns_ino=pidns[1],
        interp_head=offsets.interp_head,
        threads_head=offsets.threads_head,
        tstate_next=offsets.tstate_next,
        tstate_native_tid=offsets.tstate_native_tid,
        tstate_frame=offsets.tstate_frame,
        cframe_frame=offsets.cframe_frame,
        frame_code=offsets.frame_code,
        frame_previous=offsets.frame_previous,
        frame_instr=offsets.frame_instr,
        frame_owner=offsets.frame_owner,
        version=(version[0] << 8) | version[1],
        code_qualname=offsets.code_qualname,
        frame_entry=offsets.frame_entry,
        code_type=code_type,
    )
