"""The syscall tracer: loads agent/bpf/syscalls.c with BCC, drains per-process syscall counts and latencies.

Every syscall of every process is counted per (tgid, syscall nr); one call in `latency_sample_every`
(chosen at random) is also timed into a log2 histogram. See DEFAULT_SAMPLE_EVERY for the cost per
syscall (bench/syscalls.py) and the choice of default. Kernel memory at the default table size: ~3 MB
plus 256 KB per possible CPU for counts, 8 MB for latencies (both double-buffered).
"""

from __future__ import annotations

import ctypes as ct
import struct
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from agent.bpfmaps import CounterDeltas, DoubleBuffer, drain_map_bytes, drain_percpu_sums
from agent.kernel import BpfUnavailable, load_bcc
from agent.memory import release_startup_memory

BPF_SOURCE = Path(__file__).parent / "bpf" / "syscalls.c"

# Mirrors of syscalls.c's constants (keep in sync with the .c file).
NBUCKETS = 40  # hist[i]: [2^i, 2^(i+1)) ns; hist[39] is everything from 2^39 ns (~9 minutes) up
STAT_NAMES = ("table_full", "latency_table_full", "storage_failed", "idle_skipped")

# Default timing fraction: 1 call in 16, from bench/syscalls.py --quick on this machine kind (2 vCPUs,
# kernel 6.18; median ns added per syscall to a getppid storm, untraced 182 ns; "BPF" is the programs' own
# run time from the kernel's accounting, the rest is the tracepoint machinery):
#
#   empty program on raw sys_enter        +139        empty programs on sys_enter + sys_exit   +264
#   count only (0)                        +173  BPF 31  bcc syscount-bpfcc (counts)            +196
#   timing 1/64                           +330  BPF 73  timing 1/16 by a per-CPU counter       +335
#   timing 1/16                           +356  BPF 53  bcc syscount-bpfcc -L (latency)        +562
#   timing 1/1                            +489  BPF 227
#
# Timing at any rate attaches sys_exit, whose machinery costs about as much as sys_enter's (+125 ns
# here; both drift by 2x with the host's load): that, not the sampling rate, is the price of latency,
# and "0" (count only) halves the cost where it matters. Between 1/64 and 1/16 the difference is a
# timed call's extra ~80-140 ns (BPF accounting / A/B) spread over 64 or 16 calls: ~4-7 ns a syscall,
# inside the noise of these runs, while 1/16 gives 4x the samples: a (process, syscall) called 1,000
# times in a 10 s window gets ~60 timed calls, enough for a p50/p90, where 1/64 gets ~15. 1/1 adds
# ~130 ns more per syscall: for debugging, not always-on. Sampling draws bpf_get_prandom_u32(): a
# per-CPU counter measured no cheaper (within noise) and would lock onto periodic call patterns (at
# 1/16, a loop of 16 syscalls on one CPU would time the same one every time).
DEFAULT_SAMPLE_EVERY = 16

# The drain's grace (bpfmaps.DoubleBuffer.GRACE_S) suffices here: syscall probes run with preemption off
# (the kernel's include/trace/bpf_probe.h), so in-flight programs finish in microseconds.


# Mirrors of syscalls.c's structs, as struct layouts (drains parse whole chunks with iter_unpack); their
# sizes are checked against the maps' own key and value types when the program loads.
KEY_LAYOUT = struct.Struct("=II")  # struct syscall_key: tgid, nr
LATENCY_LAYOUT = struct.Struct(f"=QQ{NBUCKETS}I")  # struct latency: timed, total_ns, hist[NBUCKETS]


@dataclass(frozen=True)
class SyscallStat:
    """One process's calls of one syscall in one window.

    `count` is every call that entered in the window; `timed`, `timed_ns` and `hist` cover the sampled
    calls that returned in it (a call blocked across a drain is counted in one window and timed in a
    later one, so `timed` may exceed `count` for a key in a window).
    """

    tgid: int
    nr: int
    name: str
    count: int
    timed: int
    timed_ns: int
    hist: tuple[int, ...]  # hist[i]: timed calls in [2^i, 2^(i+1)) ns; the last bucket is open-ended


@dataclass
class SyscallDrain:
    """One window: its stats and the deltas of the tracer's counters (see STAT_NAMES)."""

    start_ns: int
    end_ns: int
    stats: list[SyscallStat]
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SyscallConfig:
    latency_sample_every: int = DEFAULT_SAMPLE_EVERY  # time 1 call in N (a power of two); 0: count only
    table_size: int = 16384  # (tgid, nr) keys per window, for counts and for latencies alike
    # "random" (default) or "counter": time every N-th call on each CPU. A counter measured no cheaper
    # and locks onto periodic call patterns; kept so that bench/syscalls.py can show the difference.
    sample_by: str = "random"


def parse_sample_fraction(text: str) -> int:
    """Latency sampling as written by a user: "1/16" -> 16, "1" or "1/1" -> 1, "0" -> 0 (count only).

    N in 1/N must be a power of two (the BPF program masks a random number with N - 1).
    """
    raw = text.strip()
    if raw == "0":
        return 0
    num, sep, den = raw.partition("/")
    try:
        numerator = int(num)
        every = int(den) if sep else 1
    except ValueError:
        raise ValueError(
            f"latency sampling {text!r} is not a fraction: use 1/N with N a power of two, 1, or 0"
        ) from None
    if numerator != 1 or every < 1:
        raise ValueError(f"latency sampling {text!r} must be 1/N (N >= 1), 1, or 0 for count only")
    if every & (every - 1):
        raise ValueError(f"latency sampling {text!r}: N must be a power of two (1, 2, 4, ... 1024, ...)")
    return every


@cache
def syscall_name(nr: int) -> str:
    """The syscall's name from BCC's table for this architecture; "syscall_<nr>" when it has none."""
    try:
        from bcc.syscall import syscalls  # x86-64 built in; other arches need `ausyscall` on PATH
    except Exception:  # bcc.syscall raises bare Exception when it has no table for this arch
        return f"syscall_{nr}"
    name = syscalls.get(nr)
    return name.decode() if name else f"syscall_{nr}"


def _validate(config: SyscallConfig) -> None:
    every = config.latency_sample_every
    if every < 0 or (every and every & (every - 1)):
        raise ValueError(f"latency_sample_every={every}: use 0 (count only) or a power of two")
    if config.table_size < 1:
        raise ValueError(f"table_size={config.table_size}: must be at least 1")
    if config.sample_by not in ("random", "counter"):
        raise ValueError(f"sample_by={config.sample_by!r}: use 'random' or 'counter'")


class SyscallTracer:
    """Owns the BPF programs; `drain()` returns one window; thread-safe against itself."""

    def __init__(self, config: SyscallConfig):
        _validate(config)
        bcc = load_bcc()
        self._config = config
        self.latency_sample_every = config.latency_sample_every
        self._lock = threading.Lock()
        self._closed = False
        # (No BPF.support_raw_tracepoint(): it loads BCC's kallsyms cache, +26 MB RSS for good. An attach
        # failure below says the same.)
        if self.latency_sample_every and not Path("/sys/kernel/btf/vmlinux").exists():
            raise BpfUnavailable(
                "syscall tracepoints are unavailable: timing needs task storage, which needs kernel BTF "
                "(/sys/kernel/btf/vmlinux; Linux 5.11+ with CONFIG_DEBUG_INFO_BTF) — or set sampling to 0"
            )
        cflags = [
            f"-DTABLE_SIZE={config.table_size}",
            f"-DNBUCKETS={NBUCKETS}",
            f"-DSAMPLE_EVERY={config.latency_sample_every}",
            f"-DSAMPLE_BY_COUNTER={1 if config.sample_by == 'counter' else 0}",
        ]
        try:
            self._bpf = bcc.BPF(src_file=str(BPF_SOURCE).encode(), cflags=cflags)
        except Exception as exc:  # BCC raises bare Exception for compile, map and verifier failures
            hint = " (timing needs task storage: Linux 5.11+)" if self.latency_sample_every else ""
            raise BpfUnavailable(
                f"syscall tracepoints are unavailable: the BPF program did not compile or load{hint}: {exc}"
            ) from exc
        self._buffers = DoubleBuffer(self._bpf[b"control"])
        self._counts = (self._bpf[b"counts0"], self._bpf[b"counts1"])
        self._latency = (self._bpf[b"latency0"], self._bpf[b"latency1"]) if self.latency_sample_every else ()
        self._stat_deltas = CounterDeltas(self._bpf[b"stats"], STAT_NAMES)
        _check_layout(self._counts[0], 8)
        for table in self._latency:
            _check_layout(table, LATENCY_LAYOUT.size)
        # Exit before enter: every start an enter records then has an exit program to consume it.
        self._attached: list[bytes] = []
        tp = b"sys_exit"
        try:
            if self.latency_sample_every:
                self._attach(tp, b"on_sys_exit")
            tp = b"sys_enter"
            self._attach(tp, b"on_sys_enter")
        except Exception as exc:
            self._bpf.cleanup()
            raise BpfUnavailable(
                f"syscall tracepoints are unavailable: cannot attach to raw tracepoint {tp.decode()} "
                f"(raw tracepoints need Linux 4.17+): {exc}"
            ) from exc
        release_startup_memory()  # LLVM's heap garbage and its code pages, needed only to compile

    def _attach(self, tp: bytes, fn: bytes) -> None:
        self._bpf.attach_raw_tracepoint(tp=tp, fn_name=fn)
        self._attached.append(tp)

    def drain(self) -> SyscallDrain:
        """Flip to the other map set, then read and empty the one that was being written."""
        with self._lock:
            idle, start_ns, end_ns = self._buffers.flip()
            counts = {key: v[0] for key, v in drain_percpu_sums(self._counts[idle], KEY_LAYOUT, 1)}
            latency = {}
            if self._latency:
                keys, values = drain_map_bytes(self._latency[idle], KEY_LAYOUT.size, LATENCY_LAYOUT.size)
                latency = dict(
                    zip(KEY_LAYOUT.iter_unpack(keys), LATENCY_LAYOUT.iter_unpack(values), strict=True)
                )
            return SyscallDrain(start_ns, end_ns, _merge(counts, latency), self._stat_deltas())

    def table_entries(self) -> int:
        """Keys held in the kernel's count and latency maps now, both sets (what one window holds)."""
        with self._lock:
            return sum(len(table) for table in (*self._counts, *self._latency))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tp in reversed(self._attached):  # enter first, so no start is left without an exit
                self._bpf.detach_raw_tracepoint(tp=tp)
            self._attached.clear()
            self._bpf.cleanup()


def _check_layout(table, value_size: int) -> None:  # noqa: ANN001 - BCC table
    """The map's key and (per-CPU: per CPU) value sizes, as BCC read them from the C file, match ours."""
    leaf = getattr(table, "sLeaf", table.Leaf)  # BCC's per-CPU tables keep the one-CPU type in sLeaf
    if ct.sizeof(table.Key) != KEY_LAYOUT.size or ct.sizeof(leaf) != value_size:
        raise RuntimeError(f"agent/syscalls.py's struct layouts are out of sync with {BPF_SOURCE.name}")


def _merge(counts: dict[tuple[int, int], int], latency: dict[tuple[int, int], tuple]) -> list[SyscallStat]:
    """One SyscallStat per key of either map; `latency` values are LATENCY_LAYOUT tuples."""
    empty = (0,) * NBUCKETS
    out = []
    for key in sorted(counts.keys() | latency.keys()):
        lat = latency.get(key)
        tgid, nr = key
        out.append(
            SyscallStat(
                tgid=tgid,
                nr=nr,
                name=syscall_name(nr),
                count=counts.get(key, 0),
                timed=lat[0] if lat else 0,
                timed_ns=lat[1] if lat else 0,
                hist=lat[2:] if lat else empty,
            )
        )
    return out
