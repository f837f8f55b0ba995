"""The raw addresses behind the frames named after their file (resolver.py --unsymbolized=module): samples
by file offset, per file, kept on the agent and served at its /unsymbolized.

A stripped file's frames ship as one frame, its name, so the binary ranks as a whole; the wire carries
names, not addresses. What the merge hides stays here: for each run of such frames in a sampled stack,
the innermost address (where the file's code was: running, when the run is the stack's leaf, "self"; or
calling out of the file). An on-call engineer reads the hottest offsets and looks them up in the file's
debug file by hand (docs/symbols.md says how), without restarting the agent with --unsymbolized=address.

Bounded: at most MAX_FILES files and MAX_ADDRESSES per file; samples past either are counted, not kept.
Counts are cumulative since the agent started (the resolver adds, the HTTP thread reads: one lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_FILES = 256
MAX_ADDRESSES = 4096  # per file: a hot loop is a few dozen; a file's whole code is sampled thinly
SHOWN_ADDRESSES = 50  # per file, hottest first, in snapshot()

# One run of a file's unsymbolized frames in one stack: (file name, file offset, whether the run is the
# innermost user frame: the file's own code was running).
Run = tuple[str, int, bool]


@dataclass
class _File:
    samples: int = 0
    self_samples: int = 0
    other: int = 0  # samples at addresses past MAX_ADDRESSES
    addresses: dict[int, list[int]] = field(default_factory=dict)  # offset -> [samples, self samples]


class UnsymbolizedAddresses:
    def __init__(
        self, max_files: int = MAX_FILES, max_addresses: int = MAX_ADDRESSES, clock=time.time
    ) -> None:
        self._max_files = max_files
        self._max_addresses = max_addresses
        self._since = clock()
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}
        self._dropped = 0  # samples of files past MAX_FILES

    def add(self, runs: Sequence[Run], samples: int) -> None:
        """Count `samples` of one stack at each of its runs."""
        with self._lock:
            for module, offset, is_self in runs:
                f = self._files.get(module)
                if f is None:
                    if len(self._files) >= self._max_files:
                        self._dropped += samples
                        continue
                    f = self._files[module] = _File()
                f.samples += samples
                f.self_samples += samples if is_self else 0
                counts = f.addresses.get(offset)
                if counts is None:
                    if len(f.addresses) >= self._max_addresses:
                        f.other += samples
                        continue
                    counts = f.addresses[offset] = [0, 0]
                counts[0] += samples
                counts[1] += samples if is_self else 0

    def snapshot(self, shown: int = SHOWN_ADDRESSES) -> dict:
        """Plain data for JSON: files by samples, each with its `shown` hottest offsets."""
        with self._lock:
            files = [
                {
                    "file": module,
                    "samples": f.samples,
                    "self_samples": f.self_samples,
                    "addresses": [
                        {"offset": f"0x{offset:x}", "samples": n, "self_samples": s}
                        for offset, (n, s) in sorted(f.addresses.items(), key=lambda kv: (-kv[1][0], kv[0]))[
                            :shown
                        ]
                    ],
                    "addresses_not_shown": max(0, len(f.addresses) - shown),
                    "samples_past_the_address_cap": f.other,
                }
                for module, f in sorted(self._files.items(), key=lambda kv: (-kv[1].samples, kv[0]))
            ]
            return {"since_unix": self._since, "files": files, "samples_past_the_file_cap": self._dropped}
