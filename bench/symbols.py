"""How long symbol tables take to load: a synthetic table of 100,000 functions, and this machine's libc.

Run from the repository root (no root needed):

    .venv/bin/python bench/symbols.py [--rounds 7]

The claims it checks (once asserted by tests/test_symbols.py, where a busy machine made them fail):
  * 100,000 function symbols parse (SymbolTable.from_sections) in well under a second;
  * libc's own table plus the best table load_symbols() finds for it (.gnu_debugdata, debug files) load in
    under 5 seconds.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each case (default 7)")
    args = parser.parse_args()

    source = synthetic_symtab(100_000)
    libc = libc_path()
    cases = [
        (
            "100,000 synthetic symbols: SymbolTable.from_sections",
            1.0,
            lambda: SymbolTable.from_sections([source]),
        ),
        (f"{libc}: from_elf + load_symbols", 5.0, lambda: load_libc(libc)),
    ]
    print(f"{'case':<70} {'median s':>9} {'[min..max]':>17}  claim")
    for name, claim_s, action in cases:
        times = cpu_seconds(action, args.rounds)
        median = statistics.median(times)
        verdict = "met" if median < claim_s else "MISSED"
        print(f"{name:<70} {median:>9.3f} [{min(times):.3f}..{max(times):.3f}]  < {claim_s:g} s: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
