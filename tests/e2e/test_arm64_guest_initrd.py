"""scripts/arm64_guest_initrd.py: the modules come with their dependencies, each after what it needs, and the
archive is the kernel's newc cpio (read back here field by field, as the kernel's unpacker reads it).
The guest booting from it is tests/e2e/test_arm64_guest.py's part."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("initrd", REPO / "scripts" / "arm64_guest_initrd.py")
initrd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(initrd)

# The shape of the guest kernel's own modules.dep: each module's whole closure, nearest first.
V = "kernel/drivers/virtio"
MODULES_DEP = f"""\
{V}/virtio.ko:
{V}/virtio_ring.ko:
{V}/virtio_pci_modern_dev.ko:
{V}/virtio_pci_legacy_dev.ko:
{V}/virtio_mmio.ko: {V}/virtio_ring.ko {V}/virtio.ko
{V}/virtio_pci.ko: {V}/virtio_pci_legacy_dev.ko {V}/virtio_pci_modern_dev.ko {V}/virtio_ring.ko {V}/virtio.ko
kernel/drivers/block/virtio_blk.ko: {V}/virtio_ring.ko {V}/virtio.ko
kernel/drivers/char/hw_random/virtio-rng.ko: {V}/virtio_ring.ko {V}/virtio.ko
"""
KERNEL = "usr/lib/modules/6.1.0-test-arm64"


def fake_root(tmp_path: Path) -> Path:
    modules = tmp_path / "root" / KERNEL
    for line in MODULES_DEP.splitlines():
        path = modules / line.partition(":")[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"module {path.name}".encode())
    (modules / "modules.dep").write_text(MODULES_DEP)
    return tmp_path / "root"


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name -> (mode, body, (rdev major, minor)) of a newc archive, stopping at its trailer."""
    entries, offset = {}, 0
    while True:
        assert data[offset : offset + 6] == b"070701", f"no newc magic at {offset}"
        fields = [int(data[offset + 6 + 8 * i : offset + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name_at = offset + 110
        name = data[name_at : name_at + namesize - 1].decode()
        assert data[name_at + namesize - 1] == 0, "names end in NUL"
        body_at = name_at + namesize + (-(name_at + namesize) % 4)
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, data[body_at : body_at + size], rdev)
        offset = body_at + size + (-(body_at + size) % 4)


def test_modules_follow_their_dependencies(tmp_path: Path) -> None:
    order = initrd.module_order(fake_root(tmp_path) / KERNEL, ["virtio_pci", "virtio_blk"])
    names = [Path(p).name for p in order]
    assert sorted(names) == sorted(
        ["virtio.ko", "virtio_ring.ko", "virtio_pci_legacy_dev.ko", "virtio_pci_modern_dev.ko",
         "virtio_pci.ko", "virtio_blk.ko"]
    )  # fmt: skip
    for module, needs in [("virtio_pci.ko", "virtio_pci_modern_dev.ko"), ("virtio_pci.ko", "virtio_ring.ko"),
                          ("virtio_pci.ko", "virtio.ko"), ("virtio_blk.ko", "virtio_ring.ko")]:  # fmt: skip
        assert names.index(needs) < names.index(module), f"{module} before {needs}: {names}"


def test_a_dash_in_the_file_name_is_found_by_its_underscore_name(tmp_path: Path) -> None:
    order = initrd.module_order(fake_root(tmp_path) / KERNEL, ["virtio_rng"])
    assert Path(order[-1]).name == "virtio-rng.ko"


def test_an_unknown_module_is_refused_by_name(tmp_path: Path) -> None:
    try:
        initrd.module_order(fake_root(tmp_path) / KERNEL, ["nvme"])
    except SystemExit as refused:
        assert "'nvme'" in str(refused)
    else:
        raise AssertionError("an unknown module was accepted")


def test_the_archive_holds_init_console_and_the_modules_in_load_order(tmp_path: Path) -> None:
    root = fake_root(tmp_path)
    init = tmp_path / "init"
    init.write_bytes(b"\x7fELF static init")
    entries = read_newc(initrd.build(root, init, ["virtio_blk"]))
    mode, body, _ = entries["init"]
    assert stat.S_ISREG(mode) and mode & 0o777 == 0o755 and body == init.read_bytes()
    mode, _, rdev = entries["dev/console"]
    assert stat.S_ISCHR(mode) and rdev == (5, 1)
    for folder in ("dev", "proc", "root"):
        assert stat.S_ISDIR(entries[folder][0])
    listed = entries["modules"][1].decode().splitlines()
    assert listed == ["/lib/modules/virtio.ko", "/lib/modules/virtio_ring.ko", "/lib/modules/virtio_blk.ko"]
    for path in listed:
        assert entries[path.lstrip("/")][1] == f"module {Path(path).name}".encode()
