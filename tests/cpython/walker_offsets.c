/* Prints, one "name value" a line, the offsets agent/python/offsets.py tables for CPython 3.11 and 3.12, as
 * this compiler lays the structs out: built against a CPython's internal headers (Py_BUILD_CORE) with
 * gcc for x86-64 and aarch64-linux-gnu-gcc for arm64 (tests/agent/test_python_offsets.py), so each architecture's
 * own ABI (its glibc's pthread types included) decides them. */
#define Py_BUILD_CORE 1
#include "Python.h"
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#include "internal/pycore_frame.h"
#include <stddef.h>
#include <stdio.h>

#define P(name, expr) printf("%s %zu\n", name, (size_t)(expr))

int main(void) {
    P("interp_head", offsetof(_PyRuntimeState, interpreters.head));
    P("threads_head", offsetof(PyInterpreterState, threads.head));
    P("tstate_next", offsetof(PyThreadState, next));
    P("tstate_native_tid", offsetof(PyThreadState, native_thread_id));
    P("tstate_frame", offsetof(PyThreadState, cframe));
    P("cframe_frame", offsetof(_PyCFrame, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
    P("frame_previous", offsetof(_PyInterpreterFrame, previous));
    P("frame_instr", offsetof(_PyInterpreterFrame, prev_instr));
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#if PY_MINOR_VERSION == 11
    P("frame_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
    P("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
    P("ascii_data", sizeof(PyASCIIObject));
    P("compact_data", sizeof(PyCompactUnicodeObject));
    return 0;
}
