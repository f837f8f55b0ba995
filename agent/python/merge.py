"""Put a thread's Python frames where the interpreter's own C frames stood in its native stack.

The native stack (root first) of a CPython thread looks like
    _start; main; Py_RunMain; ... _PyEval_EvalFrameDefault; ... _PyEval_EvalFrameDefault; ext_func; memcpy
The span from the first to the last evaluation frame is the interpreter running Python code: it is replaced
by the Python frames, so native frames below it (process start-up) stay at the root and native frames above
it (a C extension, a libpython builtin, libc) stay at the leaf, under the Python function that called them.

Without frame pointers (Debian's and pyenv's CPython, glibc) the kernel's unwind stops after 1-3 frames, and
what lies beyond the first frame is often a stray return address read through a register that was not a
frame pointer. Such a stack does not end in an entry point (_start, __libc_start_main, start_thread,
clone): it is truncated, and only its leaf-most frames up to the last evaluation frame are trusted. Then
the Python frames become the root and those native frames stay above them as the leaf:
`outer; middle; list_append` (the leaf was a libpython builtin) or `outer; middle` (the leaf was the
evaluation loop itself). What is lost is only native frames between Python frames (C calling back into
Python), which such a stack never had.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetprof.agent.symbols.symbolizer import Frame

# Functions that evaluate Python frames (3.11-3.13); anything between two of them is call machinery.
EVAL_FUNCTIONS = frozenset(
    {
        "_PyEval_EvalFrameDefault",
        "_PyEval_EvalFrame",
        "_PyEval_Vector",
        "PyEval_EvalCode",
        "PyEval_EvalCodeEx",
        "_PyEval_EvalFrameDefault.cold",
    }
)


def is_eval_frame(frame: Frame) -> bool:
    return frame.function in EVAL_FUNCTIONS


# Where complete native stacks start: a process's main thread, or a thread created by glibc.
ENTRY_FUNCTIONS = frozenset(
    {"_start", "__libc_start_main", "__libc_start_call_main", "start_thread", "clone", "clone3", "__clone"}
)


def merge(native: Sequence[Frame], python: Sequence[Frame]) -> tuple[Frame, ...]:
    """One user stack, root first, from native frames (root first) and the thread's Python frames."""
    if not python:
        return tuple(native)
    first = last = -1
    for i, f in enumerate(native):
        if is_eval_frame(f):
            if first < 0:
                first = i
            last = i
    complete = bool(native) and native[0].function in ENTRY_FUNCTIONS
    if first < 0:
        return (*python, *native)
    if not complete:
        return (*python, *native[last + 1 :])
    return (*native[:first], *python, *native[last + 1 :])
