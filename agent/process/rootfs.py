"""Open files that a process (a tenant) controls, as root, without being led out of its root filesystem.

The agent runs as root on the host and reads the ELF files of every process, including containers', through
/proc/PID/root. Rules this file keeps:
  * A path under a process's root is resolved inside that root: absolute symlinks and ".." stop at the
    root, as they do for the process itself. Opening "/proc/PID/root/usr/lib/x.so" as a plain path would
    not do that: once the kernel has jumped into the root through the magic link, an absolute symlink
    inside (`x.so -> /etc/shadow`) restarts at the *agent's* root, the host's. `openat2(2)` with
    RESOLVE_IN_ROOT does it in the kernel; without openat2 (Linux < 5.6, or a seccomp filter that refuses
    it) `walk_in_root` does the same one component at a time and never lets the kernel follow a link.
  * Magic links (/proc/N/root, /proc/N/fd/M in the container's /proc) are never followed: they lead wherever
    the process they describe has something open, the host included. openat2 refuses them
    (RESOLVE_NO_MAGICLINKS); the walk reads every link as text and resolves that text inside the root.
  * Only regular files are opened for reading: the path is opened O_PATH first, which runs no driver
    code and cannot block, and reopened for reading only after fstat says it is a regular file (a FIFO
    would block the open forever, a device's open can have side effects).
  * Every refusal names its reason (`UnsafeFile.reason`, `ElfError.reason`), counted by `FileErrors`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import threading

# Why a file was refused: the `reason` label of fleetprof_agent_symbol_file_errors_total.
NOT_REGULAR = "not_regular"  # a directory, FIFO, socket or device where a file was expected
ESCAPES_ROOT = "escapes_root"  # a magic link, a ".." race the kernel caught, or more than MAX_SYMLINKS hops
TRUNCATED = "truncated"  # shorter than its own headers say (possibly truncated while being read)
TOO_LARGE = "too_large"  # a header table or section over its read cap (agent/symbols/elf.py)
DECOMPRESSION_BOMB = "decompression_bomb"  # a compressed section that would inflate past its cap or size
UNSUPPORTED_COMPRESSION = "unsupported_compression"  # e.g. zstd without a zstd module
MALFORMED = "malformed"  # not an ELF file this reader understands
REASONS = (
    NOT_REGULAR,
    ESCAPES_ROOT,
    TRUNCATED,
    TOO_LARGE,
    DECOMPRESSION_BOMB,
    UNSUPPORTED_COMPRESSION,
    MALFORMED,
)

# The kernel's own limit on symlinks followed in one lookup (MAXSYMLINKS).
MAX_SYMLINKS = 40

# openat2(2): one syscall number on every architecture but alpha since Linux 5.1's unified numbering.
_SYS_OPENAT2 = None if platform.machine() == "alpha" else 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
# How often an openat2 that the kernel could not prove safe (EAGAIN: a rename raced the lookup) is retried.
_RACE_RETRIES = 3

_O_PATH = os.O_PATH | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(OSError):
    """The path was refused before any byte was read; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str, err: int = errno.EPERM) -> None:
        super().__init__(err, message)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.strerror} ({self.reason})"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)  # the C library already loaded into this process, for syscall()


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """The raw openat2(2) syscall; raises OSError with the kernel's errno (ENOSYS where it is missing)."""
    if _SYS_OPENAT2 is None:
        raise OSError(errno.ENOSYS, "openat2 has another syscall number on this architecture")
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"openat2 {path!r}: {os.strerror(err)}")
    return fd


def _openat2_in_root(root_fd: int, path: str) -> int:
    for _ in range(_RACE_RETRIES):
        try:
            return openat2(root_fd, path, _O_PATH, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno == errno.EAGAIN:
                continue
            if e.errno in (errno.ELOOP, errno.EXDEV):
                raise UnsafeFile(ESCAPES_ROOT, f"{path}: crosses a magic link or loops", e.errno) from e
            raise
    raise UnsafeFile(ESCAPES_ROOT, f"{path}: a rename raced every lookup ('..' escape attempt?)", errno.EXDEV)


def walk_in_root(root_fd: int, path: str) -> int:
    """An O_PATH fd of `path` resolved inside the directory `root_fd` as RESOLVE_IN_ROOT would, without
    openat2: one component at a time, each opened O_NOFOLLOW, symlinks read and re-resolved here
    (absolute ones from the root), ".." never above the root, at most MAX_SYMLINKS links."""
    parts = [p for p in reversed(path.split("/")) if p not in ("", ".")]  # a stack: next component last
    # Our own ".." (pop a directory we walked through) rather than the kernel's: a directory moved out
    # of the root while we stand in it cannot take us along.
    dirs = [os.dup(root_fd)]
    hops = 0
    try:
        while parts:
            name = parts.pop()
            if name == "..":
                if len(dirs) > 1:
                    os.close(dirs.pop())
                continue
            fd = os.open(name, _O_PATH | os.O_NOFOLLOW, dir_fd=dirs[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                try:
                    target = os.readlink("", dir_fd=fd)  # the link this fd holds, not whatever is there now
                finally:
                    os.close(fd)
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise UnsafeFile(ESCAPES_ROOT, f"{path}: more than {MAX_SYMLINKS} symlinks", errno.ELOOP)
                if target.startswith("/"):
                    while len(dirs) > 1:
                        os.close(dirs.pop())
                parts.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
            elif not parts:
                return fd
            elif stat.S_ISDIR(mode):
                dirs.append(fd)
            else:
                os.close(fd)
                raise NotADirectoryError(errno.ENOTDIR, f"{path}: {name} is not a directory")
        return os.dup(dirs[-1])
    finally:
        for d in dirs:
            os.close(d)


def _reopen_regular(path_fd: int, what: str, inode: int | None) -> int:
    """A readable fd of the regular file that O_PATH fd `path_fd` names (closed either way)."""
    try:
        st = os.fstat(path_fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(NOT_REGULAR, f"{what}: not a regular file (mode {st.st_mode:o})")
        if inode is not None and st.st_ino != inode:
            raise OSError(errno.ESTALE, f"{what}: inode {st.st_ino} is not the mapped inode {inode}")
        # Our own fd's magic link: the very inode the O_PATH lookup found, now opened for reading.
        return os.open(f"/proc/self/fd/{path_fd}", _O_READ)
    finally:
        os.close(path_fd)


def open_in_root(root: str, path: str, inode: int | None = None) -> int:
    """A read-only fd (O_CLOEXEC) of the regular file `path` inside the directory `root` (/proc/PID/root, or
    any directory), resolved as a process whose / is `root` would resolve it. With `inode`, a file with
    another inode (replaced since it was mapped) is refused with OSError(ESTALE).

    Raises UnsafeFile for a refusal worth counting, other OSErrors (ENOENT, ...) for the ordinary."""
    _check_path(path)
    root_fd = os.open(root, _O_PATH | os.O_DIRECTORY)
    try:
        try:
            fd = _openat2_in_root(root_fd, path)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM) or isinstance(e, UnsafeFile):
                raise
            fd = walk_in_root(root_fd, path)  # no openat2 here (old kernel, or a seccomp filter)
    finally:
        os.close(root_fd)
    return _reopen_regular(fd, f"{root}:{path}", inode)


def open_file(path: str, inode: int | None = None) -> int:
    """A read-only fd (O_CLOEXEC) of the regular file at `path`, a path of the agent's own filesystem (a
    host file, or /proc/PID/map_files/..., whose magic link names the exact mapped inode). Refuses what
    is not a regular file without opening it for reading; `inode` as for open_in_root."""
    _check_path(path)
    return _reopen_regular(os.open(path, _O_PATH), path, inode)


def _check_path(path: str) -> None:
    # os.open raises ValueError for a NUL and ctypes would cut the path there: an OSError like the rest.
    if "\0" in path:
        raise OSError(errno.EINVAL, f"{path!r}: a NUL byte in a path")


def mapped_file_openers(proc_root: str, pid: int, path: str, start: int, end: int, inode: int) -> list:
    """Ways to open the file a process maps at [start, end) from `path` (as /proc/PID/maps names it), best
    first; each returns a read-only fd of a regular file or raises OSError (UnsafeFile when refused).

    The process's own root first (containers see their own filesystem; resolved inside it), then the exact
    mapped file via map_files (works for deleted files, only while the process lives), then the host path.
    Path-based opens may find a different file now, so they must match the inode; only the inode, because
    on overlayfs the device in maps names the underlying layer, not what stat() reports.
    """
    proc = f"{proc_root}/{pid}"
    map_files = f"{proc}/map_files/{start:x}-{end:x}"
    if not path.startswith("/"):
        return [lambda: open_file(map_files)]
    return [
        lambda: open_in_root(f"{proc}/root", path, inode),
        lambda: open_file(map_files),
        lambda: open_file(path, inode),
    ]


class FileErrors:
    """Tenant files refused, by reason (REASONS); cumulative and thread-safe.

    One instance is shared by everything that reads tenant files (the symbolizer, the Python detector)
    and read by the self-metric fleetprof_agent_symbol_file_errors_total."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)

    def count(self, exc: BaseException) -> str | None:
        """Count `exc` if it is a refusal (it carries one of REASONS); returns the reason, else None."""
        reason = getattr(exc, "reason", None)
        if reason not in self._counts:
            return None
        with self._lock:
            self._counts[reason] += 1
        return reason

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
