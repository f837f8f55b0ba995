"""Turn sampled kernel and user addresses into Frames, sharing one symbol table per ELF file across pids."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from fleetprof.agent.model import UNKNOWN, Frame, Mapping
from fleetprof.agent.process.rootfs import FileErrors, UnsafeFile, mapped_file_openers
from fleetprof.agent.symbols.debuginfo import DEBUGINFOD, DYNSYM, SOURCES, fetched_symbols, find_symbols
from fleetprof.agent.symbols.debuginfod import Debuginfod
from fleetprof.agent.symbols.elf import ElfError, ElfFile, Segment, SymbolTable, offset_to_vaddr
from fleetprof.agent.symbols.kallsyms import KALLSYMS_PATH, KernelSymbols
from fleetprof.agent.symbols.maps import find
from fleetprof.agent.symbols.vdso import VDSO_NAME, Vdso

KERNEL_MODULE = "[kernel]"
UNMAPPED_MODULE = "[unmapped]"

# Rough cost of one memoised address (dict slot, Frame, its name string), for the byte budget.
_MEMO_ENTRY_BYTES = 200
_MEMO_MAX = 8192  # per file: a large library (libtorch) is sampled at thousands of addresses
# Frames memoised per process by address (_ProcessMemos), over all processes: ~100 bytes each.
_PROCESS_MEMO_MAX = 131_072
_KERNEL_MEMO_MAX = 8192

FileKey = tuple[int, int, int]


def unknown_frame(module: str, offset: int, kernel: bool = False) -> Frame:
    """The frame shown when no symbol covers an address: "[unknown] (module+0xoffset)"."""
    return Frame(f"{UNKNOWN} ({module}+0x{offset:x})", module, kernel)


def unknown_offset(frame: Frame) -> int | None:
    """The offset unknown_frame wrote into `frame`'s name, or None (a named frame)."""
    if not frame.is_unknown or not frame.function.endswith(")"):
        return None
    _head, sep, digits = frame.function[:-1].rpartition("+0x")
    try:
        return int(digits, 16) if sep else None
    except ValueError:
        return None


def module_frame(module: str) -> Frame:
    """The one frame that stands for every address of `module` no symbol covers (see by_module)."""
    return Frame(module, module)


def unsymbolized_file(frame: Frame) -> bool:
    """An address in a mapped file that no symbol covers. Modules in brackets are the kernel's names of
    special mappings ("[anon]", "[heap]", "[vdso]") and ours ("[unmapped]", "[kernel]"); a file's module is
    its base name."""
    return frame.is_unknown and not frame.kernel and not frame.module.startswith("[")


def by_module(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """User frames with each address of a file that no symbol covers replaced by one frame named after
    the file (module_frame), and a run of such frames of one file made one: a stripped executable's
    functions and their calls among themselves read as one entry, `sha256sum`, as a whole rather than
    one entry per address ("[unknown] (sha256sum+0x41fe)" 2.2%, "+0x41fc" 0.9%, ...) that no ranking
    would put first. Frames of other modules between two runs keep them apart."""
    out: list[Frame] = []
    for frame in frames:
        if unsymbolized_file(frame):
            frame = module_frame(frame.module)
            if out and out[-1] == frame:
                continue
        out.append(frame)
    return tuple(out)


def module_runs(frames: Sequence[Frame]) -> tuple[tuple[str, int, bool], ...]:
    """For each run that by_module makes one frame, root first: (file, the innermost frame's offset, whether
    the run is the innermost frame of all): the addresses the merge hides (agent/symbols/unsymbolized.py)."""
    runs: list[tuple[str, int, bool]] = []
    for i, frame in enumerate(frames):
        if not unsymbolized_file(frame):
            continue
        offset = unknown_offset(frame)
        if offset is None:
            continue
        run = (frame.module, offset, i == len(frames) - 1)
        previous = frames[i - 1] if i else None
        if runs and previous is not None and unsymbolized_file(previous) and previous.module == frame.module:
            runs[-1] = run  # the same run, one frame further in
        else:
            runs.append(run)
    return tuple(runs)


class _CachedFile:
    """Symbols of one ELF file (or the record that loading it failed), shared by every pid mapping it."""

    __slots__ = (
        "name",
        "table",
        "segments",
        "retry_at",
        "memo",
        "frames",
        "nbytes",
        "build_id",
        "source",
        "ask_at",
    )

    def __init__(
        self,
        name: str,
        table: SymbolTable | None,
        segments: tuple[Segment, ...],
        retry_at: float,
        build_id: str | None = None,
        source: str = "",
    ):
        self.name = name
        self.table = table
        self.segments = segments
        self.retry_at = retry_at
        # Per-file memo keyed by ELF address, so it is valid for every process mapping the file.
        self.memo: dict[int, Frame] = {}
        # Function name -> its one Frame: the addresses of a function share it, so stacks that differ only
        # in where the CPU was inside a function come out as equal tuples of the same objects (the
        # resolver's caches and the encoder compare them by identity first).
        self.frames: dict[str, Frame] = {}
        self.nbytes = table.nbytes if table is not None else 0
        self.build_id = build_id
        self.source = source  # where the table came from (debuginfo.SOURCES); "" for none
        self.ask_at = 0.0  # when debuginfod may be asked (again) for a file with .dynsym only


class _ProcessMemos(OrderedDict):
    """pid -> (the mappings it was read against, {address key: Frame}): the frames already named for a
    process's addresses, least recently used process first. A deep stack new to the resolver (PyTorch's:
    each distinct leaf address makes a distinct stack) mostly holds addresses seen before; each such frame
    costs one dict lookup here, not a mapping search, a file lookup and the file's memo (bench/README.md,
    "A PyTorch node"). A process described again (new mappings) starts a new memo; the mappings object is
    held, so `is` cannot be fooled by a reused id. Bounded in entries over all processes."""

    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self._max = max_entries
        self.entries = 0

    def of(self, pid: int, mappings: Sequence[Mapping]) -> dict[int, Frame]:
        held = self.get(pid)
        if held is not None and held[0] is mappings:
            self.move_to_end(pid)
            return held[1]
        if held is not None:
            self.entries -= len(held[1])
        memo: dict[int, Frame] = {}
        self[pid] = (mappings, memo)
        self.move_to_end(pid)
        return memo

    def grew(self, pid: int, added: int) -> None:
        """`added` entries went into pid's memo: keep within the bound (one process past a quarter of it
        starts over alone; then the least recent processes go)."""
        self.entries += added
        memo = self[pid][1]
        if len(memo) > self._max // 4:
            self.entries -= len(memo)
            memo.clear()
        while self.entries > self._max and len(self) > 1:
            _, (_, old) = self.popitem(last=False)
            self.entries -= len(old)

    def clear(self) -> None:
        super().clear()
        self.entries = 0


class Symbolizer:
    """Kernel and user-space address symbolization with a bounded LRU of per-file symbol tables.

    Tables are keyed by (dev_major, dev_minor, inode) of the mapped file, so libc is parsed once for the
    whole host however many processes map it. Failures are cached for `retry_after_s` seconds.
    Thread-safe (one lock): the process-event thread preloads while the drain thread looks up.

    Files under a process's root are its tenant's: they are opened inside that root (never following a
    link out of it) and read within caps (agent/process/rootfs.py, agent/symbols/elf.py); each file
    refused is counted in `file_errors`, which the agent may share with other readers of tenant files.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        max_files: int = 512,
        kallsyms_path: str = KALLSYMS_PATH,
        max_bytes: int = 64 << 20,
        debug_root: str = "/",
        retry_after_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        file_errors: FileErrors | None = None,
        vdso: Vdso | None = None,
        debuginfod: Debuginfod | None = None,
    ) -> None:
        """`vdso`: the node's vDSO image (agent/symbols/vdso.py), which names every process's `[vdso]`
        frames; without it they read "[unknown] ([vdso]+0x...)". `debuginfod`: where files that no local
        source names completely (agent/symbols/debuginfo.py) are asked for, in the background; when a
        debug file arrives the file's table is replaced and `generation` changes."""
        if max_files < 1 or max_bytes < 1:
            raise ValueError("max_files and max_bytes must be positive")
        self._proc_root = proc_root
        self._max_files = max_files
        self._max_bytes = max_bytes
        self._kallsyms_path = kallsyms_path
        self._debug_root = debug_root
        self._retry_after_s = retry_after_s
        self._clock = clock
        self.file_errors = file_errors if file_errors is not None else FileErrors()
        self._vdso = vdso
        self._vdso_file = _CachedFile(VDSO_NAME, vdso.symbols, vdso.segments, 0.0) if vdso else None
        self._debuginfod = debuginfod
        self._generation = 0
        self._lock = threading.RLock()
        self._files: OrderedDict[FileKey, _CachedFile] = OrderedDict()
        self._process_memos = _ProcessMemos(_PROCESS_MEMO_MAX)
        self._bytes = 0
        self._kernel: KernelSymbols | None = None
        self._kernel_memo: dict[int, Frame] = {}
        self._counts = dict.fromkeys(
            (
                "lookups",
                "cache_hits",
                "memo_hits",
                "files_loaded",
                "load_failures",
                "files_evicted",
                "files_upgraded",  # tables replaced by a debug file that debuginfod sent later
            ),
            0,
        )

    # -- kernel -----------------------------------------------------------------------------------------

    def _kernel_symbols(self) -> KernelSymbols:
        if self._kernel is None:
            try:
                self._kernel = KernelSymbols(path=self._kallsyms_path)
            except OSError:
                self._kernel = KernelSymbols(text=b"")
        return self._kernel

    def load_kernel_symbols(self) -> int:
        """Parse kallsyms now (~0.5 s, once) rather than in the first drain; returns the symbol count."""
        with self._lock:
            return len(self._kernel_symbols())

    def reload_kernel_symbols(self) -> None:
        """Re-read kallsyms on the next kernel lookup (call after modules are loaded or unloaded)."""
        with self._lock:
            self._kernel = None
            self._kernel_memo.clear()

    def kernel_frames(self, addrs: Sequence[int], *, return_addresses: bool = False) -> list[Frame]:
        """Frames for kernel stack addresses, innermost first. With return_addresses, every frame but the
        first is looked up at addr-1 so a call that ends its function is not credited to the next one."""
        with self._lock:
            return self._kernel_frames(addrs, return_addresses)

    def _kernel_frames(self, addrs: Sequence[int], return_addresses: bool) -> list[Frame]:
        ksyms = self._kernel_symbols()
        memo = self._kernel_memo
        frames = []
        for i, addr in enumerate(addrs):
            self._counts["lookups"] += 1
            frame = memo.get(addr)
            if frame is None:
                hit = ksyms.lookup(addr - 1 if return_addresses and i else addr)
                if hit is None:
                    frame = unknown_frame(KERNEL_MODULE, addr, kernel=True)
                else:
                    name, module = hit
                    where = KERNEL_MODULE if module is None else f"{KERNEL_MODULE} {module}"
                    frame = Frame(name, where, True)
                if len(memo) >= _KERNEL_MEMO_MAX:
                    memo.clear()
                memo[addr] = frame
            else:
                self._counts["memo_hits"] += 1
            frames.append(frame)
        return frames

    # -- user space -------------------------------------------------------------------------------------

    def user_frames(
        self, pid: int, mappings: Sequence[Mapping], addrs: Sequence[int], *, return_addresses: bool = False
    ) -> list[Frame]:
        """Frames for user stack addresses of `pid`, using `mappings` captured while it ran (sorted by start,
        as read_maps returns them). The process may have exited since. See kernel_frames for
        return_addresses."""
        with self._lock:
            return self._user_frames(pid, mappings, addrs, return_addresses)

    def preload(self, pid: int, mappings: Sequence[Mapping]) -> None:
        """Load the symbol tables of a live process's mapped files now, so its samples still symbolize
        after it exits (with it, its mount namespace and /proc/PID/root may be gone by the drain). Locks
        per file, so a drain's symbolization waits for one file's load at most."""
        for mapping in mappings:
            if mapping.is_file and mapping.is_exec:
                with self._lock:
                    self._file(pid, mapping)

    def _user_frames(
        self, pid: int, mappings: Sequence[Mapping], addrs: Sequence[int], return_addresses: bool
    ) -> list[Frame]:
        memo = self._process_memos.of(pid, mappings)
        frames = []
        added = hits = 0
        for i, addr in enumerate(addrs):
            returns = return_addresses and i > 0
            key = ~addr if returns else addr  # a return address is looked up one byte back
            frame = memo.get(key)
            if frame is None:
                frame, final = self._user_frame(pid, mappings, addr, addr - 1 if returns else addr)
                if final:
                    memo[key] = frame
                    added += 1
            else:
                hits += 1
            frames.append(frame)
        self._counts["lookups"] += len(frames)
        self._counts["memo_hits"] += hits
        if added:
            self._process_memos.grew(pid, added)
        return frames

    def _user_frame(
        self, pid: int, mappings: Sequence[Mapping], addr: int, lookup_addr: int
    ) -> tuple[Frame, bool]:
        """The frame of `addr`, and whether it is final for these mappings: not an address outside them
        (the process mapped more since) nor in a file whose table could not be read (retried later)."""
        mapping = find(mappings, lookup_addr)
        if mapping is None:
            return unknown_frame(UNMAPPED_MODULE, addr), False
        if mapping.is_file:
            cached = self._file(pid, mapping)
        elif self._vdso is not None and self._vdso.matches(mapping):
            cached = self._vdso_file
        else:
            return unknown_frame(mapping.display_name, addr - mapping.start), True
        file_offset = addr - mapping.start + mapping.offset
        if cached.table is None:
            return unknown_frame(mapping.display_name, file_offset), False
        vaddr = offset_to_vaddr(cached.segments, lookup_addr - mapping.start + mapping.offset)
        if vaddr is None:
            return unknown_frame(cached.name, file_offset), True
        frame = cached.memo.get(vaddr)
        if frame is not None:
            self._counts["memo_hits"] += 1
            return frame, True
        hit = cached.table.lookup(vaddr)
        if len(cached.memo) >= _MEMO_MAX:
            self._bytes -= len(cached.memo) * _MEMO_ENTRY_BYTES
            cached.nbytes -= len(cached.memo) * _MEMO_ENTRY_BYTES
            cached.memo.clear()
            cached.frames.clear()
        if hit is None:
            frame = unknown_frame(cached.name, file_offset)
        else:
            frame = cached.frames.get(hit[0])
            if frame is None:
                frame = cached.frames[hit[0]] = Frame(hit[0], cached.name)
        cached.memo[vaddr] = frame
        self._bytes += _MEMO_ENTRY_BYTES
        cached.nbytes += _MEMO_ENTRY_BYTES
        return frame, True

    def _file(self, pid: int, mapping: Mapping) -> _CachedFile:
        key = (mapping.dev_major, mapping.dev_minor, mapping.inode)
        cached = self._files.get(key)
        if cached is not None and (cached.table is not None or self._clock() < cached.retry_at):
            self._files.move_to_end(key)
            self._counts["cache_hits"] += 1
            self._ask_debuginfod(cached)
            return cached
        if cached is not None:
            self._drop(key)
        cached = self._load(pid, mapping)
        self._files[key] = cached
        self._bytes += cached.nbytes
        self._evict()
        self._ask_debuginfod(cached)
        return cached

    def _load(self, pid: int, mapping: Mapping) -> _CachedFile:
        name = mapping.display_name
        root = f"{self._proc_root}/{pid}/root"
        cached = self._debuginfod.cached if self._debuginfod is not None else None
        for open_mapped in self._candidates(pid, mapping):
            try:
                fd = open_mapped()
            except UnsafeFile as e:
                self.file_errors.count(e)
                continue
            except OSError:
                continue
            try:
                with ElfFile(fd) as elf:
                    found = find_symbols(
                        elf,
                        mapping.file_path,
                        root,
                        self._debug_root,
                        cached,
                        on_error=self.file_errors.count,
                    )
                    segments, build_id = elf.load_segments, elf.build_id
            except (ElfError, OSError) as e:
                self.file_errors.count(e)
                break  # the right file, but not one we can read symbols from; other paths name the same bytes
            self._counts["files_loaded"] += 1
            return _CachedFile(name, found.table, segments, 0.0, build_id, found.source)
        self._counts["load_failures"] += 1
        return _CachedFile(name, None, (), self._clock() + self._retry_after_s)

    def _ask_debuginfod(self, cached: _CachedFile) -> None:
        """Queue a debuginfod lookup for a file named by .dynsym alone (again once the time a server's
        "no" is believed has passed, or a lookup was dropped); it costs a comparison until then."""
        if self._debuginfod is None or cached.build_id is None or cached.source != DYNSYM:
            return
        now = self._clock()
        if now < cached.ask_at:
            return
        cached.ask_at = now + self._debuginfod.config.negative_ttl_s
        self._debuginfod.request(cached.build_id, self._debug_file_arrived)

    def _debug_file_arrived(self, build_id: str, path: str) -> None:
        """debuginfod's fetch thread: a debug file for `build_id` is at `path`. Its table is read here,
        outside the lock, then replaces the tables of the cached files of that build."""
        table = fetched_symbols(path, build_id, self.file_errors.count)
        if table is None:
            return
        with self._lock:
            upgraded = 0
            for cached in self._files.values():
                if cached.build_id == build_id and cached.table is not None and cached.source != DEBUGINFOD:
                    self._bytes -= cached.nbytes
                    cached.table, cached.source = table, DEBUGINFOD
                    cached.memo.clear()
                    cached.nbytes = table.nbytes
                    self._bytes += cached.nbytes
                    upgraded += 1
            if upgraded:
                self._counts["files_upgraded"] += upgraded
                self._generation += 1
                self._process_memos.clear()  # frames of those files are named better now
                self._evict()

    @property
    def generation(self) -> int:
        """Changes when a cached file's table was replaced (a debug file arrived): frames named before
        may be named better now."""
        return self._generation

    def _candidates(self, pid: int, mapping: Mapping) -> list[Callable[[], int]]:
        m = mapping
        return mapped_file_openers(self._proc_root, pid, m.file_path, m.start, m.end, m.inode)

    def _drop(self, key: FileKey) -> None:
        cached = self._files.pop(key)
        self._bytes -= cached.nbytes

    def _evict(self) -> None:
        # The newest entry stays even if it alone exceeds max_bytes: it is about to be used.
        while len(self._files) > 1 and (len(self._files) > self._max_files or self._bytes > self._max_bytes):
            self._drop(next(iter(self._files)))
            self._counts["files_evicted"] += 1

    def stats(self) -> dict[str, int]:
        """Counters: files cached/failed now, bytes held, lookups, cache and memo hits, loads, evictions."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        failed = sum(1 for c in self._files.values() if c.table is None)
        out = {
            "files_cached": len(self._files) - failed,
            "files_failed": failed,
            "bytes_held": self._bytes + (self._kernel.nbytes if self._kernel is not None else 0),
        }
        out.update(self._counts)
        # Cached files by where their table came from (debuginfo.SOURCES): "files_from_dynsym" are the
        # ones whose own functions read as their module (no symbols found for them).
        for source in SOURCES:
            out[f"files_from_{source}"] = 0
        for c in self._files.values():
            if c.source:
                out[f"files_from_{c.source}"] += 1
        return out
