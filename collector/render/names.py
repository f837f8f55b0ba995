"""Function names as people read them: C++ and Rust linker names demangled when a profile is rendered.

The store keeps each frame's name exactly as the agent sent it (FrameKey.function, which stays the
frame's identity); renderers show what a `Names` function makes of it: a Demangler's display_name (the
collector's: collector/main.py makes one Demangler, passes it to what renders and closes it at stop) or
as_stored. Only names that look mangled are tried, and one that does not demangle is shown as it came.

- Itanium C++ (`_Z…`): GCC's own demangler, abi::__cxa_demangle from libstdc++ (cxa_demangle.py). It
  runs in a helper process because its output can be exponential in its input: back-references to
  back-references make a 300-byte name demangle to gigabytes, a pod's own binary picks its symbol names,
  and the demangler takes no bound. The helper runs under an address-space limit and each name under a
  deadline; a helper that misses it is killed (the next name starts another) and the name stays raw.
- Rust's legacy mangling (`_ZN…17h<16 hex>E`) is Itanium-shaped: GCC reads it as `path::h0123…`, and
  the hash is dropped as rustc's demangler does. Where the `pyderust` package (bindings of rustc-demangle,
  rustc's own demangler) is installed, its text is used instead: it also decodes escapes such as `$LT$`.
- Rust v0 (`_R…`): pyderust only (rustc-demangle bounds its own output); raw without it.
"""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from fleetprof.collector.render import cxa_demangle

try:
    import pyderust
except ImportError:  # no wheel for this platform: Rust v0 names stay raw, legacy ones lose only escapes
    pyderust = None

log = logging.getLogger(__name__)

# What a mangled name is made of: Itanium names (with GCC's ".cold" / ".isra.0" clone suffixes and the "$"
# of Rust's legacy escapes) and Rust v0 names (with LLVM's ".llvm.123" suffix). Python frames
# ("slow_collate (<string>:5)"), "[unknown] (libx.so+0x12)" and kernel names never reach a demangler.
_MANGLED = re.compile(r"_Z[A-Za-z0-9_.$]+|_R[A-Za-z0-9_]+(?:\.[A-Za-z0-9_.$]+)?")
# A legacy Rust name as GCC prints it: the path ends in "::h" and 16 hex digits.
_RUST_HASH = re.compile(r"::h[0-9a-f]{16}$")
# A legacy Rust name with a suffix (LLVM's ".llvm.123"), which GCC accepts only after a function's
# parameters, and Rust names have none: GCC is asked about the name without it.
_RUST_SUFFIXED = re.compile(r"(_ZN.*17h[0-9a-f]{16}E)\.[a-z0-9_.]+")

Names = Callable[[str], str]  # a frame's raw name -> the name shown


def as_stored(raw: str) -> str:
    """Names shown as the agent sent them (renderers' default: tools and tests that demangle nothing)."""
    return raw


MAX_MANGLED_CHARS = 16_384  # longer names stay raw (real ones are under a few KB)
DEADLINE_S = 1.0  # for one name; a real one takes microseconds
START_DEADLINE_S = 10.0
RETRY_START_S = 60.0  # after the helper failed to start (not for a missing libstdc++: that is final)
CACHE_ENTRIES = 65_536
CACHE_CHARS = 32 << 20  # of names and their display text together
# The helper: this Python, isolated (-I -S: cxa_demangle.py needs the standard library only).
HELPER_COMMAND = (sys.executable, "-I", "-S", cxa_demangle.__file__)


class _Helper:
    """The process that runs cxa_demangle.py: one name per line in, "ok TEXT" or "no" per line out.
    Not thread-safe: its owner locks."""

    def __init__(self, command: Sequence[str]) -> None:
        self._command = list(command)
        self._proc: subprocess.Popen | None = None
        self._pending = b""
        self._unavailable = False  # libstdc++ cannot be loaded: said once, never tried again
        self._retry_at = 0.0

    def demangle(self, name: str) -> str | None:
        if self._unavailable or (self._proc is None and not self._start()):
            return None
        assert self._proc is not None and self._proc.stdin is not None
        try:
            os.write(self._proc.stdin.fileno(), name.encode("ascii") + b"\n")
            answer = self._read_line(time.monotonic() + DEADLINE_S)
        except OSError:  # the helper is gone (a broken pipe)
            answer = None
        if answer is None:
            log.warning(
                "demangling %.200s… took longer than %.1f s (or ended its helper): shown raw",
                name,
                DEADLINE_S,
            )
            self.close()
            return None
        return answer[3:] if answer.startswith("ok ") else None

    def _start(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._proc = subprocess.Popen(
                self._command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
            )
            hello = self._read_line(time.monotonic() + START_DEADLINE_S)
        except OSError as err:
            hello = str(err)
        if hello == "ready":
            return True
        self.close()
        if hello is not None and hello.startswith("unavailable "):
            self._unavailable = True
            log.warning("C++ names are shown raw: %s", hello.removeprefix("unavailable "))
        else:
            self._retry_at = time.monotonic() + RETRY_START_S
            log.warning(
                "C++ names are shown raw for %.0f s: the demangler's helper did not start (%s)",
                RETRY_START_S,
                hello or "no answer",
            )
        return False

    def _read_line(self, deadline: float) -> str | None:
        """The helper's next line, or None at its end of output or past the deadline."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        poller = select.poll()  # not select(): a busy collector's descriptors run past FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode("ascii", "replace")

    def close(self) -> None:
        proc, self._proc, self._pending = self._proc, None, b""
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _rust(raw: str) -> str | None:
    if pyderust is None:
        return None
    try:
        return pyderust.demangle(raw)
    except Exception:  # pyderust.DemangleError (a ValueError): not a Rust name, or past its limits
        return None
    except BaseException as err:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        if type(err).__name__ != "PanicException":
            raise
        return None


class Demangler:
    """display_name() with a bounded cache (least recently used out first); thread-safe. It starts its
    helper process at the first mangled C++ name; close() stops it."""

    def __init__(
        self,
        cache_entries: int = CACHE_ENTRIES,
        cache_chars: int = CACHE_CHARS,
        helper_command: Sequence[str] = HELPER_COMMAND,
    ) -> None:
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._chars = 0
        self._max_entries = cache_entries
        self._max_chars = cache_chars
        self._lock = threading.Lock()  # the cache
        self._helper = _Helper(helper_command)
        self._helper_lock = threading.Lock()
        self._failed = False

    def display_name(self, raw: str) -> str:
        """The name to show for `raw`: demangled where it is a C++ or Rust linker name that demangles,
        otherwise `raw` itself. Never raises."""
        if not raw.startswith(("_Z", "_R")) or len(raw) > MAX_MANGLED_CHARS or not _MANGLED.fullmatch(raw):
            return raw
        with self._lock:
            text = self._cache.get(raw)
            if text is not None:
                self._cache.move_to_end(raw)
                return text
        text = self._demangle(raw) or raw
        with self._lock:
            if raw not in self._cache:
                self._cache[raw] = text
                self._chars += len(raw) + len(text)
                while len(self._cache) > self._max_entries or self._chars > self._max_chars:
                    old, old_text = self._cache.popitem(last=False)
                    self._chars -= len(old) + len(old_text)
        return text

    def _demangle(self, raw: str) -> str | None:
        try:
            if raw.startswith("_R"):
                return _rust(raw)
            with self._helper_lock:
                text = self._helper.demangle(raw)
                suffixed = _RUST_SUFFIXED.fullmatch(raw) if text is None else None
                if suffixed:
                    text = self._helper.demangle(suffixed[1])
            if text is not None and _RUST_HASH.search(text):
                return _rust(raw) or _RUST_HASH.sub("", text)
            return text
        except Exception:  # a bug of ours must not cost a profile its rendering
            if not self._failed:
                self._failed = True
                log.exception("demangling %.200s failed: names that fail so are shown raw", raw)
            return None

    def close(self) -> None:
        """Stop the helper process (a later name starts another)."""
        with self._helper_lock:
            self._helper.close()
