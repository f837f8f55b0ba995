"""The arm64 guest's initramfs (scripts/arm64_guest.sh): a cpio of our static /init
(scripts/arm64_guest_initrd.c) and the kernel modules it loads, taken from the guest's root.

Usage: arm64_guest_initrd.py ROOT INIT OUT MODULE...   (MODULE: a name as lsmod shows it, e.g. virtio_blk)

Written here, on the host, because mkinitramfs run through qemu-user took minutes of every build. The modules
come with their dependencies from the kernel's own modules.dep, dependencies first, in the order /init loads
them. The archive is the kernel's "newc" cpio, uncompressed (it is a few hundred kB).
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path


def module_order(modules_dir: Path, wanted: list[str]) -> list[str]:
    """Paths (relative to modules_dir) of `wanted` and what they depend on, each after its dependencies."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        # modules.dep names files; lsmod, modprobe and modules.builtin use '_' where file names may have '-'.
        by_name[Path(path).name.removesuffix(".ko").replace("-", "_")] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        # modules.dep lists a module's whole closure, nearest first: load from the far end.
        for dep in reversed(deps[path]):
            visit(dep)
        order.append(path)

    for name in wanted:
        key = name.replace("-", "_")
        if key not in by_name:
            raise SystemExit(f"arm64_guest_initrd: no module {name!r} in {modules_dir}/modules.dep")
        visit(by_name[key])
    return order


class Cpio:
    """A newc ("070701") archive, written entry by entry: the format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ino = 0

    def _entry(self, name: str, mode: int, body: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        self.ino += 1
        encoded = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(body), 0, 0, rdev[0], rdev[1], len(encoded), 0]
        self.data += b"070701" + b"".join(b"%08X" % v for v in fields) + encoded
        self.data += b"\0" * (-len(self.data) % 4) + body
        self.data += b"\0" * (-len(self.data) % 4)

    def directory(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, body: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, body)

    def char_device(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return bytes(self.data + b"\0" * (-len(self.data) % 512))


def build(root: Path, init: Path, wanted: list[str]) -> bytes:
    kernels = sorted((root / "usr/lib/modules").iterdir())
    if len(kernels) != 1:
        raise SystemExit(f"arm64_guest_initrd: not one kernel in {root}/usr/lib/modules: {kernels}")
    modules_dir = kernels[0]
    order = module_order(modules_dir, wanted)
    archive = Cpio()
    for name in ("dev", "proc", "root", "lib", "lib/modules"):
        archive.directory(name)
    # Where the kernel opens fds 0-2 for /init: its built-in initramfs has it too, this one keeps its own.
    archive.char_device("dev/console", 5, 1)
    archive.file("init", init.read_bytes(), 0o755)
    for path in order:
        archive.file(f"lib/modules/{Path(path).name}", (modules_dir / path).read_bytes())
    archive.file("modules", "".join(f"/lib/modules/{Path(p).name}\n" for p in order).encode())
    return archive.finish()


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        raise SystemExit(__doc__.split("\n\n")[1])
    root, init, out, *wanted = argv
    Path(out).write_bytes(build(Path(root), Path(init), wanted))


if __name__ == "__main__":
    main(sys.argv[1:])
