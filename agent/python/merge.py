"""Put a thread's Python frames where the interpreter's own C frames stood in its native stack.

A whole native stack (root first) of a CPython thread looks like
    _start; main; Py_RunMain; ... _PyEval_EvalFrameDefault; builtin_sorted; ... _PyEval_EvalFrameDefault; free
Each _PyEval_EvalFrameDefault is one C call into the interpreter, and it ran one group of Python frames
(3.11+ evaluate Python-to-Python calls without a new C frame; the walker marks where each group starts).
When the groups and the evaluation frames pair up, each evaluation frame is replaced by its group, and the C
between two of them (a builtin or an extension that called back into Python) stays between the Python
frame that called it and the frames it called; interpreter call machinery (EVAL_FUNCTIONS) is dropped.

Otherwise -- the native walk was truncated (frame pointers only: Debian's and pyenv's CPython and glibc have
none, and the kernel's walk stops after 1-3 frames), or the Python walk was cut at its depth limit -- the span
from the first to the last evaluation frame is replaced by all Python frames, native frames below it (process
start-up) stay at the root and native frames above it at the leaf. A native stack that does not start at an
entry point (_start, __libc_start_main, start_thread, clone) is truncated: only its leaf-most frames up to the
last evaluation frame are trusted, and the Python frames become the root: `outer; middle; list_append`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from fleetprof.agent.model import Frame

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


# Where complete native stacks start: a process's main thread, or a thread created by glibc.
ENTRY_FUNCTIONS = frozenset(
    {"_start", "__libc_start_main", "__libc_start_call_main", "start_thread", "clone", "clone3", "__clone"}
)


PythonFrames = tuple[tuple[Frame, ...], ...]
"""A thread's Python frames, root first, in groups: one per C call into the interpreter, root-most first."""

# The C frame of one call into the interpreter (the hot path, or its split-off cold part: never both).
_EVALUATOR = frozenset({"_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold"})


def merge(native: Sequence[Frame], python: PythonFrames) -> tuple[Frame, ...]:
    """One user stack, root first, from native frames (root first) and the thread's Python frames."""
    flat = tuple(chain.from_iterable(python))
    if not flat:
        return tuple(native)
    complete = bool(native) and native[0].function in ENTRY_FUNCTIONS
    # Each frame's name read once and tested inline (no call a frame): every new stack of a Python process
    # is merged.
    functions = [f.function for f in native]
    at = [i for i, name in enumerate(functions) if name in EVAL_FUNCTIONS]
    evaluators = [i for i in at if functions[i] in _EVALUATOR]
    if complete and evaluators and len(evaluators) == len(python):
        out: list[Frame] = []
        done = 0
        for i, group in zip(evaluators, python, strict=True):
            out.extend(native[j] for j in range(done, i) if functions[j] not in EVAL_FUNCTIONS)
            out.extend(group)
            done = i + 1
        out.extend(native[done:])
        return tuple(out)
    if not at:
        return (*flat, *native)
    first, last = at[0], at[-1]
    if not complete:
        return (*flat, *native[last + 1 :])
    return (*native[:first], *flat, *native[last + 1 :])
