"""User stacks of code built without frame pointers, walked in BPF by the files' call-frame information
(--unwind=eh_frame), against workloads with known call chains; the frame-pointer walk of the same code as
the control; perf's own DWARF unwinder on the same run as the anchor."""

from __future__ import annotations

import collections
import ctypes as ct
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetprof.agent.model import ResolvedSample
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.python.unwinder import PythonStacks
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.symbols.symbolizer import Symbolizer
from fleetprof.agent.unwind.unwinder import Unwinder
from tests.conftest import maps_libc, own_scope, require_bpf, wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

FREQUENCY = 499
CHAIN = ["main", "chain_a", "chain_b", "chain_c", "leaf_spin"]
ENTRY = ("_start", "__libc_start_main", "__libc_start_call_main")


@dataclass
class Run:
    pid: int
    rows: list[ResolvedSample]
    stats: collections.Counter
    out: str = ""  # what the workload printed

    def truth(self) -> dict:
        """The JSON line a workload run for its CPU time prints (unwind_chain cpu): its own measure."""
        return json.loads(self.out)

    def stacks(self) -> collections.Counter:
        """Root-first user function names -> samples (kernel frames left out)."""
        out: collections.Counter = collections.Counter()
        for r in self.rows:
            out[tuple(_base(f.function) for f in r.frames[: r.kernel_start])] += r.count
        return out


def _base(name: str) -> str:
    """A symbol without its version (`__libc_start_main@@GLIBC_2.34`)."""
    return name.split("@", 1)[0]


class Pipeline:
    """Sampler, process table, table unwinder, symbolizer and resolver in this process, as the agent wires
    them; tables are built on the test's thread (build_pending) before a workload is let go."""

    def __init__(self, unwind: str):
        require_bpf()
        self.sampler = CpuSampler(
            SamplerConfig(
                frequency_hz=FREQUENCY, interval_s=1.0, unwind=unwind, off_cpu=False, scope=own_scope()
            )
        )
        maps = self.sampler.unwind_maps()
        self.unwinder = Unwinder(maps) if maps is not None else None
        self.python = PythonStacks(enabled=True)
        self.python.attach(self.sampler)
        self.table = ProcessTable(on_capture=self._captured, on_forget=self.python.forget)
        symbolizer = Symbolizer()
        symbolizer.load_kernel_symbols()
        self.resolver = Resolver(self.table, symbolizer, python=self.python)

    def _captured(self, info) -> None:
        self.python.on_capture(info)
        if self.unwinder is not None:
            self.unwinder.describe(info)

    def run(self, argv: list[str], during: Callable[[int], None] | None = None) -> Run:
        """Start a gated workload (it waits for a line on stdin), describe it and build its files'
        tables as an always-on agent has them, let it go, and drain until it exits."""
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        wait_until(lambda: maps_libc(proc.pid), 30, f"pid {proc.pid} to map libc", every=0.005)
        self.table.refresh(proc.pid)
        if self.unwinder is not None:
            self.unwinder.build_pending()
        self.sampler.drain()  # what came before the gate
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
        if during is not None:
            during(proc.pid)
        run = Run(proc.pid, [], collections.Counter())
        while proc.poll() is None:
            time.sleep(0.5)
            self._collect(run)
        self._collect(run)
        assert proc.returncode == 0, argv
        assert proc.stdout is not None
        run.out = proc.stdout.read()
        proc.stdout.close()
        return run

    def _collect(self, run: Run) -> None:
        window = self.resolver.resolve(self.sampler.drain())
        run.rows += [r for r in window.samples if r.process.pid == run.pid]
        run.stats.update(window.stats)

    def close(self) -> None:
        if self.unwinder is not None:
            self.unwinder.stop()
        self.sampler.close()


@pytest.fixture(scope="module")
def eh() -> Iterator[Pipeline]:
    p = Pipeline("eh_frame")
    yield p
    p.close()


def whole_chain(stack: tuple[str, ...]) -> bool:
    """main -> chain_a -> chain_b -> chain_c -> leaf_spin, at the leaf, under the process's entry point."""
    return stack[: len(ENTRY)] == ENTRY and list(stack[len(ENTRY) :]) == CHAIN


def whole_sort(stack: tuple[str, ...]) -> bool:
    """main -> sort_round -> (glibc's qsort machinery) -> compare_slow, under the entry point."""
    if stack[: len(ENTRY)] != ENTRY or stack[-1] != "compare_slow" or "qsort" not in " ".join(stack):
        return False
    rest = list(stack[len(ENTRY) :])
    return rest[:2] == ["main", "sort_round"] and "compare_slow" not in rest[:-1]


def judged(run: Run) -> tuple[int, int, int, int]:
    """(chain samples, whole ones, comparator samples, whole ones): samples whose leaf is the hot loop or
    the comparator, and how many of them carry the whole stack."""
    chain = whole_c = sort = whole_s = 0
    for stack, n in run.stacks().items():
        if stack and stack[-1] == "leaf_spin":
            chain += n
            whole_c += n if whole_chain(stack) else 0
        elif stack and stack[-1] == "compare_slow":
            sort += n
            whole_s += n if whole_sort(stack) else 0
    return chain, whole_c, sort, whole_s


def expected_samples(part_ns: int) -> float:
    """Samples a part of unwind_chain's own CPU time earns at FREQUENCY."""
    return part_ns / 1e9 * FREQUENCY


def test_stacks_without_frame_pointers_are_whole(eh: Pipeline, no_fp_bin: Callable[[str], Path]) -> None:
    run = eh.run([str(no_fp_bin("unwind_chain")), "cpu", "1.0", "gate"])
    truth = run.truth()
    chain, whole_c, sort, whole_s = judged(run)
    top = run.stacks().most_common(3)
    print(
        f"chain {whole_c}/{chain} whole ({expected_samples(truth['chain_ns']):.0f} by its CPU time), "
        f"comparator {whole_s}/{sort} whole ({expected_samples(truth['sort_ns']):.0f} for the whole sort "
        f"part); top: {top}"
    )
    print({k: v for k, v in run.stats.items() if k.startswith("unwind")})
    # The workload gives each part 1 s of its own CPU time, whatever the machine's speed (a fixed number
    # of rounds read (557, 205) on one machine: the sort part ran faster there): 499 samples a part. The
    # leaf is the sampled IP, walk or no walk: leaf_spin holds ~0.8 of the chain part's samples,
    # compare_slow ~all of the sort part's (perf record of this binary: 40.5% and 50.3% of all, msort 4.6%):
    # >= ~400 each, and a count varies by <= sqrt(400) = 20, so 300 is 5 sigma below. A walk that never
    # fails reads 1.0; at a true 0.99 over n = 300, sigma = 0.006: 0.95 is 7 sigma below. The frame-pointer
    # walk of the same binary reads ~0 (the next test).
    assert chain > 300 and sort > 300, (chain, sort, truth)
    assert whole_c >= 0.95 * chain and whole_s >= 0.95 * sort, (whole_c, chain, whole_s, sort)
    assert run.stats["unwind_walks"] > 0


def test_the_frame_pointer_walk_of_the_same_code_is_not(no_fp_bin: Callable[[str], Path]) -> None:
    """The control: the kernel's frame-pointer walk of the same binary loses the chain (so the test above
    measures the table walk, not the workload)."""
    fp = Pipeline("fp")
    try:
        run = fp.run([str(no_fp_bin("unwind_chain")), "cpu", "0.5", "gate"])
    finally:
        fp.close()
    chain, whole_c, sort, whole_s = judged(run)
    print(f"frame pointers: chain {whole_c}/{chain} whole, comparator {whole_s}/{sort} whole")
    # 0.5 s of CPU a part x 499 Hz: ~450 samples in the two leaves (see the test above), sd <= 22: 300 is
    # 6.8 sigma below. The frame-pointer walk finds the whole chain in ~0 of them; 0.2 is > 10 sigma above.
    assert chain + sort > 300
    assert whole_c + whole_s < 0.2 * (chain + sort)


def test_cpython_native_frames_are_whole_between_python_frames(eh: Pipeline) -> None:
    """Debian's python3.11 (no frame pointers): a Python function calls sorted(), a C builtin, whose key
    is a Python lambda. The native frames between the two Python frames are there, in order."""
    code = (
        "import sys\n"
        "sys.stdin.readline()\n"
        "def ranked(n):\n"
        "    return sorted(range(n), key=lambda x: -x)\n"
        "def batch():\n"
        "    return [ranked(20000) for _ in range(3)]\n"
        "import time\n"
        "start = time.thread_time()\n"  # its own CPU time: the same samples on a fast or a busy machine
        "while time.thread_time() - start < 3:\n"
        "    batch()\n"
    )
    run = eh.run(["/usr/bin/python3.11", "-c", code])
    total = sum(run.stacks().values())
    keyed = whole = 0
    for stack, n in run.stacks().items():
        names = list(stack)
        if not any(s.startswith("ranked.<locals>.<lambda>") for s in names):
            continue
        keyed += n
        outer = next(i for i, s in enumerate(names) if s.startswith("ranked ("))
        inner = next(i for i, s in enumerate(names) if s.startswith("ranked.<locals>.<lambda>"))
        between = names[outer + 1 : inner]
        under_entry = names[: len(ENTRY)] == list(ENTRY)
        callers = [s for s in names[:outer] if "(<string>:" in s]
        if under_entry and between and not any("(<string>:" in s for s in between) and len(callers) >= 2:
            whole += n
    print(f"{keyed} of {total} samples in the key lambda; {whole} whole: {run.stacks().most_common(2)}")
    # ~1,500 samples, a large part inside the lambda (each comparison calls it). Whole: the lambda under
    # sorted's C frames under ranked() under batch's comprehension under <module>, at the entry point.
    assert keyed > 150, keyed
    assert whole >= 0.9 * keyed, (whole, keyed)


def test_the_hottest_stacks_match_perfs_dwarf_unwinding(
    eh: Pipeline, no_fp_bin: Callable[[str], Path]
) -> None:
    """perf record --call-graph dwarf samples the same run: both see the same hottest stacks (the
    workload's own functions, root first) and the same split between the chain and the comparator."""
    if shutil.which("perf") is None:
        pytest.fail("perf is not installed (Debian linux-perf; `make test` installs it)")
    # perf itself failed once in a fresh-clone run (`perf script` exited 255, its stderr not kept): the
    # reference is run again then, once, and what perf said is printed. Our side is judged on the run
    # whose perf data was read.
    for attempt in (1, 2):
        run, script, failed = _run_beside_perf(eh, no_fp_bin)
        if not failed:
            break
        print(f"perf failed (attempt {attempt}): {failed}")
    else:
        pytest.fail(f"perf failed twice: {failed}")
    ours = _own(run.stacks())
    theirs = _own(_perf_stacks(script))
    n1, n2 = sum(ours.values()), sum(theirs.values())
    top_ours = {s for s, _ in ours.most_common(2)}
    top_theirs = {s for s, _ in theirs.most_common(2)}
    truth = run.truth()
    print(f"ours {n1}: {ours.most_common(3)}\nperf {n2}: {theirs.most_common(3)}\ntruth {truth}")
    # 1.5 s of CPU a part (the workload's own clock): ~1,500 samples each way, sd <= 39: 500 is > 25
    # sigma below.
    assert n1 > 500 and n2 > 500, (n1, n2)
    assert top_ours == top_theirs, (top_ours, top_theirs)
    # How each sampler splits the sort part between its two stacks (the comparator's and sort_round's own)
    # is a question of unwinding alone. The split between the two parts is not compared with perf's: perf
    # record -p samples on the task's own clock, and the workload switches parts by that same clock, so
    # the two lock in phase (CI read 0.353 of perf's samples in leaf_spin, 0.468 of ours, for a true ~0.49).
    # Ours is held to the workload's clock instead.
    q1, m1 = _share_within(ours, "sort_round", "compare_slow")
    q2, m2 = _share_within(theirs, "sort_round", "compare_slow")
    sigma_q = math.sqrt(q1 * (1 - q1) / m1 + q2 * (1 - q2) / m2)  # ~0.016 at q ~0.88, m ~800 each
    assert abs(q1 - q2) <= 4.5 * sigma_q + 0.01, (q1, m1, q2, m2, sigma_q)
    chain_ns, sort_ns = truth["chain_ns"], truth["sort_ns"]
    p_true = chain_ns / (chain_ns + sort_ns)
    p1 = sum(n for s, n in ours.items() if "chain_a" in s) / n1
    # A share p over n ~1,500 samples: sigma ~0.013 at p ~0.5; 0.01 for what the parts' clock reads
    # outside them (the loop's own ~1 us per call).
    sigma_p = math.sqrt(p_true * (1 - p_true) / n1)
    assert abs(p1 - p_true) <= 4.5 * sigma_p + 0.01, (p1, p_true, sigma_p)


def _run_beside_perf(eh: Pipeline, no_fp_bin: Callable[[str], Path]) -> tuple[Run, str, str]:
    """The workload under our sampler and `perf record --call-graph dwarf` at once: our run, perf script's
    output, and what perf said if it failed ("" if not)."""
    data = Path("/tmp") / f"fleetprof-perf-{time.monotonic_ns()}.data"
    errors = data.with_suffix(".err")
    perf: list[subprocess.Popen] = []

    def record(pid: int) -> None:
        cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(FREQUENCY), "--call-graph", "dwarf,65528"]
        with open(errors, "wb") as err:
            perf.append(subprocess.Popen([*cmd, "-o", str(data), "-p", str(pid)], stderr=err))

    try:
        run = eh.run([str(no_fp_bin("unwind_chain")), "cpu", "1.5", "gate"], during=record)
        rc = perf[0].wait(timeout=60)
        script = subprocess.run(
            ["perf", "script", "-i", str(data), "-F", "ip,sym"], capture_output=True, text=True
        )
        failed = ""
        if script.returncode != 0:
            said = errors.read_text(errors="replace")[-2000:]
            failed = f"perf record exited {rc} ({said!r}); perf script {script.returncode}: "
            failed += repr(script.stderr[-2000:])
        return run, script.stdout, failed
    finally:
        data.unlink(missing_ok=True)
        errors.unlink(missing_ok=True)


def _share_within(stacks: collections.Counter, part: str, frame: str) -> tuple[float, int]:
    """Of the samples under `part`, the share with `frame` in their stack, and how many they are."""
    under = sum(n for s, n in stacks.items() if part in s)
    return sum(n for s, n in stacks.items() if part in s and frame in s) / max(under, 1), max(under, 1)


OWN = frozenset({"main", "chain_a", "chain_b", "chain_c", "leaf_spin", "sort_round", "compare_slow"})


def _own(stacks: collections.Counter) -> collections.Counter:
    """The workload's own functions of each stack, root first (libc's frames, named differently by perf's
    inline-aware symbolizer and ours, left out)."""
    out: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        out[tuple(s for s in stack if s in OWN)] += n
    return out


def _perf_stacks(script: str) -> collections.Counter:
    """perf script output (blocks of "ip sym" lines, leaf first) as root-first name tuples."""
    out: collections.Counter = collections.Counter()
    for block in script.split("\n\n"):
        names = []
        for line in block.splitlines():
            m = re.match(r"\s+[0-9a-f]+\s+(\S+)", line)
            if m:
                names.append(m.group(1).split("+", 1)[0])
        if names:
            out[tuple(reversed(names))] += 1
    return out


def test_file_ids_of_files_no_process_maps_are_reused() -> None:
    """Containers come and go, each image's files new inodes: with 4 file ids, a second process's files
    get the ids the first one's held once it is forgotten, and their tables are built."""
    require_bpf()
    from fleetprof.agent.model import CgroupIdentity, Mapping, ProcessInfo

    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False, unwind_files=4))
    maps = sampler.unwind_maps()
    assert maps is not None
    unwinder = Unwinder(maps)
    libs = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("lib*.so.*"), key=lambda p: p.stat().st_size)
    small = [p for p in libs if p.is_file() and not p.is_symlink() and 20_000 < p.stat().st_size < 500_000]

    def process(pid: int, files: list[Path]) -> ProcessInfo:
        mappings = tuple(
            Mapping(
                0x10000000 * (i + 1), 0x10000000 * (i + 1) + 0x1000, 0, 0, 0, f.stat().st_ino, str(f), "r-xp"
            )
            for i, f in enumerate(files)
        )
        return ProcessInfo(pid, 1, "fake", str(files[0]), CgroupIdentity(path=""), mappings)

    try:
        me = os.getpid()  # its root holds the files; the pids only name the processes
        unwinder.describe(process(me, small[:3]))
        unwinder.build_pending()
        first = unwinder.stats()
        unwinder.forget(me)
        unwinder.describe(process(me, small[3:6]))
        unwinder.build_pending()
        second = unwinder.stats()
    finally:
        unwinder.stop()
        sampler.close()
    print(first, second)
    assert first.files_tabled == 3
    # 4 ids: the free one and two of the first three files' (least recently mapped first) go to the new
    # files; one of the first three keeps its table.
    assert second.files_tabled == 4 and second.evictions == 2


def test_a_process_described_again_is_never_off_its_tables() -> None:
    """A process described again (a dlopen, a JIT's new page) is walked by its tables throughout: while its
    entry was deleted and written anew, its samples were walked by frame pointer, and one through code
    without frame pointers stored a made-up return address (a fresh-clone run of test_vdso_jit). The real
    maps, watched before and after every write the unwinder makes."""
    require_bpf()
    from fleetprof.agent.model import CgroupIdentity, Mapping, ProcessInfo
    from fleetprof.agent.unwind.kernel_maps import MAP, PROC

    sampler = CpuSampler(SamplerConfig(interval_s=1.0, off_cpu=False))
    maps = sampler.unwind_maps()
    assert maps is not None
    me = os.getpid()  # its root holds the files; the pid only names the process
    present: list[tuple[str, bool]] = []

    def published() -> bytes | None:
        try:
            return bytes(maps._procs[ct.c_uint32(me)])
        except KeyError:
            return None

    class Watched:
        def __getattr__(self, name: str):
            attr = getattr(maps, name)
            if not callable(attr):
                return attr

            def call(*args, **kwargs):
                present.append((name, published() is not None))
                out = attr(*args, **kwargs)
                present.append((name, published() is not None))
                return out

            return call

    unwinder = Unwinder(Watched())  # type: ignore[arg-type]
    libc = next(p for p in Path("/usr/lib/x86_64-linux-gnu").glob("libc.so.*") if not p.is_symlink())

    def process(mappings: tuple[Mapping, ...]) -> ProcessInfo:
        return ProcessInfo(me, 1, "fake", str(libc), CgroupIdentity(path=""), mappings)

    code = Mapping(0x10000000, 0x10001000, 0, 0, 0, libc.stat().st_ino, str(libc), "r-xp")
    try:
        unwinder.describe(process((code,)))
        assert published() is not None
        present.clear()
        for i in range(1, 6):  # each time a page more
            pages = tuple(
                Mapping(0x7F0000000000 + k * 0x1000, 0x7F0000001000 + k * 0x1000, 0, 0, 0, 0, "", "r-xp")
                for k in range(i)
            )
            unwinder.describe(process((code, *pages)))
            first, n = PROC.unpack(published())
            starts = [MAP.unpack(bytes(maps._maps[ct.c_int(first + k)]))[0] for k in range(n)]
            assert starts == [code.start, *(p.start for p in pages)], (i, starts)
        writes = list(present)
        unwinder.forget(me)
        assert published() is None
    finally:
        unwinder.stop()
        sampler.close()
    assert writes and all(ok for _, ok in writes), writes
