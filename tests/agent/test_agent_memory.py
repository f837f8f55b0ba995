"""Startup memory release: only clean compiler-library mappings are dropped, and the agent really does it."""

from __future__ import annotations

from fleetprof.agent.memory import clean_compiler_mappings

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fe:01 123 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Size:               1024 kB
Rss:                 512 kB
Shared_Dirty:          0 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000100000-7f0003000000 r-xp 00100000 fe:01 123 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:               40000 kB
Shared_Dirty:          0 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0003000000-7f0003100000 r--p 03000000 fe:01 123 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                1024 kB
Shared_Dirty:          0 kB
Private_Dirty:      1024 kB
Anonymous:          1024 kB
7f0004000000-7f0004100000 r-xp 00000000 fe:01 456 /usr/lib/llvm-14/lib/libclang-cpp.so.14
Rss:                 300 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0005000000-7f0005100000 r-xp 00000000 fe:01 789 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 900 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0006000000-7f0006100000 rw-p 00000000 00:00 0
Rss:                 100 kB
Private_Dirty:       100 kB
Anonymous:           100 kB
"""


def test_only_clean_compiler_mappings_are_chosen() -> None:
    chosen = clean_compiler_mappings(SMAPS)
    assert [(hex(s), hex(e)) for s, e, _ in chosen] == [
        ("0x7f0000000000", "0x7f0000100000"),
        ("0x7f0000100000", "0x7f0003000000"),
        ("0x7f0004000000", "0x7f0004100000"),
    ]
    # The relocated (dirty) LLVM data and libc are left alone.
    assert all("libc.so" not in p for _, _, p in chosen)
