"""Which processes BPF walks by tables, and the tables of the files they map (agent/bpf/unwind.h).

`describe(process)` runs at each capture of a process's mappings (its first sample, an exec, a dlopen the
resolver noticed): its executable mappings go to BPF, sorted, as one range of unwind_maps, and each file they
map gets a small id. A file new to the node is opened at once, while the process lives (inside its mount
namespace, or through map_files for a deleted file). Files up to EAGER_MAX_BYTES get their table built right
away -- so a process that lives a second, or exits before the next drain, is still walked -- on this module's
own thread, smallest first, then written to unwind_rows (paged: kernel_maps.paged). Larger files (libLLVM,
PyTorch's libraries: millions of rows each) are built only once a walk needed them: BPF flags the file in
unwind_wanted, and `collect_wanted()` (once a drain) queues it. Until a file has its table, BPF walks its
frames by frame pointer. Files are keyed like the symbol tables, by (device, inode), so libc's table is built
once for the whole node. The vDSO is one more file, the same for every process (agent/symbols/vdso.py: its
table is built once from the agent's own image); other anonymous executable memory (JIT code) has no table,
and BPF steps it by frame pointer. `forget(pid)` runs when a process leaves the process table.

Bounds: unwind_rows (SamplerConfig.unwind_rows, 4 bytes a row), unwind_rules (65,536 distinct rules),
unwind_files, unwind_maps and unwind_procs are fixed-size BPF maps. When rows run out, tables of files no
live process maps are evicted, least recently mapped first; if that is not enough the new file stays
untabled (counted). User-space memory holds ids, ranges and the rules' ids only: a table leaves the
agent's heap once written. A range given back is reused only
after GRACE_S, so a BPF walk in flight never reads a range that is being rewritten.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fleetprof.agent.model import ProcessInfo
from fleetprof.agent.process.rootfs import FileErrors, UnsafeFile, mapped_file_openers
from fleetprof.agent.symbols.elf import ElfError
from fleetprof.agent.symbols.vdso import Vdso
from fleetprof.agent.unwind.kernel_maps import FILE_JIT, MapEntry, PagedTable, UnwindMaps, paged
from fleetprof.agent.unwind.ranges import RangeAllocator
from fleetprof.agent.unwind.table import NO_INFO, UnwindTable
from fleetprof.agent.unwind.worker import TableWorker

log = logging.getLogger(__name__)

FileKey = tuple[int, int, int]  # (dev major, dev minor, inode), as the symbolizer keys its tables
VDSO_KEY: FileKey = (-1, -1, -1)  # the node's vDSO: one image for every process, no device or inode
GRACE_S = 0.05  # BPF walks last microseconds; a range is reused this long after it was let go
MAX_PENDING_FDS = 256  # files opened and waiting for their table to be built
WORKER_IDLE_S = 30.0  # the table worker process exits when no file came for this long
EAGER_MAX_BYTES = 8 << 20  # files up to this size are tabled when first mapped, larger ones when walked


@dataclass
class _File:
    id: int
    key: FileKey
    name: str
    openers: list[Callable[[], int]] = field(default_factory=list)  # through the latest process mapping it
    fd: int = -1  # open and queued until its table is built
    rows: tuple[int, int] | None = None  # (first, n) words of unwind_rows once built
    lazy: bool = False  # too large to table before a walk needs it
    size: int = 0  # bytes, once opened: the queue's order among files alike
    urgent: bool = False  # queued again at the front, once a walk met it waiting (collect_wanted)
    failed: bool = False
    users: set[int] = field(default_factory=set)  # pids of live processes that map it
    last_used: float = 0.0

    @property
    def settled(self) -> bool:
        """Nothing to do: tabled, failed, queued, or waiting for a walk to want it."""
        return self.rows is not None or self.failed or self.fd >= 0 or self.lazy


@dataclass
class UnwinderStats:
    files_tabled: int = 0
    files_failed: int = 0  # no table: unreadable, refused (see file errors), or no room
    files_no_room: int = 0
    # Files whose table is being opened, waits in the queue or is being built (a process mapped each):
    # their processes' samples are walked by frame pointer meanwhile. Large files wait for a walk to want
    # them (EAGER_MAX_BYTES) and are not counted until it does.
    files_queued: int = 0
    rows_used: int = 0
    rows_capacity: int = 0
    processes: int = 0
    tables_built: int = 0
    build_ns: int = 0  # nanoseconds spent building tables: summed as integers, exact when shown in seconds
    evictions: int = 0


class Unwinder:
    """Thread-safe; `start()` runs the table builder, `stop()` ends it."""

    def __init__(
        self,
        maps: UnwindMaps,
        proc_root: str = "/proc",
        file_errors: FileErrors | None = None,
        skip_pids: frozenset[int] = frozenset(),
        build: Callable[[int], tuple[UnwindTable, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        vdso: Vdso | None = None,
    ) -> None:
        """`vdso`: the node's vDSO image (agent/symbols/vdso.py); every process's `[vdso]` is walked by its
        table. Without it, `[vdso]` is anonymous executable memory like JIT code."""
        self._maps = maps
        self._vdso = vdso
        self._proc_root = proc_root
        self.file_errors = file_errors if file_errors is not None else FileErrors()
        self._skip = skip_pids  # the agent's own process: its walks would cost it what it measures
        self._worker = TableWorker() if build is None else None
        # fd -> (table, p_vaddr - p_offset of its code); in a process of its own (worker.py says why)
        self._build = build or self._worker.build
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._files: dict[FileKey, _File] = {}
        self._by_id: dict[int, _File] = {}
        self._free_ids = list(range(maps.file_capacity - 1, -1, -1))  # pop() hands out 0 first
        self._rows = RangeAllocator(maps.row_capacity)
        self._map_slots = RangeAllocator(maps.map_capacity)
        self._procs: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # pid -> (first, n, file ids)
        self._retired: list[tuple[float, RangeAllocator, int, int]] = []  # ranges waiting out the grace
        self._opening: set[int] = set()  # file ids being opened (outside the lock)
        self._building = 0  # tables being built (0 or 1: one builder thread; build_pending on another)
        # (0: a walk needs it / 1: eager, file size, seq, file id): files walks wait for first, then smallest
        # first. A node that keeps mapping new small files (containers starting, builds) would otherwise keep
        # a large file a walk asked for (libpython, ~70 k rows) at the back of the queue for good.
        self._queue: list[tuple[int, int, int, int]] = []
        self._seq = 0
        self._stats = UnwinderStats(rows_capacity=maps.row_capacity)
        # rule -> its id in unwind_rules, for every file's rows; never taken back (a node's files share a
        # few thousand distinct rules at most: libtorch_cpu.so's 2.6 M rows hold 1,391). Id 0 is NO_INFO's,
        # the rule of a page's start below a file's first row.
        self._rule_ids: dict[int, int] = {NO_INFO: 0}
        maps.write_rules(0, [NO_INFO])
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- processes ----------------------------------------------------------------------------------
    def describe(self, info: ProcessInfo) -> None:
        """(Re)publish a captured process's executable mappings; open files new to the node."""
        if info.pid in self._skip or not info.mapped:
            return
        to_open: list[_File] = []
        with self._lock:
            entries: list[MapEntry] = []
            ids: list[int] = []
            for m in sorted(info.mappings, key=lambda m: m.start):
                if not m.is_exec or m.path == "[vsyscall]":
                    # [vsyscall]: the kernel emulates its three calls, which call nothing, so no return
                    # address lies there; a walk that steps into it read garbage and must end (unmapped).
                    continue
                vdso = self._vdso is not None and self._vdso.matches(m)
                if not m.is_file and not vdso:
                    # Anonymous executable memory (JIT code): BPF steps it by frame pointer.
                    entries.append(MapEntry(m.start, m.end, 0, FILE_JIT))
                    continue
                if vdso:
                    f = self._file(VDSO_KEY, m.display_name)
                else:
                    f = self._file((m.dev_major, m.dev_minor, m.inode), m.display_name)
                if f is None:
                    continue  # no file id left: BPF ends walks there (no mapping)
                f.users.add(info.pid)
                f.last_used = self._clock()
                ids.append(f.id)
                entries.append(MapEntry(m.start, m.end, m.start - m.offset, f.id))
                if f.rows is None and not f.failed:
                    if vdso:
                        f.openers = [self._vdso.open_memfd]  # the node's one image: the agent's own copy
                    else:
                        f.openers = mapped_file_openers(
                            self._proc_root, info.pid, m.file_path, m.start, m.end, m.inode
                        )
                    if not f.settled and f.id not in self._opening:
                        self._opening.add(f.id)
                        to_open.append(f)
            self._publish(info.pid, entries, ids)
        for f in to_open:
            self._open(f, eager=True)

    def collect_wanted(self) -> int:
        """Queue the large files BPF walks met without a table (call once a drain), and move small ones they
        met still waiting in the queue to its front; how many large ones were queued.

        A fresh agent queues the small files of every process on the node at once, smallest first: on a
        busy node hundreds of Python extension modules come before libc, and the samples of the processes
        that run meanwhile lose their callers for seconds. Samples say which files matter now."""
        wanted = self._maps.take_wanted()
        to_open = []
        with self._lock:
            for fid in wanted:
                f = self._by_id.get(fid)
                if f is None or f.rows is not None or f.failed:
                    continue
                if f.lazy and fid not in self._opening:
                    f.lazy = False
                    self._opening.add(fid)
                    to_open.append(f)
                elif f.fd >= 0 and not f.urgent:
                    # Its first entry stays behind and is skipped when popped (the fd is gone by then).
                    f.urgent = True
                    self._seq += 1
                    heapq.heappush(self._queue, (0, f.size, self._seq, f.id))
                    self._wake.notify()
        for f in to_open:
            self._open(f, eager=False)
        return len(to_open)

    def take_unmapped(self) -> list[int]:
        """Processes whose walks met an address outside their published mappings since the last call (once a
        drain): their mappings are worth reading again."""
        return self._maps.take_unmapped()

    def unmapped_handled(self, pid: int) -> None:
        """`pid` was described again after a walk left its mappings: the next such walk is told at once."""
        self._maps.clear_unmapped(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._unpublish(pid)

    def _publish(self, pid: int, entries: list[MapEntry], ids: list[int]) -> None:
        """Point BPF at the process's new mappings. A process described again (a dlopen, a JIT's new page)
        keeps its entry until the new one replaces it in one map update: deleting it first left a moment in
        which its samples were walked by frame pointer, and a walk of code without frame pointers then
        stored a made-up return address (a fresh-clone run caught one in test_vdso_jit)."""
        if not entries:
            self._unpublish(pid)
            return
        self._reclaim()
        first = self._map_slots.alloc(len(entries))
        if first is None:
            self._unpublish(pid)  # unwind_maps full: this process is walked by frame pointer
            return
        self._maps.write_maps(first, entries)
        # After its rows: BPF never reads a range half written.
        self._maps.set_process(pid, first, len(entries))
        self._release(self._procs.get(pid), pid, still_mapped=set(ids))
        self._procs[pid] = (first, len(entries), tuple(ids))
        self._stats.processes = len(self._procs)

    def _unpublish(self, pid: int) -> None:
        """Take the process off BPF; the files it mapped lose it as a user."""
        old = self._procs.pop(pid, None)
        if old is None:
            return
        self._maps.clear_process(pid)
        self._release(old, pid)
        self._stats.processes = len(self._procs)

    def _release(
        self, old: tuple[int, int, tuple[int, ...]] | None, pid: int, still_mapped: set[int] = frozenset()
    ) -> None:
        """An entry BPF no longer points at: its range retires (walks that read it may still run), and the
        files it named but `still_mapped` does not lose the process as a user."""
        if old is None:
            return
        first, n, ids = old
        self._retire(self._map_slots, first, n)
        for fid in ids:
            f = self._by_id.get(fid)
            if f is not None and fid not in still_mapped:
                f.users.discard(pid)

    # -- files --------------------------------------------------------------------------------------
    def _file(self, key: FileKey, name: str) -> _File | None:
        f = self._files.get(key)
        if f is None:
            if not self._free_ids and not self._forget_a_file():
                return None
            f = _File(self._free_ids.pop(), key, name)
            self._files[key] = f
            self._by_id[f.id] = f
        return f

    def _forget_a_file(self) -> bool:
        """Free the id of the least recently mapped file no live process maps (containers come and go, and
        each image's files are new inodes: ids would run out in weeks); False when every file is mapped."""
        idle = [f for f in self._files.values() if not f.users and f.fd < 0 and f.id not in self._opening]
        if not idle:
            return False
        self._drop_file(min(idle, key=lambda f: f.last_used))
        return True

    def _drop_file(self, f: _File) -> None:
        """Let go of a file no live process maps: its table's rows (after their grace) and its id."""
        if f.rows is not None:
            self._maps.set_file(f.id, 0, 0, 0, 0)
            self._retire(self._rows, *f.rows)
            self._stats.files_tabled -= 1
            self._stats.evictions += 1
        del self._files[f.key], self._by_id[f.id]
        self._free_ids.append(f.id)

    def _open(self, f: _File, eager: bool) -> None:
        """Open the file now, while a process maps it, and queue its table (`eager`: unless it is large);
        outside the lock."""
        with self._lock:
            openers = list(f.openers)
        fd = -1
        for opener in openers:
            try:
                fd = opener()
                break
            except UnsafeFile as e:
                self.file_errors.count(e)
            except OSError:
                continue
        try:
            size = os.fstat(fd).st_size if fd >= 0 else 0
        except OSError:
            size = 0
        with self._lock:
            self._opening.discard(f.id)
            pending = sum(1 for g in self._files.values() if g.fd >= 0)
            if fd < 0 or pending >= MAX_PENDING_FDS or (eager and size > EAGER_MAX_BYTES):
                if fd >= 0:
                    os.close(fd)
                f.lazy = fd >= 0 and eager and size > EAGER_MAX_BYTES  # else a later capture tries again
                return
            f.fd, f.size = fd, size
            self._seq += 1
            heapq.heappush(self._queue, (1 if eager else 0, size, self._seq, f.id))
            self._wake.notify()

    # -- the builder thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fleetprof-unwind-tables", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._worker is not None:
            self._worker.close()
        with self._lock:
            for f in self._files.values():
                if f.fd >= 0:
                    os.close(f.fd)
                    f.fd = -1

    def build_pending(self) -> int:
        """Build every queued table now, on the caller's thread; how many were built (tests, benches)."""
        n = 0
        while self._build_one():
            n += 1
        return n

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    # Idle: the worker process goes (its ~35 MB with it) until the next file comes; with
                    # none running, this thread sleeps until woken.
                    worker = self._worker if self._worker is not None and self._worker.running else None
                    if not self._wake.wait(WORKER_IDLE_S if worker else None) and worker is not None:
                        worker.close()
                if self._stopping:
                    return
            try:
                self._build_one()
            except Exception:  # one file must not stop the others
                log.exception("building an unwind table failed")

    def _build_one(self) -> bool:
        with self._lock:
            if not self._queue:
                return False
            fid = heapq.heappop(self._queue)[-1]
            f = self._by_id.get(fid)
            if f is None or f.fd < 0:
                return True
            fd, f.fd = f.fd, -1
            self._building += 1
        try:
            self._build_fd(f, fd)
        finally:
            with self._lock:
                self._building -= 1
        return True

    def _build_fd(self, f: _File, fd: int) -> None:
        """Build `f`'s table from `fd` (owned from here) and load it, or mark the file failed."""
        t0 = time.monotonic_ns()
        table: UnwindTable | None = None
        delta = 0
        try:
            table, delta = self._build(fd)  # owns fd from here
        except (ElfError, OSError) as e:
            self.file_errors.count(e)
            log.debug("no unwind table for %s: %s", f.name, e)
        spent = time.monotonic_ns() - t0
        layout = self._layout(table) if table is not None and len(table) else None
        with self._lock:
            self._stats.tables_built += 1
            self._stats.build_ns += spent
            if layout is None:
                f.failed = True
                self._stats.files_failed += 1
                self._stats.files_no_room += table is not None and len(table) > 0  # no rule ids left
                return
            self._reclaim()
            first = self._rows.alloc(len(layout))
            evicted = first is None and self._evict_for(len(layout))
        if evicted:
            time.sleep(GRACE_S)  # walks in flight finish with the evicted ranges
        with self._lock:
            if first is None:
                self._reclaim(force=evicted)
                first = self._rows.alloc(len(layout))
            if first is None:
                f.failed = True
                self._stats.files_failed += 1
                self._stats.files_no_room += 1
                return
            self._maps.write_table(first, layout)
            self._maps.set_file(f.id, first, layout.pages, layout.base, delta)
            f.rows = (first, len(layout))
            self._stats.files_tabled += 1
            self._stats.rows_used = self._rows.used

    def _layout(self, table: UnwindTable) -> PagedTable | None:
        """The table in unwind_rows' layout (kernel_maps.paged), its rules given ids (those new to the node
        written to unwind_rules first); None when the ids ran out. Each rule's id is found a slice at a time
        (np.unique's inverse would be 8 bytes a row: 20 MB for libtorch_cpu.so)."""
        rules = np.unique(table.rules)
        with self._lock:
            new = [r for r in rules.tolist() if r not in self._rule_ids]
            if len(self._rule_ids) + len(new) > self._maps.rule_capacity:
                return None
            if new:
                first = len(self._rule_ids)
                self._maps.write_rules(first, new)
                self._rule_ids.update(zip(new, range(first, first + len(new)), strict=True))
            id_of = np.array([self._rule_ids[r] for r in rules.tolist()], dtype=np.uint32)
        ids = np.empty(len(table), dtype=np.uint32)
        for i in range(0, len(table), 1 << 18):
            ids[i : i + (1 << 18)] = id_of[np.searchsorted(rules, table.rules[i : i + (1 << 18)])]
        return paged(table.pcs, ids, self._rule_ids[NO_INFO])

    def _evict_for(self, n: int) -> bool:
        """Let go of tables of files no live process maps (least recently mapped first) until n rows could
        fit once their grace is over; whether any was let go."""
        if n > self._rows.capacity:
            return False
        idle = sorted((f for f in self._files.values() if f.rows and not f.users), key=lambda f: f.last_used)
        evicted = False
        for f in idle:
            if self._rows.largest_free + self._retired_rows() >= n:
                break
            self._drop_file(f)
            evicted = True
        return evicted

    def _retired_rows(self) -> int:
        return sum(n for _, alloc, _, n in self._retired if alloc is self._rows)

    def _retire(self, alloc: RangeAllocator, first: int, n: int) -> None:
        self._retired.append((self._clock() + GRACE_S, alloc, first, n))

    def _reclaim(self, force: bool = False) -> None:
        now = self._clock()
        keep = []
        for item in self._retired:
            if force or item[0] <= now:
                item[1].free(item[2], item[3])
            else:
                keep.append(item)
        self._retired = keep

    def stats(self) -> UnwinderStats:
        with self._lock:
            self._stats.rows_used = self._rows.used
            self._stats.files_queued = (
                sum(1 for f in self._files.values() if f.fd >= 0) + len(self._opening) + self._building
            )
            return UnwinderStats(**vars(self._stats))
