"""Symbols of stripped binaries from where distributions put them: the build-id path and .gnu_debuglink
inside the process's root, MiniDebugInfo, and a real debuginfod server (elfutils', Debian's package) on
loopback; a hostile server's answers bounded; the on-disk cache bounded; unsymbolized frames per module.

Binaries are built here with gcc -g and split with objcopy --only-keep-debug, as distributions do."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetprof.agent.model import STACK_NONE, Drain, Frame, SampleCount
from fleetprof.agent.process.rootfs import FileErrors
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.symbols import debuginfo, debuginfod
from fleetprof.agent.symbols.debuginfo import debuglink_candidates, find_symbols
from fleetprof.agent.symbols.debuginfod import (
    DebugFileCache,
    Debuginfod,
    DebuginfodClient,
    DebuginfodConfig,
    parse_urls,
)
from fleetprof.agent.symbols.elf import ElfFile, debug_file_path
from fleetprof.agent.symbols.maps import read_maps
from fleetprof.agent.symbols.symbolizer import (
    Symbolizer,
    by_module,
    module_frame,
    module_runs,
    unknown_frame,
    unknown_offset,
)
from fleetprof.agent.symbols.unsymbolized import UnsymbolizedAddresses
from tests.conftest import wait_until
from tests.support import debuginfod_servers as servers

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "objcopy", "strip", "xz")),
    reason="gcc, binutils and xz-utils are needed: scripts/setup.sh --test",
)

# A static function is in no stripped file's .dynsym: only a separate debug file (or MiniDebugInfo) names it.
PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>
static __attribute__((noinline)) int dbg_hidden(int x) { return x * 3 + 1; }
int main(void) {
    printf("%p %p\n", (void *)dbg_hidden, (void *)main);
    fflush(stdout);
    char buf[16];
    while (read(0, buf, sizeof buf) > 0) {}
    return dbg_hidden(1) == 0;
}
"""


@dataclass(frozen=True)
class Build:
    full: Path  # built with gcc -g
    debug: Path  # objcopy --only-keep-debug of full
    stripped: Path  # strip of full: no .symtab, no .debug_*
    build_id: str  # "" when built with --build-id=none


def build(directory: Path, name: str, *flags: str) -> Build:
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"{name}.c"
    src.write_text(PROGRAM)
    full, debug, stripped = directory / f"{name}.full", directory / f"{name}.debug", directory / name
    subprocess.run(["gcc", "-g", "-O0", "-Wl,--build-id", *flags, "-o", str(full), str(src)], check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(debug)], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    with ElfFile(str(full)) as elf:
        return Build(full, debug, stripped, elf.build_id or "")


@pytest.fixture(scope="module")
def prog(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build(tmp_path_factory.mktemp("prog"), "prog")


@pytest.fixture(scope="module")
def static_prog(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """Static, so it runs chrooted in a directory that holds nothing else."""
    return build(tmp_path_factory.mktemp("static"), "sprog", "-static")


@dataclass
class Running:
    proc: subprocess.Popen
    hidden: int  # dbg_hidden's address in the process
    main: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def frame(self, symbolizer: Symbolizer) -> Frame:
        """dbg_hidden's frame, as the symbolizer names an address inside it."""
        return symbolizer.user_frames(self.pid, read_maps(self.pid), [self.hidden + 4])[0]


@pytest.fixture
def run() -> Iterator[Callable[..., Running]]:
    started: list[subprocess.Popen] = []

    def start(*argv: str) -> Running:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        line = proc.stdout.readline()
        assert line, f"{argv} printed nothing"
        hidden, main = line.split()
        return Running(proc, int(hidden, 16), int(main, 16))

    yield start
    for proc in started:
        proc.stdin.close()
        proc.wait(timeout=10)


def no_host_debug() -> dict:
    """A symbolizer that finds nothing under the node's /usr/lib/debug (the tests' files are elsewhere)."""
    return {"debug_root": "/nonexistent"}


# -- build-id path and .gnu_debuglink, inside the process's root ------------------------------------------


def test_stripped_binary_without_debug_files_names_nothing_of_its_own(prog, run):
    frame = run(str(prog.stripped)).frame(Symbolizer(**no_host_debug()))
    assert frame.is_unknown and frame.module == "prog"


def test_build_id_debug_file_is_read_inside_the_container_root(static_prog, run, tmp_path):
    """A chrooted process whose debug file exists only under its own root's /usr/lib/debug/.build-id."""
    root = tmp_path / "ctr"
    root.mkdir()
    shutil.copy(static_prog.stripped, root / "app")
    debug = Path(debug_file_path(static_prog.build_id, str(root)))
    debug.parent.mkdir(parents=True)
    shutil.copy(static_prog.debug, debug)

    symbolizer = Symbolizer(**no_host_debug())
    assert run("chroot", str(root), "/app").frame(symbolizer) == Frame("dbg_hidden", "app")
    assert symbolizer.stats()["files_from_build_id"] == 1


def test_build_id_link_out_of_the_container_root_is_not_followed(static_prog, run, tmp_path):
    """The tenant's /usr/lib/debug/.build-id entry is a symlink to a real debug file on the node: it is
    resolved as the container would resolve it (inside its root, where nothing is), never on the node."""
    root = tmp_path / "ctr"
    root.mkdir()
    shutil.copy(static_prog.stripped, root / "app")
    outside = tmp_path / "node-only.debug"
    shutil.copy(static_prog.debug, outside)
    link = Path(debug_file_path(static_prog.build_id, str(root)))
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)

    frame = run("chroot", str(root), "/app").frame(Symbolizer(**no_host_debug()))
    assert frame.is_unknown and frame.module == "app"


def test_debuglink_finds_the_debug_file_beside_the_binary_by_crc(prog, run, tmp_path):
    app = tmp_path / "bin" / "app"
    app.parent.mkdir()
    (app.parent / ".debug").mkdir()
    # Where GDB looks first (beside the binary) holds another build's file of the same name: its CRC
    # differs, so the one in .debug/ is used.
    other = build(tmp_path / "other", "prog", "-DOTHER", "-O1")
    shutil.copy(other.debug, app.parent / "prog.debug")
    shutil.copy(prog.debug, app.parent / ".debug" / "prog.debug")
    # objcopy records the name and the CRC of the file it is given.
    subprocess.run(["objcopy", f"--add-gnu-debuglink={prog.debug}", str(prog.stripped), str(app)], check=True)
    with ElfFile(str(app)) as elf:
        assert elf.debuglink == "prog.debug" and elf.debuglink_crc is not None

    symbolizer = Symbolizer(**no_host_debug())
    assert run(str(app)).frame(symbolizer) == Frame("dbg_hidden", "app")
    assert symbolizer.stats()["files_from_debuglink"] == 1


@pytest.mark.parametrize("build_id", ["--build-id", "--build-id=none"])
def test_debuglink_with_a_stale_debug_file_only_names_nothing(run, tmp_path, build_id):
    """Without build ids the CRC alone tells the stale file; with them, both must agree."""
    ours = build(tmp_path / "ours", "prog", f"-Wl,{build_id}")
    other = build(tmp_path / "other", "prog", f"-Wl,{build_id}", "-O1")
    app = tmp_path / "app"
    subprocess.run(["objcopy", f"--add-gnu-debuglink={ours.debug}", str(ours.stripped), str(app)], check=True)
    shutil.copy(other.debug, tmp_path / "prog.debug")
    assert run(str(app)).frame(Symbolizer(**no_host_debug())).is_unknown
    shutil.copy(ours.debug, tmp_path / "prog.debug")  # the right one, in the same place: named
    assert run(str(app)).frame(Symbolizer(**no_host_debug())) == Frame("dbg_hidden", "app")


def test_debuglink_is_looked_up_in_the_process_root_not_the_node(prog, tmp_path):
    """find_symbols with the container's root: the path /maps names is the container's; the debug file is
    found under that root's /usr/lib/debug/<dir>/, and not beside the node's file of the same path."""
    root = tmp_path / "ctr"
    (root / "usr/lib/debug/opt").mkdir(parents=True)
    (root / "opt").mkdir()
    app = root / "opt" / "app"
    subprocess.run(["objcopy", f"--add-gnu-debuglink={prog.debug}", str(prog.stripped), str(app)], check=True)
    shutil.copy(prog.debug, root / "usr/lib/debug/opt/prog.debug")
    with ElfFile(str(app)) as elf:
        found = find_symbols(elf, "/opt/app", str(root), host_debug_root=None)
        assert found.source == debuginfo.DEBUGLINK
        assert "dbg_hidden" in {name for _start, _size, name in found.table}
        # The same path resolved on the node (root "/") has no such file.
        assert find_symbols(elf, "/opt/app", "/", host_debug_root=None).source == debuginfo.DYNSYM


def test_debuglink_names_that_leave_the_directory_name_no_file():
    assert debuglink_candidates("/usr/bin/app", "app.debug") == [
        "/usr/bin/app.debug",
        "/usr/bin/.debug/app.debug",
        "/usr/lib/debug/usr/bin/app.debug",
    ]
    for name in ("../../etc/shadow", "/etc/shadow", "..", ".", "", "a\0b"):
        assert debuglink_candidates("/usr/bin/app", name) == []
    assert "/usr/bin/app" not in debuglink_candidates("/usr/bin/app", "app")


# -- MiniDebugInfo ---------------------------------------------------------------------------------------


def minidebuginfo(b: Build, out: Path, payload: bytes | None = None) -> Path:
    """The stripped build with .gnu_debugdata: xz of its symbols (as Fedora makes it), or `payload`."""
    xz = out.with_suffix(".xz")
    if payload is None:
        mini = out.with_suffix(".mini")
        subprocess.run(["objcopy", "--only-keep-debug", str(b.full), str(mini)], check=True)
        subprocess.run(["xz", "-f", str(mini)], check=True)
        mini.with_suffix(".mini.xz").rename(xz)
    else:
        xz.write_bytes(payload)
    subprocess.run(
        ["objcopy", "--add-section", f".gnu_debugdata={xz}", str(b.stripped), str(out)], check=True
    )
    return out


def test_minidebuginfo_names_the_functions_dynsym_lacks(prog, run, tmp_path):
    app = minidebuginfo(prog, tmp_path / "app")
    symbolizer = Symbolizer(**no_host_debug())
    assert run(str(app)).frame(symbolizer) == Frame("dbg_hidden", "app")
    assert symbolizer.stats()["files_from_minidebuginfo"] == 1


def test_minidebuginfo_that_is_not_xz_is_counted_and_named_by_module(prog, run, tmp_path):
    app = minidebuginfo(prog, tmp_path / "app", payload=b"\xfd7zXZ\x00" + os.urandom(4096))
    errors = FileErrors()
    frame = run(str(app)).frame(Symbolizer(file_errors=errors, **no_host_debug()))
    assert frame.is_unknown and frame.module == "app"
    assert sum(errors.snapshot().values()) >= 1, errors.snapshot()


# -- a real debuginfod server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(prog, tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Debuginfod]:
    """elfutils' debuginfod serving prog's debug file (it indexes the directory once, at its start)."""
    if shutil.which("debuginfod") is None:
        pytest.fail("Debian's debuginfod is not installed: run scripts/setup.sh --test")
    served = tmp_path_factory.mktemp("served")
    shutil.copy(prog.debug, served / "prog.debug")
    with servers.Debuginfod(served, tmp_path_factory.mktemp("debuginfod-work")) as d:
        assert d.wait_serving(prog.build_id)[:4] == b"\x7fELF"
        yield d


def config(urls: tuple[str, ...] | str, cache: Path, **kw: object) -> DebuginfodConfig:
    urls = (urls,) if isinstance(urls, str) else urls
    return DebuginfodConfig(urls, cache_dir=str(cache), **kw)


def test_client_fetches_the_debug_file_and_serves_it_again_from_its_cache(prog, server, tmp_path):
    outcomes: list[str] = []
    cfg = config(server.url, tmp_path / "cache")
    cache = DebugFileCache(cfg.cache_dir, cfg.max_cache_bytes, cfg.negative_ttl_s)
    path = DebuginfodClient(cfg, cache, outcomes.append).fetch(prog.build_id)
    assert outcomes == [debuginfod.OK]
    assert Path(path).read_bytes() == prog.debug.read_bytes()
    # A server that is gone does not matter to a build id in the cache: no attempt is made.
    gone = config("http://127.0.0.1:9", tmp_path / "cache")
    again = DebuginfodClient(gone, DebugFileCache(gone.cache_dir, gone.max_cache_bytes, 600), outcomes.append)
    assert again.fetch(prog.build_id) == path
    assert outcomes == [debuginfod.OK]


def test_symbolizer_names_a_stripped_binary_once_debuginfod_answers(prog, server, run, tmp_path):
    d = Debuginfod(config(server.url, tmp_path / "cache"))
    d.start()
    try:
        symbolizer = Symbolizer(debuginfod=d, **no_host_debug())
        proc = run(str(prog.stripped))
        generation = symbolizer.generation
        assert proc.frame(symbolizer).is_unknown  # asked in the background: named by nothing yet
        wait_until(lambda: symbolizer.generation != generation, 60, "the debug file to arrive")
        assert proc.frame(symbolizer) == Frame("dbg_hidden", "prog")
        stats = symbolizer.stats()
        assert stats["files_upgraded"] == 1 and stats["files_from_debuginfod"] == 1
        assert d.stats()[debuginfod.OK] == 1 and d.stats()[debuginfod.QUEUED] == 1
        # A new symbolizer (the agent restarted) reads the cached file when it loads the binary.
        fresh = Symbolizer(debuginfod=d, **no_host_debug())
        assert proc.frame(fresh) == Frame("dbg_hidden", "prog")
        assert fresh.stats()["files_from_debuginfod"] == 1
        assert d.stats()[debuginfod.OK] == 1  # not fetched twice
    finally:
        d.stop()


def test_a_build_id_no_server_has_is_not_asked_again_even_after_a_restart(server, tmp_path):
    unknown = uuid.uuid4().hex + "00000000"
    first = Debuginfod(config(server.url, tmp_path / "cache"))
    first.start()
    try:
        first.request(unknown, lambda *a: pytest.fail("no server has it"))
        wait_until(lambda: first.pending() == 0, 60, "the lookup to end")
    finally:
        first.stop()
    assert first.stats()[debuginfod.NOT_FOUND] == 1
    restarted = Debuginfod(config(server.url, tmp_path / "cache"))
    restarted.request(unknown, lambda *a: pytest.fail("no server has it"))
    assert restarted.stats()[debuginfod.KNOWN_MISSING] == 1 and restarted.pending() == 0


def test_later_servers_are_asked_when_one_answers_badly(prog, server, tmp_path):
    with servers.HostileServer(servers.FILE, b"not an ELF file") as bad:
        outcomes: list[str] = []
        cfg = config((bad.url, server.url), tmp_path / "cache")
        cache = DebugFileCache(cfg.cache_dir, cfg.max_cache_bytes, cfg.negative_ttl_s)
        path = DebuginfodClient(cfg, cache, outcomes.append).fetch(prog.build_id)
    assert outcomes == [debuginfod.NOT_ELF, debuginfod.OK]
    assert bad.requests == [f"/buildid/{prog.build_id}/debuginfo"]
    assert Path(path).read_bytes() == prog.debug.read_bytes()


def test_redirects_are_followed_to_a_mirror_and_a_loop_ends(prog, server, tmp_path):
    with servers.HostileServer(servers.REDIRECT, server.url.encode()) as front:
        outcomes, path = fetch_bounded(config(front.url, tmp_path / "cache"), prog.build_id)
    assert outcomes == [debuginfod.OK] and Path(path).read_bytes() == prog.debug.read_bytes()
    assert front.requests == [f"/buildid/{prog.build_id}/debuginfo"]
    with servers.HostileServer(servers.REDIRECT, b"") as loop:
        outcomes, path = fetch_bounded(config(loop.url, tmp_path / "cache2"), prog.build_id)
    assert outcomes == [debuginfod.ERROR] and path is None
    assert len(loop.requests) == debuginfod.MAX_REDIRECTS + 1


# -- a hostile server ------------------------------------------------------------------------------------

CAP = 1 << 20  # the answer cap in these tests


def fetch_bounded(cfg: DebuginfodConfig, build_id: str) -> tuple[list[str], str | None]:
    """One fetch on a thread of its own; a fetch that never ends fails the test instead of hanging it."""
    outcomes: list[str] = []
    result: list[str | None] = []
    cache = DebugFileCache(cfg.cache_dir, cfg.max_cache_bytes, cfg.negative_ttl_s)
    client = DebuginfodClient(cfg, cache, outcomes.append)
    t = threading.Thread(target=lambda: result.append(client.fetch(build_id)), daemon=True)
    t.start()
    t.join(120)  # a guard against a hang, not a speed limit: the bounded fetches end within ~2 s
    assert not t.is_alive(), "the fetch did not end: the client is not bounded"
    return outcomes, result[0]


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".missing"))


@pytest.mark.parametrize(
    "mode, outcome",
    [
        (servers.HUGE_DECLARED, debuginfod.TOO_LARGE),  # refused on its Content-Length
        (servers.HUGE_CHUNKED, debuginfod.TOO_LARGE),  # refused once the body passes the cap
        (servers.TRICKLE, debuginfod.TIMEOUT),  # a byte every 50 ms: cut at the deadline
        (servers.SILENT, debuginfod.TIMEOUT),  # nothing after the request
    ],
)
def test_huge_slow_and_silent_answers_are_bounded(prog, tmp_path, mode, outcome):
    with servers.HostileServer(mode) as hostile:
        cfg = config(
            hostile.url, tmp_path / "cache", max_answer_bytes=CAP, timeout_s=1.0, connect_timeout_s=0.5
        )
        outcomes, path = fetch_bounded(cfg, prog.build_id)
    assert outcomes == [outcome] and path is None
    assert leftovers(tmp_path / "cache") == []  # no partial download stays
    assert (tmp_path / "cache" / f"{prog.build_id}.missing").exists()  # not asked again for a while
    if mode == servers.TRICKLE:
        # 1 s at a byte per 50 ms: about 20 of the 1 MiB it declared were read.
        assert hostile.sent < CAP


@pytest.mark.parametrize(
    "body, outcome",
    [
        ("garbage", debuginfod.NOT_ELF),
        ("other_build", debuginfod.WRONG_BUILD_ID),  # a real debug file, of another build
        ("stripped", debuginfod.NO_SYMBOLS),  # the right build id, without a .symtab
    ],
)
def test_answers_that_are_not_the_builds_debug_file_are_refused(prog, tmp_path, body, outcome):
    other = build(tmp_path / "other", "prog", "-O2")
    bodies = {
        "garbage": os.urandom(64 << 10),
        "other_build": other.debug.read_bytes(),
        "stripped": prog.stripped.read_bytes(),
    }
    with servers.HostileServer(servers.FILE, bodies[body]) as hostile:
        outcomes, path = fetch_bounded(config(hostile.url, tmp_path / "cache"), prog.build_id)
    assert outcomes == [outcome] and path is None
    assert leftovers(tmp_path / "cache") == []


# -- the on-disk cache -----------------------------------------------------------------------------------


def put(cache: DebugFileCache, build_id: str, size: int) -> str:
    fd, part = cache.new_part()
    with os.fdopen(fd, "wb") as f:
        f.write(b"x" * size)
    return cache.put(build_id, part)


def test_cache_holds_at_most_its_bytes_and_evicts_the_least_recently_used(tmp_path):
    cache = DebugFileCache(str(tmp_path), max_bytes=3000, negative_ttl_s=600)
    for name in ("aaaaaaaa", "bbbbbbbb", "cccccccc"):
        put(cache, name, 1000)
    assert cache.nbytes == 3000
    assert cache.get("aaaaaaaa") is not None  # used: bbbbbbbb is now the least recently used
    put(cache, "dddddddd", 1000)
    assert cache.get("bbbbbbbb") is None
    assert all(cache.get(n) for n in ("aaaaaaaa", "cccccccc", "dddddddd"))
    assert cache.nbytes == 3000
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3000

    # Restarted with a smaller bound: the oldest go at once, and a download left unfinished is removed.
    (tmp_path / ".part-abandoned").write_bytes(b"x" * 500)
    smaller = DebugFileCache(str(tmp_path), max_bytes=2000, negative_ttl_s=600)
    assert smaller.nbytes == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cccccccc.debug", "dddddddd.debug"]


def test_missing_marks_expire_after_their_ttl(tmp_path):
    now = [1000.0]
    cache = DebugFileCache(str(tmp_path), max_bytes=1 << 20, negative_ttl_s=600, clock=lambda: now[0])
    cache.mark_missing("abcdef01")
    assert cache.missing("abcdef01")
    now[0] += 601
    assert not cache.missing("abcdef01")
    # A mark garbled on disk is no mark: the build id is asked for again.
    (tmp_path / "abcdef02.missing").write_bytes(b"\xff\xfe garbage")
    assert not cache.missing("abcdef02")


def test_config_and_urls_are_checked():
    assert parse_urls(" http://a:8002  https://b/path ") == ("http://a:8002", "https://b/path")
    for bad in ("ftp://a", "a:8002", "http://", "http://a:99999"):
        with pytest.raises(ValueError, match="debuginfod server"):
            parse_urls(bad)
    with pytest.raises(ValueError):
        DebuginfodConfig(())
    with pytest.raises(ValueError, match="larger than the whole cache"):
        DebuginfodConfig(("http://a",), max_cache_bytes=1 << 20, max_answer_bytes=2 << 20)


def test_request_ignores_what_is_not_a_build_id(tmp_path):
    d = Debuginfod(config("http://127.0.0.1:9", tmp_path / "cache"))
    for bad in ("../../etc/passwd", "ABCDEF0123", "abc", "a" * 200):
        d.request(bad, lambda *a: None)
        assert d.cached(bad) is None
    assert d.pending() == 0 and not any((tmp_path / "cache").iterdir())


# -- unsymbolized frames, one per module -----------------------------------------------------------------


def test_unsymbolized_frames_merge_into_one_per_module_run():
    main = Frame("__libc_start_call_main", "libc.so.6")
    memcpy = Frame("memcpy", "libc.so.6")
    anon = unknown_frame("[anon]", 0x10)
    frames = [
        main,
        unknown_frame("sha256sum", 0x41FE),
        unknown_frame("sha256sum", 0x41FC),
        memcpy,
        unknown_frame("sha256sum", 0x2000),
        anon,
        unknown_frame("[anon]", 0x20),
    ]
    assert by_module(frames) == (
        main,
        module_frame("sha256sum"),
        memcpy,  # another module between two runs keeps them apart: the call goes out and comes back
        module_frame("sha256sum"),
        anon,  # special mappings are no files: their addresses stay (the JIT's code, say)
        unknown_frame("[anon]", 0x20),
    )
    assert module_frame("sha256sum") == Frame("sha256sum", "sha256sum")
    # What the merge hides: the innermost address of each run, and whether that run is the leaf.
    assert module_runs(frames) == (("sha256sum", 0x41FC, False), ("sha256sum", 0x2000, False))
    assert module_runs(frames[:3]) == (("sha256sum", 0x41FC, True),)
    assert unknown_offset(unknown_frame("a (b)+c", 0x10)) == 0x10 and unknown_offset(main) is None


def test_unsymbolized_addresses_are_counted_within_their_caps():
    log = UnsymbolizedAddresses(max_files=2, max_addresses=2, clock=lambda: 1000.0)
    log.add((("a", 0x10, True),), 5)
    log.add((("a", 0x20, False), ("b", 0x1, True)), 3)
    log.add((("a", 0x30, True),), 2)  # a third address of a: past its cap
    log.add((("c", 0x1, True),), 7)  # a third file: past the cap
    snap = log.snapshot(shown=1)
    assert snap == {
        "since_unix": 1000.0,
        "files": [
            {
                "file": "a",
                "samples": 10,
                "self_samples": 7,
                "addresses": [{"offset": "0x10", "samples": 5, "self_samples": 5}],
                "addresses_not_shown": 1,
                "samples_past_the_address_cap": 2,
            },
            {
                "file": "b",
                "samples": 3,
                "self_samples": 3,
                "addresses": [{"offset": "0x1", "samples": 3, "self_samples": 3}],
                "addresses_not_shown": 0,
                "samples_past_the_address_cap": 0,
            },
        ],
        "samples_past_the_file_cap": 7,
    }


def test_stop_cuts_a_fetch_in_progress_and_marks_nothing_missing(prog, tmp_path):
    """An agent that stops does not wait out a silent server: its 600 s timeout would hold it that long."""
    with servers.HostileServer(servers.SILENT) as silent:
        d = Debuginfod(config(silent.url, tmp_path / "cache", timeout_s=600.0, connect_timeout_s=600.0))
        d.start()
        d.request(prog.build_id, lambda *a: pytest.fail("a silent server sends nothing"))
        wait_until(lambda: silent.requests, 60, "the request to reach the server")
        stopping = threading.Thread(target=d.stop, daemon=True)
        stopping.start()
        stopping.join(60)  # a guard against a hang (the server stays silent for 120 s), not a speed limit
        assert not stopping.is_alive(), "stop() waited for the silent server"
    assert d.pending() == 0
    assert not any((tmp_path / "cache").iterdir())  # no mark: the server never said it has no such file
    assert sum(d.stats()[o] for o in debuginfod.OUTCOMES) == 0  # a cut attempt is no server's outcome


# -- through the resolver --------------------------------------------------------------------------------


def window_user_frames(resolver: Resolver, pid: int, addrs: tuple[int, ...]) -> tuple[list[Frame], dict]:
    """One window with 5 samples of `pid` at the user stack `addrs` (leaf first, as BPF stores it)."""
    row = SampleCount(pid, pid, 0, "prog", 7, STACK_NONE, 5)
    window = resolver.resolve(Drain(0, 1, [row], {7: addrs}))
    (sample,) = window.samples
    return list(sample.frames), window.stats


def test_resolver_merges_a_stripped_files_frames_and_names_them_once_debuginfod_answers(
    prog, server, run, tmp_path
):
    """The same process and stack id in every window: the stack named by module before the debug file
    arrives is forgotten when it does, and named by function from the next window on."""
    proc = run(str(prog.stripped))
    # Two addresses of the file, leaf first: in dbg_hidden, and in main (a return address: looked up at -1).
    addrs = (proc.hidden + 4, proc.main + 9)
    table = ProcessTable()
    assert table.refresh(proc.pid) is not None
    d = Debuginfod(config(server.url, tmp_path / "cache"))
    symbolizer = Symbolizer(debuginfod=d, **no_host_debug())

    by_address = Resolver(table, Symbolizer(**no_host_debug()), unsymbolized="address")
    frames, _stats = window_user_frames(by_address, proc.pid, addrs)
    assert [f.function for f in frames] == [
        f"[unknown] (prog+0x{a - m.start + m.offset:x})"
        for a in reversed(addrs)
        for m in [next(m for m in read_maps(proc.pid) if m.start <= a < m.end)]
    ]

    addresses = UnsymbolizedAddresses()
    resolver = Resolver(table, symbolizer, addresses=addresses)
    frames, stats = window_user_frames(resolver, proc.pid, addrs)
    assert frames == [module_frame("prog")]  # both addresses, one frame
    assert stats["user_stack_unsymbolized"] == 5
    # ... and the raw address stays on the agent: the run's innermost, where the CPU was, 5 samples.
    maps = read_maps(proc.pid)
    leaf = next(m for m in maps if m.start <= addrs[0] < m.end)
    (prog_file,) = addresses.snapshot()["files"]
    assert prog_file["file"] == "prog" and prog_file["self_samples"] == 5
    assert prog_file["addresses"] == [
        {"offset": f"0x{addrs[0] - leaf.start + leaf.offset:x}", "samples": 5, "self_samples": 5}
    ]

    # The window above queued the lookup already: read the generation before the fetch thread starts, or
    # the debug file can arrive in between and the wait below never sees it change (a fresh-clone run did).
    generation = symbolizer.generation
    d.start()
    try:
        wait_until(
            lambda: symbolizer.generation != generation,
            60,
            lambda: f"the debug file to arrive (debuginfod {d.stats()}, pending {d.pending()})",
        )
        frames, stats = window_user_frames(resolver, proc.pid, addrs)
    finally:
        d.stop()
    assert [f.function for f in frames] == ["main", "dbg_hidden"]
    assert stats["user_stack_unsymbolized"] == 0
    with pytest.raises(ValueError, match="unsymbolized must be one of"):
        Resolver(table, symbolizer, unsymbolized="hex")
