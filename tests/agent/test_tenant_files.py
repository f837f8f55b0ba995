"""The agent reads tenants' files as root: a file truncated while read, a decompression bomb, a symlink out of
a container's root, a FIFO where a library should be: each is refused and counted, never a crash (SIGBUS),
an allocation the size of the bomb, a hang, or a host file's symbols. Real files built with gcc, real
processes (one chrooted), both ways of resolving a path inside a root (openat2 and the fallback walk)."""

from __future__ import annotations

import errno
import json
import lzma
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from fleetprof.agent.metrics import AgentCounters, build_registry
from fleetprof.agent.model import Mapping
from fleetprof.agent.process import rootfs
from fleetprof.agent.process.rootfs import FileErrors, UnsafeFile, open_in_root, walk_in_root
from fleetprof.agent.python.detect import UNREADABLE, Detector
from fleetprof.agent.shipper import ShipperStats
from fleetprof.agent.symbols import elf as elfmod
from fleetprof.agent.symbols.elf import (
    MAX_MINI_DEBUGINFO_BYTES,
    MAX_SECTION_BYTES,
    ElfError,
    ElfFile,
    SymbolTable,
    debug_file_path,
    load_symbols,
)
from fleetprof.agent.symbols.maps import read_maps
from fleetprof.agent.symbols.symbolizer import Symbolizer

PROGRAM = r"""
#include <stdio.h>
#include <unistd.h>

__attribute__((noinline)) int tenant_function(int x) { return x * 5 + 3; }

int main(void) {
    printf("%p\n", (void *)tenant_function);
    fflush(stdout);
    char buf[16];
    while (read(0, buf, sizeof buf) > 0) {}
    return tenant_function(1) == 0;
}
"""
# The tenant's program and the host's secret file share a build id: a debug-file lookup that left the
# container's root would accept the host file as the tenant's debug file.
BUILD_ID = "f1ee7f0f" + "5a" * 16
HOST_MARKER = "host_secret_marker"
GIB = 1 << 30
SHF_COMPRESSED = 0x800
DEAD_PID = 2**22 + 4321  # above pid_max's ceiling: never a live process

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mknod)")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not all(shutil.which(t) for t in ("gcc", "strip", "objcopy")):
        pytest.skip("gcc and binutils are needed")
    d = tmp_path_factory.mktemp("tenant")
    src = d / "prog.c"
    src.write_text(PROGRAM)
    static = ["gcc", "-O0", "-static", "-no-pie", f"-Wl,--build-id=0x{BUILD_ID}", str(src)]
    out = {name: d / name for name in ("prog", "stripped", "tenant.debug", "host", "host.debug", "dynamic")}
    subprocess.run([*static, "-o", str(out["prog"])], check=True)
    subprocess.run(["strip", "-o", str(out["stripped"]), str(out["prog"])], check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(out["prog"]), str(out["tenant.debug"])], check=True)
    # The same code under another name: had the lookup reached it, the tenant's address would read as this.
    subprocess.run([*static, f"-Dtenant_function={HOST_MARKER}", "-o", str(out["host"])], check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(out["host"]), str(out["host.debug"])], check=True)
    subprocess.run(["gcc", "-O0", "-g", str(src), "-o", str(out["dynamic"])], check=True)
    return out


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: with the kernel's openat2(RESOLVE_IN_ROOT), and with openat2 missing (ENOSYS, as on
    Linux < 5.6), which makes open_in_root fall back to walk_in_root."""
    if request.param == "openat2":
        try:
            os.close(rootfs.openat2(-100, "/", os.O_PATH, rootfs.RESOLVE_IN_ROOT))  # AT_FDCWD
        except OSError as e:
            if e.errno == errno.ENOSYS:
                pytest.skip("this kernel has no openat2")
            raise
    else:

        def missing(*_args: object) -> int:
            raise OSError(errno.ENOSYS, "openat2 missing")

        monkeypatch.setattr(rootfs, "openat2", missing)
    return request.param


def read_in_root(root: Path, path: str) -> bytes:
    fd = open_in_root(str(root), path)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def child(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter (a crash there must not take the test with it); its last stdout line
    is JSON. Asserts it exited 0: a SIGBUS shows here as returncode -7."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"the reading process died (returncode {proc.returncode}): {proc.stderr[-2000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- resolving paths inside a root ------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(root, host): a container root and, beside it, a host directory with a secret."""
    root, host = tmp_path / "root", tmp_path / "host"
    (root / "usr/lib").mkdir(parents=True)
    (root / "etc").mkdir()
    host.mkdir()
    (host / "secret").write_bytes(b"HOST SECRET")
    (root / "usr/lib/real.so").write_bytes(b"tenant library")
    (root / "etc/secret").write_bytes(b"tenant's own /etc/secret")
    return root, host


def test_absolute_symlink_is_resolved_in_the_root_not_on_the_host(tree, resolution):
    root, host = tree
    (root / "usr/lib/x.so").symlink_to(host / "secret")  # absolute: the host's path
    with pytest.raises(FileNotFoundError):
        read_in_root(root, "/usr/lib/x.so")
    (root / "usr/lib/etc.so").symlink_to("/etc/secret")
    assert read_in_root(root, "/usr/lib/etc.so") == b"tenant's own /etc/secret"
    (root / "usr/lib/good.so").symlink_to("/usr/lib/real.so")
    assert read_in_root(root, "/usr/lib/good.so") == b"tenant library"


def test_dotdot_stops_at_the_root(tree, resolution):
    root, host = tree
    climb = "../" * 12 + str(host / "secret").lstrip("/")
    (root / "usr/lib/up.so").symlink_to(climb)
    with pytest.raises(FileNotFoundError):
        read_in_root(root, "/usr/lib/up.so")
    with pytest.raises(FileNotFoundError):
        read_in_root(root, "/" + climb)
    assert read_in_root(root, "/../../usr/../usr/lib/./real.so") == b"tenant library"


def test_symlinked_directories_and_chains_inside_the_root_work(tree, resolution):
    root, _host = tree
    (root / "lib64").symlink_to("/usr/lib")  # merged-/usr style, absolute
    (root / "usr/lib/a.so").symlink_to("b.so")
    (root / "usr/lib/b.so").symlink_to("../lib/real.so")
    assert read_in_root(root, "/lib64/a.so") == b"tenant library"


def test_symlink_loop_is_refused_and_named(tree, resolution):
    root, _host = tree
    (root / "usr/lib/loop1.so").symlink_to("loop2.so")
    (root / "usr/lib/loop2.so").symlink_to("/usr/lib/loop1.so")
    with pytest.raises(UnsafeFile) as refused:
        read_in_root(root, "/usr/lib/loop1.so")
    assert refused.value.reason == rootfs.ESCAPES_ROOT


def test_magic_link_out_of_the_root_is_not_followed(resolution):
    # /proc/self/root is a magic link to "/": from the root /proc/self it leads out of that root.
    if resolution == "openat2":
        with pytest.raises(UnsafeFile) as refused:
            read_in_root(Path("/proc/self"), "root/etc/hostname")
        assert refused.value.reason == rootfs.ESCAPES_ROOT
    else:  # the walk reads the link as text and resolves "/" inside the root: /proc/self/etc/hostname
        with pytest.raises(FileNotFoundError):
            read_in_root(Path("/proc/self"), "root/etc/hostname")


@needs_root
def test_fifo_device_and_directory_are_refused_without_opening_them(tree, resolution):
    root, _host = tree
    os.mkfifo(root / "usr/lib/fifo.so")  # a plain open() for reading would block until a writer comes
    os.mknod(root / "usr/lib/null.so", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    for path in ("/usr/lib/fifo.so", "/usr/lib/null.so", "/usr/lib", "/"):
        with pytest.raises(UnsafeFile) as refused:
            read_in_root(root, path)
        assert refused.value.reason == rootfs.NOT_REGULAR, path


def test_another_inode_than_the_mapped_one_is_refused(tree, resolution):
    root, _host = tree
    ino = os.stat(root / "usr/lib/real.so").st_ino
    os.close(open_in_root(str(root), "/usr/lib/real.so", ino))
    with pytest.raises(OSError) as stale:
        open_in_root(str(root), "/usr/lib/real.so", ino + 1)
    assert stale.value.errno == errno.ESTALE


def test_walk_alone_matches_the_kernel(tree):
    root, host = tree
    (root / "usr/lib/x.so").symlink_to(host / "secret")
    (root / "usr/lib/good.so").symlink_to("/usr/lib/real.so")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = walk_in_root(root_fd, "/usr/lib/good.so")
        assert os.fstat(fd).st_ino == os.stat(root / "usr/lib/real.so").st_ino
        os.close(fd)
        with pytest.raises(FileNotFoundError):
            walk_in_root(root_fd, "/usr/lib/x.so")
    finally:
        os.close(root_fd)


# -- a real process in another root ----------------------------------------------------------------------


@pytest.fixture
def chrooted(builds, tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen, int]]:
    """(its root, the process, tenant_function's address): the stripped static program run by chroot."""
    if os.geteuid() != 0 or shutil.which("chroot") is None:
        pytest.skip("needs root and chroot")
    root = tmp_path / "container"
    root.mkdir()
    shutil.copy(builds["stripped"], root / "prog")
    proc = subprocess.Popen(["chroot", str(root), "/prog"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        addr = int(proc.stdout.readline(), 16)
        yield root, proc, addr
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def install_debug_link(root: Path, target: str) -> None:
    link = Path(debug_file_path(BUILD_ID, str(root)))
    link.parent.mkdir(parents=True)
    link.symlink_to(target)


@pytest.mark.parametrize("link", ["absolute", "dotdot"])
def test_debug_file_symlink_to_the_host_is_never_followed(builds, chrooted, tmp_path, resolution, link):
    root, proc, addr = chrooted
    host_debug = tmp_path / "host-only" / "secret.debug"
    host_debug.parent.mkdir()
    shutil.copy(builds["host.debug"], host_debug)
    with ElfFile(host_debug) as secret:  # what a lookup that escaped would find: the same build id
        assert secret.build_id == BUILD_ID
        assert SymbolTable.from_elf(secret).lookup(addr)[0] == HOST_MARKER
    target = str(host_debug) if link == "absolute" else "../" * 20 + str(host_debug).lstrip("/")
    install_debug_link(root, target)

    sym = Symbolizer(debug_root="/nonexistent")
    (frame,) = sym.user_frames(proc.pid, read_maps(proc.pid), [addr])
    assert HOST_MARKER not in frame.function
    assert frame.is_unknown and frame.module == "prog"  # stripped, and no debug file inside its root
    with ElfFile(open_in_root(f"/proc/{proc.pid}/root", "/prog")) as elf:
        names = {name for _start, _size, name in load_symbols(elf, [f"/proc/{proc.pid}/root"])}
    assert HOST_MARKER not in names


def test_debug_file_symlink_inside_the_root_is_followed_there(builds, chrooted, resolution):
    root, proc, addr = chrooted
    inside = root / "usr/lib/debug/real/prog.debug"
    inside.parent.mkdir(parents=True)
    shutil.copy(builds["tenant.debug"], inside)
    install_debug_link(root, "/usr/lib/debug/real/prog.debug")  # absolute, meant inside the container

    sym = Symbolizer(debug_root="/nonexistent")
    (frame,) = sym.user_frames(proc.pid, read_maps(proc.pid), [addr + 1])
    assert frame.function == "tenant_function" and frame.module == "prog"
    assert sym.file_errors.snapshot() == dict.fromkeys(rootfs.REASONS, 0)


def test_debug_symlink_loop_is_counted(builds, chrooted, resolution):
    root, proc, addr = chrooted
    install_debug_link(root, os.path.basename(debug_file_path(BUILD_ID)))  # points at itself
    sym = Symbolizer(debug_root="/nonexistent")
    (frame,) = sym.user_frames(proc.pid, read_maps(proc.pid), [addr])
    assert frame.is_unknown
    assert sym.file_errors.snapshot()[rootfs.ESCAPES_ROOT] == 1


# -- truncated while read --------------------------------------------------------------------------------

TRUNCATE_WHILE_READING = r"""
import json, os, sys
from fleetprof.agent.symbols.elf import ElfError, ElfFile, SymbolTable
path = sys.argv[1]
elf = ElfFile(path)  # headers read; the sections are still to come
os.truncate(path, 300)  # the tenant truncates the file under us
try:
    result = {"symbols": len(SymbolTable.from_elf(elf))}
except ElfError as e:
    result = {"reason": e.reason, "error": str(e)}
elf.close()
print(json.dumps(result))
"""


def test_file_truncated_while_read_is_a_clean_error_not_sigbus(builds, tmp_path):
    victim = tmp_path / "victim"
    shutil.copy(builds["dynamic"], victim)
    with ElfFile(victim) as elf:
        assert len(SymbolTable.from_elf(elf)) > 3  # it had symbols before the truncation
    result = child(TRUNCATE_WHILE_READING, str(victim))  # returncode -7 (SIGBUS) with an mmap
    assert result["reason"] == rootfs.TRUNCATED, result


def test_truncated_file_is_counted_by_the_symbolizer(builds, tmp_path):
    short = tmp_path / "short"
    short.write_bytes(builds["dynamic"].read_bytes()[:4096])  # headers claim sections past the end
    mapping = host_mapping(short)
    sym = Symbolizer(debug_root="/nonexistent")
    (frame,) = sym.user_frames(DEAD_PID, [mapping], [mapping.start + 0x10])
    assert frame.is_unknown
    assert sym.file_errors.snapshot()[rootfs.TRUNCATED] == 1
    assert sym.stats()["load_failures"] == 1


def host_mapping(path: Path) -> Mapping:
    """A mapping of `path` as a process that has exited left it: only the host path can be opened."""
    return Mapping(0x400000, 0x500000, 0, 0, 0, os.stat(path).st_ino, str(path), "r-xp")


# -- decompression bombs ---------------------------------------------------------------------------------


def zlib_zeros(n_mib: int) -> bytes:
    """A zlib stream that inflates to n_mib MiB of zeros (~1 KiB per MiB), cheap to make: after a full
    flush every 1 MiB block compresses to the same bytes. No end: a reader that stops at its cap never
    gets there, and one that does not is what the test catches."""
    c = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    first = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    rest = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    return first + rest * (n_mib - 1)


def replace_section(
    src: Path, dst: Path, name: str, payload: bytes, flags: int = 0, size: int | None = None
) -> None:
    """Copy the ELF file `src` to `dst` with section `name` now holding `payload` (appended to the file),
    its sh_flags or'ed with `flags`; `size` makes its header claim that many bytes instead."""
    data = bytearray(src.read_bytes())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    shdr = struct.Struct("<IIQQQQIIQQ")
    headers = [list(shdr.unpack_from(data, shoff + i * shentsize)) for i in range(shnum)]
    names = bytes(data[headers[shstrndx][4] : headers[shstrndx][4] + headers[shstrndx][5]])
    index = next(i for i, h in enumerate(headers) if names[h[0] : names.index(b"\0", h[0])] == name.encode())
    data += b"\0" * (-len(data) % 8)
    header = headers[index]
    header[2] |= flags
    header[4], header[5] = len(data), len(payload) if size is None else size
    data += payload
    shdr.pack_into(data, shoff + index * shentsize, *header)
    dst.write_bytes(data)


def compressed(payload: bytes, declared: int, ch_type: int = 1) -> bytes:
    return struct.pack("<IIQQ", ch_type, 0, declared, 1) + payload


LOAD_IN_CHILD = r"""
import json, os, re, sys
from fleetprof.agent.symbols.maps import Mapping
from fleetprof.agent.symbols.symbolizer import Symbolizer
path = sys.argv[1]
sym = Symbolizer(proc_root="/nonexistent", debug_root="/nonexistent")
mapping = Mapping(0x400000, 0x500000, 0, 0, 0, os.stat(path).st_ino, path, "r-xp")
(frame,) = sym.user_frames(4198625, [mapping], [0x401000])
with open("/proc/self/status") as f:
    peak_kib = int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1])  # not ru_maxrss: see bench/symbols.py
print(json.dumps({"frame": frame.function, "errors": sym.file_errors.snapshot(), "peak_kib": peak_kib}))
"""


@pytest.mark.parametrize(
    "declared",
    [
        pytest.param(GIB, id="declares-1GiB-over-the-cap"),
        pytest.param(1 << 20, id="declares-1MiB-inflates-1GiB"),
    ],
)
def test_zlib_section_bomb_is_refused_counted_and_never_inflated(builds, tmp_path, declared):
    bomb = tmp_path / "zlib_bomb"
    replace_section(
        builds["dynamic"], bomb, ".strtab", compressed(zlib_zeros(1024), declared), SHF_COMPRESSED
    )
    result = child(LOAD_IN_CHILD, str(bomb))
    assert result["frame"].startswith("[unknown]")
    assert result["errors"][rootfs.DECOMPRESSION_BOMB] == 1, result
    # The bomb inflates to 1 GiB; the reader allocates at most the declared size (1 MiB) or nothing: its
    # peak is the interpreter's own (~20 MiB here).
    assert result["peak_kib"] < 64 << 10, result


def test_xz_minidebuginfo_bomb_is_refused_counted_and_capped(builds, tmp_path):
    inflated_mib = 512
    packer = lzma.LZMACompressor(preset=0)
    chunk = b"\0" * (1 << 20)
    xz = b"".join(packer.compress(chunk) for _ in range(inflated_mib)) + packer.flush()
    (tmp_path / "bomb.xz").write_bytes(xz)
    bomb = tmp_path / "xz_bomb"
    subprocess.run(
        [
            "objcopy",
            "--add-section",
            f".gnu_debugdata={tmp_path / 'bomb.xz'}",
            str(builds["stripped"]),
            str(bomb),
        ],
        check=True,
    )
    result = child(LOAD_IN_CHILD, str(bomb))
    assert result["errors"][rootfs.DECOMPRESSION_BOMB] == 1, result
    # At most the 64 MiB cap is inflated, once (not twice: see elf._decompress_capped), not the 512 MiB
    # the stream holds; the rest of the peak is the interpreter's own (~20 MiB here).
    assert MAX_MINI_DEBUGINFO_BYTES < inflated_mib << 20
    assert result["peak_kib"] < (MAX_MINI_DEBUGINFO_BYTES >> 10) + (40 << 10), result


def test_xz_stream_asking_for_a_huge_dictionary_is_a_bomb(builds, tmp_path):
    # A 256 MiB dictionary (xz -9 uses 64 MiB); the fast match finder keeps making it cheap.
    lzma2 = {"id": lzma.FILTER_LZMA2, "dict_size": 256 << 20, "mf": lzma.MF_HC3, "mode": lzma.MODE_FAST}
    huge_dict = lzma.compress(b"x", filters=[lzma2])
    (tmp_path / "dict.xz").write_bytes(huge_dict)
    target = tmp_path / "huge_dict"
    subprocess.run(
        [
            "objcopy",
            "--add-section",
            f".gnu_debugdata={tmp_path / 'dict.xz'}",
            str(builds["stripped"]),
            str(target),
        ],
        check=True,
    )
    with ElfFile(target) as elf, pytest.raises(ElfError) as refused:
        SymbolTable.from_elf(elf)
    assert refused.value.reason == rootfs.DECOMPRESSION_BOMB


def test_zstd_section_is_refused_clearly_without_a_zstd_module(builds, tmp_path):
    if elfmod._zstd is not None:
        pytest.skip("this Python can decompress zstd")
    target = tmp_path / "zstd"
    replace_section(
        builds["dynamic"],
        target,
        ".strtab",
        compressed(b"\x28\xb5\x2f\xfd" + b"\0" * 16, 64, 2),
        SHF_COMPRESSED,
    )
    with ElfFile(target) as elf, pytest.raises(ElfError) as refused:
        SymbolTable.from_elf(elf)
    assert refused.value.reason == rootfs.UNSUPPORTED_COMPRESSION
    assert "zstd" in str(refused.value)


def test_compressed_sections_within_the_caps_still_load(builds, tmp_path):
    # Padded past 1 MiB so that decompression takes several steps (elf._decompress_capped).
    with ElfFile(builds["dynamic"]) as elf:
        expected = {name: start for start, _size, name in SymbolTable.from_elf(elf)}
        strtab = bytes(elf.section_data(elf.section(".strtab"))) + b"\0" * (3 << 20)
    packed = tmp_path / "zlib_strtab"
    replace_section(
        builds["dynamic"], packed, ".strtab", compressed(zlib.compress(strtab), len(strtab)), SHF_COMPRESSED
    )
    with ElfFile(packed) as elf:
        assert {name: start for start, _size, name in SymbolTable.from_elf(elf)} == expected

    mini = tmp_path / "mini.xz"
    mini.write_bytes(lzma.compress(builds["tenant.debug"].read_bytes() + b"\0" * (3 << 20)))
    target = tmp_path / "mini"
    subprocess.run(
        ["objcopy", "--add-section", f".gnu_debugdata={mini}", str(builds["stripped"]), str(target)],
        check=True,
    )
    with ElfFile(target) as elf:
        assert "tenant_function" in {name for _start, _size, name in SymbolTable.from_elf(elf)}


def test_compressed_section_must_inflate_to_exactly_its_declared_size(builds, tmp_path):
    target = tmp_path / "short"
    replace_section(
        builds["dynamic"], target, ".strtab", compressed(zlib.compress(b"\0" * 100), 200), SHF_COMPRESSED
    )
    with ElfFile(target) as elf, pytest.raises(ElfError) as refused:
        SymbolTable.from_elf(elf)
    assert refused.value.reason == rootfs.TRUNCATED


def test_section_larger_than_the_read_cap_is_refused_unread(builds, tmp_path):
    # .strtab claims 300 MiB at the end of a sparse file: free on disk, more than any read may allocate.
    sparse = tmp_path / "sparse"
    size = MAX_SECTION_BYTES + (44 << 20)
    replace_section(builds["dynamic"], sparse, ".strtab", b"", size=size)
    os.truncate(sparse, sparse.stat().st_size + size)
    with ElfFile(sparse) as elf, pytest.raises(ElfError) as refused:
        SymbolTable.from_elf(elf)
    assert refused.value.reason == rootfs.TOO_LARGE


# -- the Python detector ---------------------------------------------------------------------------------


def test_detector_refuses_a_fifo_interpreter_without_blocking(tmp_path):
    proc_root = tmp_path / "proc"
    binary = proc_root / str(DEAD_PID) / "root/usr/bin/python3.12"
    binary.parent.mkdir(parents=True)
    os.mkfifo(binary)
    mapping = Mapping(0x400000, 0x500000, 0, 0, 0, os.stat(binary).st_ino, "/usr/bin/python3.12", "r-xp")
    detector = Detector(str(proc_root))
    found: list = []
    worker = threading.Thread(
        target=lambda: found.append(detector.detect(DEAD_PID, 1, [mapping])), daemon=True
    )
    worker.start()
    worker.join(60)  # a hang guard, not a speed claim: an open() for reading blocks until a writer comes
    if worker.is_alive():
        os.close(os.open(binary, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked open
        pytest.fail("opening the tenant's FIFO blocked the detector")
    assert found[0].outcome == UNREADABLE
    assert detector.file_errors.snapshot()[rootfs.NOT_REGULAR] == 1


# -- the self-metric -------------------------------------------------------------------------------------


def test_refusals_are_exported_as_a_counter_by_reason():
    errors = FileErrors()
    errors.count(ElfError("bomb", rootfs.DECOMPRESSION_BOMB))
    errors.count(UnsafeFile(rootfs.NOT_REGULAR, "fifo"))
    errors.count(FileNotFoundError("gone"))  # ordinary: not a refusal
    registry, _hist = build_registry(AgentCounters(), ShipperStats, dict, file_errors=errors.snapshot)
    text = generate_latest(registry).decode()
    assert "# TYPE fleetprof_agent_symbol_file_errors_total counter" in text
    assert 'fleetprof_agent_symbol_file_errors_total{reason="decompression_bomb"} 1.0' in text
    assert 'fleetprof_agent_symbol_file_errors_total{reason="not_regular"} 1.0' in text
    assert 'fleetprof_agent_symbol_file_errors_total{reason="escapes_root"} 0.0' in text
