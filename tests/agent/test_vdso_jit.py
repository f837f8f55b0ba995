"""Code that runs outside any file: the vDSO (walked by its own table, named by its own symbols) and JIT-like
anonymous executable memory (stepped by frame pointer where the chain leads back into mapped code), with
real eBPF, against workloads built without frame pointers (tests/workloads/vdso_clock.c). In process here,
as the agent wires the stages; tests/e2e/test_vdso_e2e.py runs the same through a real agent and collector."""

from __future__ import annotations

import collections
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetprof.agent.model import EVENT_UNMAPPED, CgroupIdentity, Mapping, ProcessInfo, ResolvedSample
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.python.unwinder import PythonStacks
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.symbols.maps import find
from fleetprof.agent.symbols.symbolizer import Symbolizer
from fleetprof.agent.symbols.vdso import read_own_vdso
from fleetprof.agent.unwind.kernel_maps import FILE_JIT, MAP, PROC
from fleetprof.agent.unwind.unwinder import Unwinder
from tests.conftest import maps_libc, own_scope, require_bpf, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

FREQUENCY = 499
ENTRY = ("_start", "__libc_start_main", "__libc_start_call_main")
WARM_S = 1.5  # the workload's plain loop before the part measured: its tables are built meanwhile
CPU_S = 2.0  # CPU time of the part measured: ~1,000 samples at 499 Hz on an idle machine
# Samples of the part measured that the shares below need: at a true 0.99 over 200, sigma = 0.007, and 0.95 is
# 5.7 sigma below. The count itself is not asserted against CPU_S x 499 Hz: in a fresh-clone run beside the
# other BPF tests it was 409 of ~1,000 once, every one of them whole, with the node-wide walk count as short.
# cpu-clock's timer fires on wall time and forwards past the periods it missed (likeliest: a vCPU the host
# held back), which is the kernel's and the host's, not the walk's.
ENOUGH = 200


@dataclass
class Run:
    rows: list[ResolvedSample]
    stats: collections.Counter
    walks: collections.Counter = field(default_factory=collections.Counter)  # raw user stacks, leaf first
    mappings: tuple[Mapping, ...] = ()  # the process's executable mappings, as last described

    def measured(self) -> collections.Counter:
        """stacks() of the part measured: every sample but the warm-up's (whatever its walk found)."""
        return collections.Counter({st: n for st, n in self.stacks().items() if "warm_up" not in st})

    def stacks(self) -> collections.Counter:
        """Root-first user frame names (versions cut: `__libc_start_main@@GLIBC_2.34`) -> samples."""
        out: collections.Counter = collections.Counter()
        for r in self.rows:
            out[tuple(f.function.split("@", 1)[0] for f in r.frames[: r.kernel_start])] += r.count
        return out

    def made_up(self) -> dict[str, int]:
        """Walks, as BPF stored them, that hold a return address outside every executable mapping of the
        process (the leaf is where the CPU was), in hex with the count of samples: empty when none."""
        return {
            " ".join(f"{a:x}" for a in addrs): n
            for addrs, n in self.walks.items()
            if any(find(self.mappings, a - 1) is None for a in addrs[1:])
        }


class Pipeline:
    """Sampler, process table, table unwinder, symbolizer and resolver, wired as the agent wires them (the
    node's vDSO image given to the unwinder and the symbolizer)."""

    def __init__(self) -> None:
        require_bpf()
        self.vdso = read_own_vdso()
        assert self.vdso is not None, "this machine's vDSO could not be read"
        self.sampler = CpuSampler(
            SamplerConfig(frequency_hz=FREQUENCY, interval_s=1.0, off_cpu=False, scope=own_scope()),
            on_process_event=self._event,
        )
        maps = self.sampler.unwind_maps()
        assert maps is not None
        self.unwinder = Unwinder(maps, vdso=self.vdso)
        self.python = PythonStacks(enabled=True)
        self.python.attach(self.sampler)
        self.table = ProcessTable(on_capture=self._captured, on_forget=self.python.forget)
        symbolizer = Symbolizer(vdso=self.vdso)
        symbolizer.load_kernel_symbols()
        self.resolver = Resolver(self.table, symbolizer, python=self.python)
        self._stop = threading.Event()
        self._events = threading.Thread(target=self._poll_events, daemon=True)
        self._events.start()

    def _captured(self, info) -> None:
        self.python.on_capture(info)
        self.unwinder.describe(info)

    def _event(self, pid: int, kind: int) -> None:
        if kind == EVENT_UNMAPPED and self.table.remap_if_changed(pid):  # as the agent: a JIT's new page
            self.unwinder.unmapped_handled(pid)

    def _poll_events(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.sampler.events_fd(), selectors.EVENT_READ)
            while not self._stop.is_set():
                selector.select(0.1)
                self.sampler.consume_events()

    def run(self, argv: list[str]) -> Run:
        """Start the workload, describe it and build its tables (as an always-on agent has them by the time
        its warm-up ends), and drain until it exits."""
        proc = subprocess.Popen(argv)
        wait_until(lambda: maps_libc(proc.pid), 30, f"pid {proc.pid} to map libc", every=0.005)
        self.table.refresh(proc.pid)
        self.unwinder.build_pending()
        run = Run([], collections.Counter())
        self.sampler.drain()  # walks before the description (the kernel's frame-pointer walk) left out
        while proc.poll() is None:
            time.sleep(0.5)
            self._collect(run, proc.pid)
        self._collect(run, proc.pid)
        assert proc.returncode == 0, argv
        info = self.table.get(proc.pid)
        assert info is not None
        run.mappings = info.mappings
        return run

    def _collect(self, run: Run, pid: int) -> None:
        drain = self.sampler.drain()
        for s in drain.samples:
            if s.tgid == pid and s.user_stack in drain.stacks:
                run.walks[drain.stacks[s.user_stack]] += s.count
        window = self.resolver.resolve(drain)
        run.rows += [r for r in window.samples if r.process.pid == pid]
        run.stats.update(window.stats)
        for flagged in self.unwinder.take_unmapped():  # as the agent's drain does: code mapped since
            self.table.remap_if_changed(flagged)

    def close(self) -> None:
        self._stop.set()
        self._events.join()
        self.unwinder.stop()
        self.sampler.close()


@pytest.fixture(scope="module")
def pipeline() -> Iterator[Pipeline]:
    p = Pipeline()
    yield p
    p.close()


def through(stacks: collections.Counter, name: str) -> int:
    return sum(n for st, n in stacks.items() if name in st)


def test_vdso_frames_are_walked_by_their_table_and_named(
    pipeline: Pipeline, no_fp_bin: Callable[[str], Path]
) -> None:
    """clock_gettime(CLOCK_THREAD_CPUTIME_ID): glibc enters the vDSO, which makes the syscall. The walk goes
    from `__vdso_clock_gettime` through glibc's clock_gettime to clock_burn, main and the entry point."""
    run = pipeline.run([str(no_fp_bin("vdso_clock")), "clock", str(WARM_S), str(CPU_S)])
    stacks = run.measured()
    total = sum(stacks.values())
    burn = through(stacks, "clock_burn")
    in_vdso = sum(n for st, n in stacks.items() if st and st[-1] == "__vdso_clock_gettime")
    whole = sum(
        n
        for st, n in stacks.items()
        if st[: len(ENTRY)] == ENTRY and "clock_burn" in st and st[-1] == "__vdso_clock_gettime"
    )
    unnamed = sum(n for st, n in stacks.items() if any(s.startswith("[unknown] ([vdso]") for s in st))
    print(f"{total} samples: clock_burn {burn}, leaf in vDSO {in_vdso}, whole {whole}, unnamed {unnamed}")
    print(stacks.most_common(3), run.stats)
    # Nearly every sample of clock_burn has the vDSO at the leaf (the syscall takes the time). A walk that
    # ends at the vDSO (the old FILE_JIT end) reads 0 whole.
    assert total >= ENOUGH, (total, run.stats)
    assert burn >= 0.95 * total, (burn, total, stacks.most_common(5))
    assert whole >= 0.95 * in_vdso and in_vdso >= 0.9 * burn, (whole, in_vdso, burn)
    assert unnamed == 0
    assert not (bad := run.made_up()), (bad, run.mappings)


def test_jit_code_is_stepped_by_frame_pointer_back_to_its_callers(
    pipeline: Pipeline, no_fp_bin: Callable[[str], Path]
) -> None:
    """jit_run calls into an anonymous executable page whose code keeps a frame pointer and calls
    jit_callback: the walk leaves jit_callback by its table, the page by frame pointer, and goes on by
    table through jit_run and main to the entry point."""
    run = pipeline.run([str(no_fp_bin("vdso_clock")), "jit", str(WARM_S), str(CPU_S)])
    stacks = run.measured()
    callback = through(stacks, "jit_callback")
    whole = sum(
        n
        for st, n in stacks.items()
        if st[: len(ENTRY)] == ENTRY
        and list(st[len(ENTRY) : len(ENTRY) + 2]) == ["main", "jit_run"]
        and st[len(ENTRY) + 2].startswith("[unknown] ([anon]+")
        # in jit_callback, or in the page itself (its own leaf: a fresh-clone run met one and indexed past it)
        and st[len(ENTRY) + 3 : len(ENTRY) + 4] in (("jit_callback",), ())
    )
    total = sum(stacks.values())
    print(f"{total} samples: jit_callback {callback}, whole {whole}; {stacks.most_common(2)}")
    print(run.stats)
    assert total >= ENOUGH, (total, run.stats)
    assert whole >= 0.95 * total, (whole, callback, total, stacks.most_common(5))
    # One frame-pointer step out of the page per whole walk. The counters are node-wide and read a little
    # after each window's samples (after the drain of the maps), so they lead the samples by that much: half
    # is far below what they must show, and far above the zero a missing count reads.
    assert run.stats["unwind_jit_fp"] >= 0.5 * whole, (run.stats["unwind_jit_fp"], whole)
    assert not (bad := run.made_up()), (bad, run.mappings)


def test_jit_code_without_a_frame_pointer_ends_the_walk_there(
    pipeline: Pipeline, no_fp_bin: Callable[[str], Path]
) -> None:
    """The page's code zeroes rbp while it calls: no frame pointer leads out of it. The walk ends at the
    page, counted as jit, and no address beyond it is made up."""
    run = pipeline.run([str(no_fp_bin("vdso_clock")), "jit-nofp", str(WARM_S), str(CPU_S)])
    stacks = run.measured()
    callback = through(stacks, "jit_callback")
    ended = sum(
        n
        for st, n in stacks.items()
        if len(st) >= 2 and st[0].startswith("[unknown] ([anon]+") and st[1] == "jit_callback"
    )
    total = sum(stacks.values())
    print(f"{total} samples: jit_callback {callback}, ended at the page {ended}; {stacks.most_common(2)}")
    print(run.stats)
    assert total >= ENOUGH, (total, run.stats)
    assert callback >= 0.95 * total, (callback, total, stacks.most_common(5))
    # Every walk through jit_callback ends at the page: at a true 1.0, 0.95 is many sigma below. (964 of
    # 1,033 once, in a fresh-clone run beside other BPF tests, when the page was made at the start of the
    # part measured: the walks before the agent had re-read the mappings ended at an address no mapping
    # held. The page is made before the warm-up now.)
    others = {
        st: n
        for st, n in stacks.items()
        if "jit_callback" in st and not st[0].startswith("[unknown] ([anon]+")
    }
    assert ended >= 0.95 * callback, (ended, callback, collections.Counter(others).most_common(5))
    # Once 2 samples of ~1,000 here, in a fresh-clone run beside other BPF tests; their walks were not
    # printed then, they are now.
    assert not (bad := run.made_up()), (bad, run.mappings)
    assert run.stats["unwind_jit"] >= 0.5 * ended, (run.stats["unwind_jit"], ended)  # (see the test above)


def test_vsyscall_is_no_place_a_walk_can_step_to(pipeline: Pipeline) -> None:
    """[vsyscall] is executable in /proc/PID/maps, but its three calls (emulated by the kernel) call nothing,
    so no return address lies there: the unwinder publishes the anonymous page a JIT runs in, not it, and a
    walk that steps into it ends as it does outside every mapping (once seen under load: a made-up frame)."""
    jit = Mapping(0x7F0000000000, 0x7F0000001000, 0, 0, 0, 0, "", "r-xp")
    vsyscall = Mapping(0xFFFFFFFFFF600000, 0xFFFFFFFFFF601000, 0, 0, 0, 0, "[vsyscall]", "--xp")
    pid = 0x7FFFFFF0  # above pid_max: no real process's entry is touched
    maps = pipeline.sampler.unwind_maps()
    assert maps is not None
    pipeline.unwinder.describe(ProcessInfo(pid, 1, "fake", "/fake", CgroupIdentity(path=""), (jit, vsyscall)))
    try:
        first, n = PROC.unpack(bytes(maps._procs[maps._procs.Key(pid)]))
        entries = [MAP.unpack(bytes(maps._maps[maps._maps.Key(first + i)]))[:4] for i in range(n)]
    finally:
        pipeline.unwinder.forget(pid)
    assert entries == [(jit.start, jit.end, 0, FILE_JIT)], entries
