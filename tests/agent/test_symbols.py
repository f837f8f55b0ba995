"""Symbolization against real binaries built with gcc, real /proc maps and the real /proc/kallsyms."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetprof.agent.model import Frame, Mapping
from fleetprof.agent.symbols.elf import (
    ET_DYN,
    ET_EXEC,
    ElfError,
    ElfFile,
    SymbolTable,
    debug_file_path,
    load_symbols,
)
from fleetprof.agent.symbols.kallsyms import KernelSymbols
from fleetprof.agent.symbols.maps import find, parse_maps, read_maps
from fleetprof.agent.symbols.symbolizer import Symbolizer, _ProcessMemos

PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

__attribute__((noinline)) int fleetprof_alpha(int x) { return x * 3 + 1; }
__attribute__((noinline)) int fleetprof_beta(int x) { return fleetprof_alpha(x) + 7; }
static __attribute__((noinline)) int fleetprof_hidden(int x) { return fleetprof_beta(x) - 2; }

int main(void) {
    void *anon = mmap(NULL, 1 << 16, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    printf("fleetprof_alpha %p\n", (void *)fleetprof_alpha);
    printf("fleetprof_beta %p\n", (void *)fleetprof_beta);
    printf("fleetprof_hidden %p\n", (void *)fleetprof_hidden);
    printf("main %p\n", (void *)main);
    printf("getpid %p\n", dlsym(RTLD_DEFAULT, "getpid"));
    printf("anon %p\n", anon);
    printf("ready\n");
    fflush(stdout);
    char buf[16];
    while (read(0, buf, sizeof buf) > 0) {}
    return fleetprof_hidden(1) == 0;
}
"""

FUNCTIONS = ("fleetprof_alpha", "fleetprof_beta", "fleetprof_hidden", "main")

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    d = tmp_path_factory.mktemp("symprog")
    src = d / "prog.c"
    src.write_text(PROGRAM)
    base = ["gcc", "-O0", "-fno-omit-frame-pointer", "-Wl,--build-id", str(src)]
    out = {
        "pie": d / "prog_pie",
        "nopie": d / "prog_nopie",
        "dynamic": d / "prog_dynamic",
    }
    subprocess.run([*base, "-fPIE", "-pie", "-o", str(out["pie"])], check=True)
    subprocess.run([*base, "-fno-pie", "-no-pie", "-o", str(out["nopie"])], check=True)
    # -rdynamic exports the global functions into .dynsym, so the stripped copy keeps only those.
    subprocess.run([*base, "-g", "-rdynamic", "-o", str(out["dynamic"])], check=True)
    if shutil.which("strip"):
        out["stripped_dynamic"] = d / "prog_stripped_dynamic"
        subprocess.run(["strip", "-o", str(out["stripped_dynamic"]), str(out["dynamic"])], check=True)
        out["stripped"] = d / "prog_stripped"
        subprocess.run(["strip", "-o", str(out["stripped"]), str(out["pie"])], check=True)
    return out


@dataclass
class Running:
    proc: subprocess.Popen
    addrs: dict[str, int]
    mappings: list[Mapping]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def start(binary: Path) -> Running:
    proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    addrs: dict[str, int] = {}
    for line in proc.stdout:
        if line.strip() == "ready":
            break
        name, value = line.split()
        addrs[name] = int(value, 16)
    return Running(proc, addrs, read_maps(proc.pid))


@pytest.fixture
def running() -> Iterator[Callable[[Path], Running]]:
    started: list[Running] = []

    def launch(binary: Path) -> Running:
        r = start(binary)
        started.append(r)
        return r

    yield launch
    for r in started:
        r.stop()


def libc_path() -> str:
    for m in read_maps(os.getpid()):
        if re.search(r"/libc[.-][^/]*so", m.file_path):
            return m.file_path
    pytest.skip("no libc mapped into the test process")


# -- user space, end to end -----------------------------------------------------------------------------


@needs_gcc
@pytest.mark.parametrize("build", ["pie", "nopie"])
def test_user_frames_name_functions_of_pie_and_non_pie_builds(builds, running, build):
    r = running(builds[build])
    sym = Symbolizer()
    addrs = [r.addrs[f] + delta for f in FUNCTIONS for delta in (0, 4)]
    frames = sym.user_frames(r.pid, r.mappings, addrs)
    assert [f.function for f in frames] == [f for f in FUNCTIONS for _ in (0, 4)]
    assert {f.module for f in frames} == {builds[build].name}
    assert not any(f.kernel for f in frames)


@needs_gcc
def test_elf_type_distinguishes_pie_from_fixed_address_executables(builds):
    with ElfFile(builds["pie"]) as pie, ElfFile(builds["nopie"]) as nopie:
        assert pie.e_type == ET_DYN
        assert nopie.e_type == ET_EXEC
        assert any(seg.flags & 1 for seg in nopie.load_segments)


@needs_gcc
def test_libc_function_resolves_to_a_name_in_libc(builds, running):
    r = running(builds["pie"])
    (frame,) = Symbolizer().user_frames(r.pid, r.mappings, [r.addrs["getpid"] + 1])
    assert frame.function.endswith("getpid")
    assert frame.module.startswith("libc")


@needs_gcc
def test_anonymous_address_is_unknown_with_region_offset(builds, running):
    r = running(builds["pie"])
    addr = r.addrs["anon"] + 0x1A2
    region = find(r.mappings, addr)
    assert region is not None and not region.is_file
    (frame,) = Symbolizer().user_frames(r.pid, r.mappings, [addr])
    assert frame == Frame(f"[unknown] ([anon]+0x{addr - region.start:x})", "[anon]")
    assert frame.is_unknown


@needs_gcc
def test_address_outside_any_function_keeps_module_and_file_offset(builds, running):
    r = running(builds["pie"])
    first = next(m for m in r.mappings if m.file_path == str(builds["pie"]) and m.offset == 0)
    (frame,) = Symbolizer().user_frames(r.pid, r.mappings, [first.start + 0x10])  # inside the ELF header
    assert frame.function == "[unknown] (prog_pie+0x10)"
    assert frame.module == "prog_pie"


@needs_gcc
def test_unmapped_address_is_unknown_with_absolute_address(builds, running):
    r = running(builds["pie"])
    (frame,) = Symbolizer().user_frames(r.pid, r.mappings, [0x10])
    assert frame.function == "[unknown] ([unmapped]+0x10)"


@needs_gcc
def test_two_processes_of_one_binary_share_one_loaded_table(builds, running):
    a, b = running(builds["pie"]), running(builds["pie"])
    sym = Symbolizer()
    assert sym.user_frames(a.pid, a.mappings, [a.addrs["fleetprof_alpha"]])[0].function == "fleetprof_alpha"
    assert sym.user_frames(b.pid, b.mappings, [b.addrs["fleetprof_beta"]])[0].function == "fleetprof_beta"
    stats = sym.stats()
    assert stats["files_loaded"] == 1
    assert stats["files_cached"] == 1
    assert stats["cache_hits"] >= 1
    assert stats["bytes_held"] > 0


@needs_gcc
def test_the_addresses_of_one_function_share_one_frame(builds, running):
    """Stacks that differ only in where the CPU was inside a function must come out as equal tuples of the
    same frames: the resolver's content caches and the encoder compare frames by identity first."""
    r = running(builds["pie"])
    sym = Symbolizer()
    beta = r.addrs["fleetprof_beta"]
    a, b, alpha = sym.user_frames(r.pid, r.mappings, [beta + 1, beta + 4, r.addrs["fleetprof_alpha"]])
    assert a.function == b.function == "fleetprof_beta"
    assert a is b
    assert alpha.function == "fleetprof_alpha" and alpha is not a


@needs_gcc
def test_process_that_exited_is_still_symbolized_from_captured_mappings(builds):
    r = start(builds["nopie"])
    r.stop()
    assert r.proc.returncode is not None  # reaped: /proc/PID is gone
    frames = Symbolizer().user_frames(r.pid, r.mappings, [r.addrs["fleetprof_beta"] + 4])
    assert frames[0].function == "fleetprof_beta"


@needs_gcc
def test_deleted_binary_resolves_through_map_files_while_running(builds, running, tmp_path):
    copy = tmp_path / "prog_gone"
    shutil.copy(builds["pie"], copy)
    r = running(copy)
    copy.unlink()
    mappings = read_maps(r.pid)
    assert any(m.deleted and m.file_path == str(copy) for m in mappings)
    (frame,) = Symbolizer().user_frames(r.pid, mappings, [r.addrs["fleetprof_alpha"] + 2])
    assert frame == Frame("fleetprof_alpha", "prog_gone")


@needs_gcc
def test_stripped_binary_falls_back_to_dynsym(builds, running):
    if "stripped_dynamic" not in builds:
        pytest.skip("strip not installed")
    with ElfFile(builds["stripped_dynamic"]) as elf:
        assert elf.section(".symtab") is None
    r = running(builds["stripped_dynamic"])
    frames = Symbolizer(debug_root="/nonexistent").user_frames(
        r.pid, r.mappings, [r.addrs["fleetprof_alpha"] + 4, r.addrs["fleetprof_hidden"] + 4]
    )
    assert frames[0].function == "fleetprof_alpha"
    # A static function is not in .dynsym; it must not be credited to its exported neighbour.
    assert frames[1].is_unknown


@needs_gcc
def test_separate_debug_file_found_by_build_id_is_preferred(builds, running, tmp_path):
    if "stripped" not in builds or shutil.which("objcopy") is None:
        pytest.skip("binutils not installed")
    with ElfFile(builds["pie"]) as elf:
        build_id = elf.build_id
    assert build_id
    debug = Path(debug_file_path(build_id, str(tmp_path)))
    debug.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(builds["pie"]), str(debug)], check=True)

    r = running(builds["stripped"])
    addr = r.addrs["fleetprof_hidden"] + 4
    without = Symbolizer(debug_root="/nonexistent").user_frames(r.pid, r.mappings, [addr])
    with_debug = Symbolizer(debug_root=str(tmp_path)).user_frames(r.pid, r.mappings, [addr])
    assert without[0].is_unknown
    assert with_debug[0] == Frame("fleetprof_hidden", "prog_stripped")


@needs_gcc
def test_minidebuginfo_section_adds_local_functions(builds, tmp_path):
    if not all(shutil.which(t) for t in ("objcopy", "xz", "strip")):
        pytest.skip("objcopy, strip and xz are needed")
    full = builds["dynamic"]
    mini = tmp_path / "mini"
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(mini)], check=True)
    subprocess.run(["xz", str(mini)], check=True)
    target = tmp_path / "prog_mini"
    subprocess.run(["strip", "-o", str(target), str(full)], check=True)
    subprocess.run(["objcopy", "--add-section", f".gnu_debugdata={mini}.xz", str(target)], check=True)
    with ElfFile(full) as elf:
        expected = {name: start for start, _size, name in SymbolTable.from_elf(elf)}
    with ElfFile(target) as elf:
        assert elf.section(".symtab") is None
        merged = {name: start for start, _size, name in SymbolTable.from_elf(elf)}
    assert merged["fleetprof_hidden"] == expected["fleetprof_hidden"]
    assert merged["fleetprof_alpha"] == expected["fleetprof_alpha"]


@needs_gcc
def test_build_id_matches_readelf(builds):
    if shutil.which("readelf") is None:
        pytest.skip("readelf not installed")
    out = subprocess.run(["readelf", "-n", str(builds["pie"])], capture_output=True, text=True, check=True)
    match = re.search(r"Build ID: ([0-9a-f]+)", out.stdout)
    assert match
    with ElfFile(builds["pie"]) as elf:
        assert elf.build_id == match.group(1)


def test_build_id_and_debuglink_of_libc_match_readelf():
    path = libc_path()
    if shutil.which("readelf") is None:
        pytest.skip("readelf not installed")
    out = subprocess.run(["readelf", "-n", "--debug-dump=links", path], capture_output=True, text=True).stdout
    with ElfFile(path) as elf:
        build_id = re.search(r"Build ID: ([0-9a-f]+)", out)
        assert elf.build_id == (build_id.group(1) if build_id else None)
        link = re.search(r"Separate debug info file: (\S+)", out)
        if link:
            assert elf.debuglink == link.group(1)


def test_libc_symbol_table_parses_with_over_a_thousand_functions():
    path = libc_path()
    with ElfFile(path) as elf:
        own = SymbolTable.from_elf(elf)
        best = load_symbols(elf)
    # (How long this takes is bench/symbols.py's business, not a test's.)
    assert len(own) > 1000
    assert len(best) >= len(own)
    assert 0 < best.nbytes < 8 << 20
    getpid = [(start, size) for start, size, name in best if name in ("getpid", "__getpid")]
    assert getpid
    start, size = getpid[0]
    assert best.lookup(start + max(size - 1, 0))[0].endswith("getpid")


# -- symbol table rules, on hand-built tables -----------------------------------------------------------

STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
STT_OBJECT, STT_FUNC = 1, 2


def symtab(entries: list[tuple[str, int, int, int, int]]) -> tuple[bytes, bytes]:
    """(.symtab, .strtab) bytes for (name, value, size, bind, type) entries."""
    strtab = bytearray(b"\0")
    syms = [struct.pack("<IBBHQQ", 0, 0, 0, 0, 0, 0)]
    for name, value, size, bind, kind in entries:
        syms.append(struct.pack("<IBBHQQ", len(strtab), (bind << 4) | kind, 0, 1, value, size))
        strtab += name.encode() + b"\0"
    return b"".join(syms), bytes(strtab)


def test_aliases_prefer_global_then_shortest_name():
    table = SymbolTable.from_sections(
        [
            symtab(
                [
                    ("local_alias", 0x1000, 16, STB_LOCAL, STT_FUNC),
                    ("weak_alias", 0x1000, 16, STB_WEAK, STT_FUNC),
                    ("global_long_name", 0x1000, 16, STB_GLOBAL, STT_FUNC),
                    ("zz", 0x2000, 8, STB_WEAK, STT_FUNC),
                    ("yyy", 0x2000, 8, STB_WEAK, STT_FUNC),
                    ("aa", 0x2000, 8, STB_WEAK, STT_FUNC),
                ]
            )
        ]
    )
    assert len(table) == 2
    assert table.lookup(0x1004) == ("global_long_name", 4)
    assert table.lookup(0x2000) == ("aa", 0)


def test_address_past_a_sized_symbol_is_not_that_symbol_but_zero_size_reaches_the_next():
    table = SymbolTable.from_sections(
        [
            symtab(
                [
                    ("sized", 0x1000, 0x10, STB_GLOBAL, STT_FUNC),
                    ("unsized", 0x2000, 0, STB_GLOBAL, STT_FUNC),
                    ("next", 0x3000, 0x10, STB_GLOBAL, STT_FUNC),
                    ("data", 0x4000, 0x10, STB_GLOBAL, STT_OBJECT),
                ]
            )
        ]
    )
    assert table.lookup(0xFFF) is None
    assert table.lookup(0x100F) == ("sized", 0xF)
    assert table.lookup(0x1010) is None
    assert table.lookup(0x2FFC) == ("unsized", 0xFFC)
    assert table.lookup(0x4004) is None  # objects are not functions
    assert len(table) == 3


def test_compressed_names_give_the_same_answers_as_plain():
    entries = [(f"_ZN4llvm{i:06d}functionNameThatIsLong", 0x1000 + 0x40 * i, 0x30, 1, 2) for i in range(5000)]
    source = symtab(entries)
    plain = SymbolTable.from_sections([source], compress_above=1 << 30)
    packed = SymbolTable.from_sections([source], compress_above=0)
    assert not plain.compressed and packed.compressed
    assert packed.nbytes < plain.nbytes
    for i in range(0, 5000, 7):
        addr = 0x1000 + 0x40 * i + 5
        assert packed.lookup(addr) == plain.lookup(addr) == (entries[i][0], 5)
    assert packed.lookup(0x1000 + 0x40 * 4999 + 0x30) is None


def test_hundred_thousand_symbols_are_all_found_by_address():
    """Every symbol of a large table at its start, inside it and in the gap past its size. (The parse time
    of such a table is measured by bench/symbols.py.)"""
    entries = [(f"function_{i}", 0x400000 + 0x20 * i, 0x18, 1, 2) for i in range(100_000)]
    source = symtab(entries)
    table = SymbolTable.from_sections([source])
    assert len(table) == 100_000
    assert table.lookup(0x400000 + 0x20 * 76543 + 3) == ("function_76543", 3)
    for i in range(0, 100_000, 997):
        start = 0x400000 + 0x20 * i
        assert table.lookup(start) == (f"function_{i}", 0)
        assert table.lookup(start + 0x17) == (f"function_{i}", 0x17)
        assert table.lookup(start + 0x18) is None  # past its size, before the next one
    assert table.lookup(0x400000 - 1) is None
    assert table.lookup(0x400000 + 0x20 * 99_999 + 0x18) is None


def test_non_elf_data_raises_elf_error(tmp_path):
    with pytest.raises(ElfError):
        ElfFile(b"#!/bin/sh\necho not elf\n" * 4)
    with pytest.raises(ElfError):
        ElfFile(b"\x7fELF" + b"\x01\x01" + b"\0" * 58)  # 32-bit
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ElfError):
        ElfFile(empty)


@needs_gcc
def test_elf_file_over_a_descriptor_reads_sections_and_closes_it(builds):
    fd = os.open(builds["pie"], os.O_RDONLY | os.O_CLOEXEC)
    elf = ElfFile(fd)  # owns fd from here on
    names = {name for _start, _size, name in SymbolTable.from_elf(elf)}
    assert set(FUNCTIONS) <= names
    with open("/proc/self/maps") as f:
        assert str(builds["pie"]) not in f.read()  # read with pread, never mapped
    elf.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert elf.build_id and elf.sections  # headers outlive the descriptor; section data does not
    with pytest.raises(ValueError):
        elf.section_data(elf.section(".symtab"))


# -- caching --------------------------------------------------------------------------------------------


def test_unreadable_file_is_cached_as_failed_and_retried_after_the_delay(tmp_path):
    script = tmp_path / "not_elf.sh"
    script.write_text("#!/bin/sh\n" + "echo x\n" * 1000)
    st = os.stat(script)
    mapping = Mapping(
        0x10000, 0x11000, 0, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino, str(script), "r-xp"
    )
    now = [100.0]
    sym = Symbolizer(retry_after_s=60, clock=lambda: now[0])
    pid = 2**22 + 12345  # not a live pid: only the host path can be opened
    frames = sym.user_frames(pid, [mapping], [0x10010, 0x10020])
    assert [f.function for f in frames] == ["[unknown] (not_elf.sh+0x10)", "[unknown] (not_elf.sh+0x20)"]
    assert sym.stats()["load_failures"] == 1
    assert sym.stats()["files_failed"] == 1
    now[0] += 59
    sym.user_frames(pid, [mapping], [0x10010])
    assert sym.stats()["load_failures"] == 1
    now[0] += 2
    sym.user_frames(pid, [mapping], [0x10010])
    assert sym.stats()["load_failures"] == 2


def test_replaced_file_with_another_inode_is_not_used(tmp_path):
    target = tmp_path / "lib.so"
    shutil.copy(libc_path(), target)
    st = os.stat(target)
    mapping = Mapping(0x10000, 0x20000, 0, 0, 0, st.st_ino + 1, str(target), "r-xp")
    (frame,) = Symbolizer().user_frames(2**22 + 12345, [mapping], [0x10100])
    assert frame.function == "[unknown] (lib.so+0x100)"


@needs_gcc
def test_lru_evicts_by_file_count_and_by_bytes(builds, running):
    r = running(builds["pie"])
    addrs = [r.addrs["fleetprof_alpha"], r.addrs["getpid"]]
    one_file = Symbolizer(max_files=1)
    assert [f.module for f in one_file.user_frames(r.pid, r.mappings, addrs)][0] == "prog_pie"
    stats = one_file.stats()
    assert stats["files_cached"] == 1 and stats["files_evicted"] == 1

    tiny = Symbolizer(max_bytes=1)
    frames = tiny.user_frames(r.pid, r.mappings, addrs)
    # the process described again (new mappings): its addresses are looked up in the files again
    frames += tiny.user_frames(r.pid, list(r.mappings), addrs)
    assert frames[0].function == frames[2].function == "fleetprof_alpha"
    assert tiny.stats()["files_cached"] == 1
    assert tiny.stats()["files_loaded"] == 4


@needs_gcc
def test_a_process_s_addresses_are_named_once_per_description_of_it(builds, running):
    """The per-process memo: an address named before is answered without the files (no load even when
    the file's table was evicted since), a process described again (another mappings object) is read
    afresh, and an address outside its mappings is never memoised (the resolver re-reads the mappings
    then: a dlopen)."""
    r = running(builds["pie"])
    addrs = [r.addrs["fleetprof_alpha"], r.addrs["getpid"]]
    sym = Symbolizer(max_bytes=1)  # every load evicts the other file
    first = sym.user_frames(r.pid, r.mappings, addrs)
    loaded = sym.stats()["files_loaded"]
    again = sym.user_frames(r.pid, r.mappings, addrs)
    assert again == first and sym.stats()["files_loaded"] == loaded
    assert sym.stats()["memo_hits"] >= 2
    sym.user_frames(r.pid, list(r.mappings), addrs)
    assert sym.stats()["files_loaded"] == loaded + 2
    outside = max(m.end for m in r.mappings) + 0x1000
    (frame,) = sym.user_frames(r.pid, r.mappings, [outside])
    assert frame.module == "[unmapped]"
    described = [*r.mappings, Mapping(outside, outside + 0x1000, 0, 0, 0, 0, "[anon:jit]", "r-xp")]
    (frame,) = sym.user_frames(r.pid, described, [outside])
    assert frame.module != "[unmapped]"


def test_process_memos_stay_within_their_bound() -> None:
    memos = _ProcessMemos(max_entries=100)
    held = {}
    for pid in range(10):
        mappings = held[pid] = []
        memo = memos.of(pid, mappings)
        memo.update({a: Frame(f"f{a}", "m") for a in range(20)})
        memos.grew(pid, 20)
        assert memos.entries == sum(len(m) for _, m in memos.values()) <= 100
    assert list(memos) == [5, 6, 7, 8, 9]  # the least recent went first
    assert memos.of(9, held[9]) is memos[9][1] and len(memos[9][1]) == 20  # the same description: kept
    assert memos.of(9, []) == {} and memos.entries == 80  # described again: a new memo
    big = memos.of(3, held[3])
    big.update({a: Frame(f"f{a}", "m") for a in range(26)})
    memos.grew(3, 26)  # past a quarter of the bound alone: starts over
    assert big == {} and memos.entries == sum(len(m) for _, m in memos.values())


# -- /proc/PID/maps --------------------------------------------------------------------------------------

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234567                    /usr/bin/my prog
55d0c0a01000-55d0c0a02000 r-xp 00001000 fd:01 1234567                    /usr/bin/my prog
7f0000000000-7f0000010000 rwxp 00000000 00:00 0
7f1000000000-7f1000100000 r-xp 00002000 00:1f 42                         /tmp/libgone.so (deleted)
7ffd1c7f0000-7ffd1c7f2000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def test_parse_maps_keeps_spaces_and_deleted_marker():
    maps = parse_maps(MAPS)
    assert len(maps) == 6
    prog = maps[1]
    assert (prog.start, prog.end, prog.offset) == (0x55D0C0A01000, 0x55D0C0A02000, 0x1000)
    assert (prog.dev_major, prog.dev_minor, prog.inode) == (0xFD, 0x01, 1234567)
    assert prog.path == "/usr/bin/my prog" and prog.is_exec and prog.is_file
    assert prog.display_name == "my prog"
    gone = maps[3]
    assert gone.deleted and gone.file_path == "/tmp/libgone.so" and gone.display_name == "libgone.so"
    assert not maps[2].is_file and maps[2].display_name == "[anon]"
    assert maps[4].display_name == "[vdso]" and not maps[4].is_file
    assert [m.path for m in parse_maps(MAPS, exec_only=True)][0] == "/usr/bin/my prog"
    assert len(parse_maps(MAPS, exec_only=True)) == 5


def test_find_returns_the_containing_mapping_or_none():
    maps = parse_maps(MAPS)
    assert find(maps, 0x55D0C0A01FFF) is maps[1]
    assert find(maps, 0x55D0C0A02000) is None
    assert find(maps, 0x1000) is None
    assert find(maps, 0x7FFD1C7F0010) is maps[4]
    assert find([], 0x1000) is None


def test_read_maps_of_this_process_finds_python_code():
    maps = read_maps(os.getpid(), exec_only=True)
    assert maps and all(m.is_exec for m in maps)
    assert maps == sorted(maps, key=lambda m: m.start)


# -- kernel ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kallsyms_text() -> str:
    try:
        with open("/proc/kallsyms") as f:
            text = f.read()
    except OSError as e:
        pytest.skip(f"/proc/kallsyms unreadable: {e}")
    if not re.search(r"^0*[1-9a-f][0-9a-f]* [tT] ", text, re.M):
        pytest.skip("kallsyms addresses are hidden (kptr_restrict)")
    return text


def kallsyms_address(text: str, name: str) -> int | None:
    match = re.search(rf"^([0-9a-f]+) [tT] {re.escape(name)}$", text, re.M)
    return int(match.group(1), 16) if match else None


def test_kernel_symbols_resolve_known_syscall_entry_points(kallsyms_text):
    ksyms = KernelSymbols(kallsyms_text)
    assert ksyms.available and len(ksyms) > 1000
    checked = 0
    for name in ("__x64_sys_getppid", "do_sys_openat2", "schedule"):
        addr = kallsyms_address(kallsyms_text, name)
        if addr is None:
            continue
        found = ksyms.lookup(addr + 4)
        # Another global alias at the same address would win; the address itself must still match.
        assert found is not None and found[1] is None
        assert found[0] == name or ksyms.address_of(found[0]) == addr
        checked += 1
    assert checked >= 2
    assert ksyms.nbytes < 64 * len(ksyms)


def test_kernel_module_symbols_carry_their_module(kallsyms_text):
    line = re.search(r"^([0-9a-f]+) [tT] (\S+)\s+\[(\S+)\]$", kallsyms_text, re.M)
    if line is None:
        pytest.skip("no module text symbols on this kernel")
    ksyms = KernelSymbols(kallsyms_text)
    found = ksyms.lookup(int(line.group(1), 16))
    assert found is not None and found[1] == line.group(3)


def test_hidden_kernel_addresses_make_symbols_unavailable():
    text = "0000000000000000 T _stext\n0000000000000000 t do_sys_openat2\n0000000000000000 T foo\t[mod]\n"
    ksyms = KernelSymbols(text)
    assert not ksyms.available and len(ksyms) == 0
    assert ksyms.lookup(0xFFFFFFFF81000000) is None


def test_kallsyms_keeps_text_and_weak_text_only():
    text = (
        "ffffffff81000000 T _stext\n"
        "ffffffff81000100 t local_fn\n"
        "ffffffff81000200 W weak_fn\n"
        "ffffffff81000300 T _etext\n"
        "ffffffff82000000 D some_data\n"
        "ffffffff82000100 W weak_data\n"
        "ffffffffc0001000 t mod_fn\t[nvidia]\n"
    )
    ksyms = KernelSymbols(text)
    assert ksyms.lookup(0xFFFFFFFF81000104) == ("local_fn", None)
    assert ksyms.lookup(0xFFFFFFFF81000204) == ("weak_fn", None)
    assert ksyms.lookup(0xFFFFFFFF82000004) is None
    assert ksyms.lookup(0xFFFFFFFF82000104) is None
    assert ksyms.lookup(0xFFFFFFFFC0001008) == ("mod_fn", "nvidia")
    assert ksyms.lookup(0x7F0000000000) is None


def test_symbolizer_kernel_frames_name_kernel_and_unknown_addresses(kallsyms_text, tmp_path):
    path = tmp_path / "kallsyms"
    path.write_text(kallsyms_text)
    addr = kallsyms_address(kallsyms_text, "__x64_sys_getppid") or kallsyms_address(kallsyms_text, "schedule")
    if addr is None:
        pytest.skip("no well-known symbol to check")
    sym = Symbolizer(kallsyms_path=str(path))
    frames = sym.kernel_frames([addr + 1, 0x1000])
    ksyms = KernelSymbols(kallsyms_text)
    assert frames[0] == Frame(ksyms.lookup(addr)[0], "[kernel]", True)
    assert frames[1] == Frame("[unknown] ([kernel]+0x1000)", "[kernel]", True)


def test_symbolizer_without_kallsyms_gives_unknown_kernel_frames(tmp_path):
    sym = Symbolizer(kallsyms_path=str(tmp_path / "missing"))
    (frame,) = sym.kernel_frames([0xFFFFFFFF81234567])
    assert frame.function == "[unknown] ([kernel]+0xffffffff81234567)"
    assert frame.kernel
