"""How long symbol tables take to load: a synthetic table of 100,000 functions, this machine's libc, and any
ELF file named with --file (e.g. a 200 MB libLLVM).

Run from the repository root (no root needed):

    .venv/bin/python bench/symbols.py [--rounds 7] [--file PATH ...]

The claims it checks (once asserted by tests/agent/test_symbols.py, where a busy machine made them fail):
  * 100,000 function symbols parse (SymbolTable.from_sections) in well under a second;
  * libc's own table plus the best table load_symbols() finds for it (.gnu_debugdata, debug files) load in
    under 5 seconds (the same claim for each --file);
  * loading a file's table costs memory in proportion to its symbol sections, not to the file: the "peak
    MB" column is the peak RSS of a fresh child process that loads the file once, minus that of a child
    that only imports the reader (the file is read with pread, section by section, never mapped whole).
Each is timed `--rounds` times on this process's CPU clock (time.process_time, so other load on the
machine does not count against it); the table quotes the median and [min..max], and says whether the
median is within the claim.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fleetprof.agent.symbols.elf import ElfFile, SymbolTable, load_symbols  # noqa: E402 - bench scripts run as files
from fleetprof.agent.symbols.maps import read_maps  # noqa: E402

STB_GLOBAL, STT_FUNC = 1, 2


def synthetic_symtab(count: int) -> tuple[bytes, bytes]:
    """(.symtab, .strtab) of `count` sized global functions 0x20 apart."""
    strtab = bytearray(b"\0")
    syms = [struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0)]
    for i in range(count):
        syms.append(
            struct.pack("<IBBHQQ", len(strtab), (STB_GLOBAL << 4) | STT_FUNC, 0, 1, 0x400000 + 0x20 * i, 0x18)
        )
        strtab += f"function_{i}".encode() + b"\0"
    return b"".join(syms), bytes(strtab)


def libc_path() -> str:
    for m in read_maps(os.getpid()):
        if re.search(r"/libc[.-][^/]*so", m.file_path):
            return m.file_path
    raise SystemExit("no libc mapped into this process")


def cpu_seconds(action: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.process_time()
        action()
        out.append(time.process_time() - t0)
    return out


def load_libc(path: str) -> None:
    with ElfFile(path) as elf:
        SymbolTable.from_elf(elf)
        load_symbols(elf)


# VmHWM, not ru_maxrss: the kernel carries the spawning process's peak over into a child's ru_maxrss
# (subprocess spawns with vfork, so the child's first address space is the parent's), VmHWM is its own.
_CHILD = """
import re, sys
sys.path.insert(0, sys.argv[1])
from fleetprof.agent.symbols.elf import ElfFile, SymbolTable, load_symbols
if len(sys.argv) > 2:
    with ElfFile(sys.argv[2]) as elf:
        SymbolTable.from_elf(elf)
        load_symbols(elf)
print(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
"""


def child_peak_kib(path: str | None) -> int:
    """Peak RSS (KiB) of a fresh interpreter that imports the reader and, given a path, loads its symbols."""
    root = str(Path(__file__).resolve().parent.parent)
    argv = [sys.executable, "-c", _CHILD, root] + ([path] if path else [])
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each case (default 7)")
    parser.add_argument(
        "--file", action="append", default=[], metavar="PATH", help="also time this ELF file (repeatable)"
    )
    args = parser.parse_args()

    source = synthetic_symtab(100_000)
    libc = libc_path()
    cases: list[tuple[str, float, Callable[[], object], str | None]] = [
        (
            "100,000 synthetic symbols: SymbolTable.from_sections",
            1.0,
            lambda: SymbolTable.from_sections([source]),
            None,
        ),
    ]
    for path in [libc, *args.file]:
        cases.append((f"{path}: from_elf + load_symbols", 5.0, lambda p=path: load_libc(p), path))
    base_kib = child_peak_kib(None)
    print(f"{'case':<90} {'median s':>9} {'[min..max]':>17}  {'claim':<12} {'peak MB':>8}")
    for name, claim_s, action, path in cases:
        times = cpu_seconds(action, args.rounds)
        median = statistics.median(times)
        verdict = "met" if median < claim_s else "MISSED"
        peak = f"{(child_peak_kib(path) - base_kib) / 1024:8.1f}" if path else f"{'':8}"
        spread = f"[{min(times):.3f}..{max(times):.3f}]"
        print(f"{name:<90} {median:>9.3f} {spread:>17}  < {claim_s:g} s: {verdict:<6} {peak}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
