"""The syscall tracer: loads agent/bpf/syscalls.c with BCC, drains per-process syscall counts and latencies.

Every syscall of every process is counted per (tgid, syscall nr); one call in `latency_sample_every`
(chosen at random) is also timed into a log2 histogram. See DEFAULT_SAMPLE_EVERY for the cost per
syscall (bench/syscalls.py) and the choice of default. Kernel memory at the default table size: ~3 MB
plus 256 KB per possible CPU for counts, 8 MB for latencies (both double-buffered); with process events,
~2 MB for the processes told of and a 256 KB ring buffer.
"""

from __future__ import annotations

import ctypes as ct
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleetprof.agent.bpfmaps import CounterDeltas, DoubleBuffer, drain_map_bytes, drain_percpu_sums
from fleetprof.agent.kernel import BpfUnavailable, load_bcc
from fleetprof.agent.memory import release_startup_memory
from fleetprof.agent.model import ProcessEvent, SyscallDrain, SyscallStat
from fleetprof.agent.scope import CgroupScope
from fleetprof.agent.syscall_names import syscall_name

BPF_SOURCE = Path(__file__).parent / "bpf" / "syscalls.c"

# Mirrors of syscalls.c's constants (keep in sync with the .c file).
NBUCKETS = 40  # hist[i]: [2^i, 2^(i+1)) ns; hist[39] is everything from 2^39 ns (~9 minutes) up
STAT_NAMES = (
    "table_full",
    "latency_table_full",
    "storage_failed",
    "idle_skipped",
    "stale_start",
    "events_lost",
)
TIMING_OPEN, TIMING_EPOCH = 0, 1  # indices of the `timing` array

# Defaults: time 1 call in 16 during a 1 s timing window every 10 s (LatencyDuty); the measurements behind
# them are in bench/README.md ("Syscall tracing", bench/syscalls.py). Timing at any rate needs sys_exit
# attached, and the machinery of a second tracepoint costs as much as the first: that, not the sampling
# rate, is the price of latency. So sys_exit is attached only around timing windows (10% of the time plus a
# tail as long as the window, for calls in flight), and outside them the tracer costs what count-only
# costs. Within windows 1/16 keeps the BPF time at the count-only level; a (process, syscall) made 100
# times a second still gets ~190 timed calls in 5 minutes. Calls that block longer than the tail (1 s) are
# counted but not timed (stat stale_start): the latency histograms describe calls up to ~1 s well and
# longer ones not at all. Sampling draws bpf_get_prandom_u32(): a per-CPU counter measured no cheaper and
# would lock onto periodic call patterns.
DEFAULT_SAMPLE_EVERY = 16

# The drain's grace (bpfmaps.DoubleBuffer.GRACE_S) suffices here: syscall probes run with preemption off
# (the kernel's include/trace/bpf_probe.h), so in-flight programs finish in microseconds.


# Mirrors of syscalls.c's structs, as struct layouts (drains parse whole chunks with iter_unpack); their
# sizes are checked against the maps' own key and value types when the program loads.
KEY_LAYOUT = struct.Struct("=II")  # struct syscall_key: tgid, nr


LATENCY_LAYOUT = struct.Struct(f"=QQ{NBUCKETS}I")  # struct latency: timed, total_ns, hist[NBUCKETS]


@dataclass(frozen=True)
class LatencyDuty:
    """When calls may be timed: a `window_s` timing window every `period_s` (window >= period: always).

    sys_exit stays attached for `tail_s` after each window closes so that calls started near its end
    still return into a program; a timed call that blocks past the tail is dropped (STAT stale_start).
    """

    window_s: float = 1.0
    period_s: float = 10.0

    @property
    def always(self) -> bool:
        return self.window_s >= self.period_s

    @property
    def tail_s(self) -> float:
        return min(self.window_s, self.period_s - self.window_s)

    @property
    def fraction(self) -> float:
        """Of the time, how much lies in timing windows (the calls timed scale by the same factor)."""
        return 1.0 if self.always else self.window_s / self.period_s


@dataclass(frozen=True)
class SyscallConfig:
    latency_sample_every: int = DEFAULT_SAMPLE_EVERY  # time 1 call in N (a power of two); 0: count only
    latency_duty: LatencyDuty = field(default_factory=LatencyDuty)
    table_size: int = 16384  # (tgid, nr) keys per window, for counts and for latencies alike
    # "random" (default) or "counter": time every N-th call on each CPU. A counter measured no cheaper
    # and locks onto periodic call patterns; kept so that bench/syscalls.py can show the difference.
    sample_by: str = "random"
    known_processes: int = 32768  # processes the events speak of at once (LRU: more are told again)
    scope: CgroupScope | None = None  # --cgroup: only its tasks' calls are counted and timed


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


def parse_latency_duty(text: str) -> LatencyDuty:
    """Timing windows as written by a user: "1/10" -> 1 s every 10 s; "0.5/5"; "1/1" -> always."""
    win, sep, per = text.strip().partition("/")
    try:
        window, period = float(win), float(per)
    except ValueError:
        raise ValueError(
            f"latency duty {text!r}: use W/P, a W-second window every P seconds (e.g. 1/10)"
        ) from None
    if not sep or not (0 < window <= period) or period > 3600:
        raise ValueError(
            f"latency duty {text!r}: need 0 < W <= P <= 3600 seconds (e.g. 1/10, or 1/1 for always)"
        )
    return LatencyDuty(window_s=window, period_s=period)


def _validate(config: SyscallConfig) -> None:
    every = config.latency_sample_every
    if every < 0 or (every and every & (every - 1)):
        raise ValueError(f"latency_sample_every={every}: use 0 (count only) or a power of two")
    if config.table_size < 1:
        raise ValueError(f"table_size={config.table_size}: must be at least 1")
    duty = config.latency_duty
    if not (duty.window_s > 0 and duty.period_s > 0):
        raise ValueError(f"latency duty {duty}: window and period must be positive")
    if config.known_processes < 1:
        raise ValueError(f"known_processes={config.known_processes}: must be at least 1")
    if config.sample_by not in ("random", "counter"):
        raise ValueError(f"sample_by={config.sample_by!r}: use 'random' or 'counter'")


class SyscallTracer:
    """Owns the BPF programs; `drain()` returns one window; thread-safe against itself.

    `on_process_event(tgid, kind, ns)`, when given, hears of each process at its first syscall (EVENT_NEW),
    at its execs and at its exit (CLOCK_MONOTONIC ns of the event), from whichever thread polls
    `events_table` (agent/sampler.py's `poll_also` puts it on the process-event thread): the agent reads a
    syscall-only process's cgroup while it lives, so its calls keep their pod after it exits.
    """

    def __init__(
        self, config: SyscallConfig, on_process_event: Callable[[int, int, int], None] | None = None
    ):
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
            f"-DPROCESS_EVENTS={1 if on_process_event is not None else 0}",
            f"-DKNOWN_SIZE={config.known_processes}",
            f"-I{BPF_SOURCE.parent}",  # process_event.h, log2.h, scope.h
            *(config.scope.cflags() if config.scope else []),
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
        self._events_cb = on_process_event
        self.events_table = self._bpf[b"events"] if on_process_event is not None else None
        _check_layout(self._counts[0], 8)
        for table in self._latency:
            _check_layout(table, LATENCY_LAYOUT.size)
        # Exit before enter (and before any timing window opens): every start an enter records then has
        # an exit program to consume it. With a duty cycle, the exit program is attached once here to
        # prove it can be, then detached until the first window.
        self._attached: list[bytes] = []
        self.latency_duty = config.latency_duty if self.latency_sample_every else None
        self._cycle: _DutyCycle | None = None
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
        self._epoch = 0
        if self.latency_duty is not None:
            self._timing = self._bpf[b"timing"]
            if self.latency_duty.always:
                self.open_timing_window()
            else:
                self._detach(b"sys_exit")
                self._cycle = _DutyCycle(self, self.latency_duty)
                self._cycle.start()
        release_startup_memory()  # LLVM's heap garbage and its code pages, needed only to compile

    def on_event(self, _ctx: object, data: int, _size: int) -> None:
        """The ring-buffer callback for `events_table`."""
        ev = ct.cast(data, ct.POINTER(ProcessEvent)).contents
        assert self._events_cb is not None
        self._events_cb(ev.tgid, ev.kind, ev.ns)

    def _attach(self, tp: bytes, fn: bytes) -> None:
        self._bpf.attach_raw_tracepoint(tp=tp, fn_name=fn)
        self._attached.append(tp)

    def _detach(self, tp: bytes) -> None:
        self._bpf.detach_raw_tracepoint(tp=tp)
        self._attached.remove(tp)

    def open_timing_window(self) -> None:
        """Attach sys_exit, start a new epoch, let sys_enter start timing calls."""
        with self._lock:
            if self._closed:
                return
            if b"sys_exit" not in self._attached:
                self._attach(b"sys_exit", b"on_sys_exit")
            self._epoch = (self._epoch + 1) & 0xFFFFFFFF or 1
            self._timing[ct.c_int(TIMING_EPOCH)] = ct.c_uint32(self._epoch)
            self._timing[ct.c_int(TIMING_OPEN)] = ct.c_uint32(1)

    def close_timing_window(self) -> None:
        """Stop starting timings; calls in flight still return into sys_exit until `detach_exit()`."""
        with self._lock:
            if not self._closed:
                self._timing[ct.c_int(TIMING_OPEN)] = ct.c_uint32(0)

    def detach_exit(self) -> None:
        """Detach sys_exit (and its cost): a call still in flight keeps a start of an old epoch, which
        the next window's exit program drops as stale."""
        with self._lock:
            if not self._closed and b"sys_exit" in self._attached:
                self._detach(b"sys_exit")

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
            duty = self.latency_duty.fraction if self.latency_duty is not None else 0.0
            return SyscallDrain(
                start_ns,
                end_ns,
                _merge(counts, latency),
                self._stat_deltas(),
                self.latency_sample_every,
                duty,
            )

    def table_entries(self) -> int:
        """Keys held in the kernel's count and latency maps now, both sets (what one window holds)."""
        with self._lock:
            return sum(len(table) for table in (*self._counts, *self._latency))

    def table_tgids(self) -> set[int]:
        """The processes with keys in the kernel's count and latency maps now, both sets."""
        with self._lock:
            return {key.tgid for table in (*self._counts, *self._latency) for key in table.keys()}

    def close(self) -> None:
        if self._cycle is not None:
            self._cycle.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tp in reversed(self._attached):  # enter first, so no start is left without an exit
                self._bpf.detach_raw_tracepoint(tp=tp)
            self._attached.clear()
            self._bpf.cleanup()


class _DutyCycle(threading.Thread):
    """Opens a timing window every period and closes it `window_s` later; detaches sys_exit after the
    tail. Three wake-ups a period.

    The epoch makes a start left behind by a call that blocked past the tail harmless: the next window's
    exit program sees an old epoch and drops it instead of timing the whole gap (the call's true duration
    is unknown once its exit went unobserved).
    """

    def __init__(self, tracer: SyscallTracer, duty: LatencyDuty) -> None:
        super().__init__(name="syscall-latency-duty", daemon=True)
        self._tracer = tracer
        self._duty = duty
        self._stopping = threading.Event()

    def run(self) -> None:
        duty, tracer = self._duty, self._tracer
        next_open = time.monotonic()
        while not self._stopping.wait(max(0.0, next_open - time.monotonic())):
            next_open += duty.period_s
            tracer.open_timing_window()
            stopped = self._stopping.wait(duty.window_s)
            tracer.close_timing_window()
            if stopped or self._stopping.wait(duty.tail_s):
                break
            tracer.detach_exit()

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def _check_layout(table, value_size: int) -> None:  # BCC table
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
