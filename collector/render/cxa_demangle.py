"""GCC's C++ demangler, abi::__cxa_demangle from libstdc++, through ctypes; run as a script, a helper
process that demangles one name per line (collector/render/names.py starts it and says why).

Imports the standard library only: the helper runs as `python -I -S cxa_demangle.py`.

Protocol, one line each way, ASCII: in, a mangled name; out, "ok TEXT" or "no" (not demangled: not a
valid name, out of memory, or longer than MAX_OUTPUT_CHARS). At start the helper says "ready", or
"unavailable REASON" and exits.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from collections.abc import Callable

# As ingest's MAX_SYMBOL_CHARS: a longer demangled name is not shown (the raw one is).
MAX_OUTPUT_CHARS = 65_535
# The helper's address space. A crafted name asks for more than any real one (a few KB of text); with the
# limit, the demangler's realloc fails and it answers "out of memory" instead of taking the machine's.
ADDRESS_SPACE_BYTES = 512 << 20


def load() -> Callable[[bytes], bytes | None]:
    """A function from a mangled name to its demangled text (None when it does not demangle).

    Raises OSError when libstdc++.so.6 cannot be loaded and AttributeError when it lacks the function.
    """
    cxx = ctypes.CDLL("libstdc++.so.6")
    libc = ctypes.CDLL(None)  # the running process's libc, so free() matches the malloc that allocated
    cxa_demangle = cxx["__cxa_demangle"]
    # char *__cxa_demangle(const char *mangled, char *output_buffer, size_t *length, int *status)
    cxa_demangle.restype = ctypes.c_void_p
    cxa_demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    free = libc["free"]
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    strnlen = libc["strnlen"]
    strnlen.restype = ctypes.c_size_t
    strnlen.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def demangle(name: bytes) -> bytes | None:
        status = ctypes.c_int(-3)
        text = cxa_demangle(name, None, None, ctypes.byref(status))
        if not text:
            return None
        try:
            if status.value != 0:  # -1 out of memory, -2 not a valid name, -3 invalid argument
                return None
            # Measured before it is copied: a huge answer is refused without doubling it in memory.
            length = strnlen(text, MAX_OUTPUT_CHARS + 1)
            return ctypes.string_at(text, length) if length <= MAX_OUTPUT_CHARS else None
        finally:
            free(text)

    return demangle


def serve(lines_in, out) -> None:  # binary streams
    """The helper's loop: answer each name on `lines_in` on `out`, until end of input."""
    try:
        demangle = load()
    except (OSError, AttributeError) as err:
        out.write(
            f"unavailable libstdc++'s __cxa_demangle cannot be loaded: {err}\n".encode("ascii", "replace")
        )
        out.flush()
        return
    out.write(b"ready\n")
    out.flush()
    for line in lines_in:
        try:
            text = demangle(line.rstrip(b"\n"))
        except MemoryError:  # the copy of a long answer, past the address-space limit
            text = None
        out.write(b"ok " + text + b"\n" if text is not None else b"no\n")
        out.flush()


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    serve(sys.stdin.buffer, sys.stdout.buffer)
