"""Fill the arm64 guest's venv from the host (scripts/arm64_guest.sh): aarch64 wheels installed by this
Python's pip, compiled to .pyc by this Python, as the guest's own pip would have left them.

Usage: arm64_guest_venv.py ROOT VENV REQUIREMENTS FIND_LINKS... -- PIP_PLATFORM_OPTIONS...
  ROOT: the guest's root on the host; VENV: the venv's path inside the guest (made by `python3 -m venv
  --without-pip` there); REQUIREMENTS: a pip requirements file; FIND_LINKS: folders of wheels; after `--`: the
  --platform/--python-version/--implementation options the wheels were downloaded with.

Why here: the guest's pip under qemu-user took minutes, unpacking and compiling at a tenth of the host's pace.
What makes it equivalent: the guest's python is CPython 3.11 as the host's (one bytecode format, magic
3495, checked below), and pip installs for another platform only with --target, whose two differences from an
install into the venv are undone here: the scripts' #! line names the host's interpreter (it becomes the
venv's), and the dist-info RECORDs place scripts and omit .pyc files (both written as the venv's pip does, so
that `pip uninstall` in the guest removes everything).
"""

from __future__ import annotations

import base64
import compileall
import csv
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

GUEST_PYTHON = (3, 11)


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pip_install(site: Path, requirements: Path, find_links: list[str], platform: list[str]) -> None:
    links = [arg for folder in find_links for arg in ("--find-links", folder)]
    # Isolated: this machine's pip configuration (indexes, find-links, constraints) is for its own Python.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--isolated", "--disable-pip-version-check",
         "--no-index", "--no-warn-conflicts", "--only-binary=:all:", *platform, "--no-compile",
         "--target", str(site), *links, "-r", str(requirements), "pip", "setuptools"],
        check=True, env=env,
    )  # fmt: skip


def move_scripts(site: Path, venv_bin: Path, guest_python: str) -> dict[str, tuple[str, str]]:
    """Scripts from --target's site/bin into the venv's bin, run by the venv's python; returns the RECORD
    entries that change: old path -> (new path, new hash and size)."""
    moved: dict[str, tuple[str, str]] = {}
    target_bin = site / "bin"
    if not target_bin.is_dir():
        return moved
    for script in sorted(target_bin.iterdir()):
        data = script.read_bytes()
        first, sep, rest = data.partition(b"\n")
        if first.startswith(b"#!") and b"python" in first:
            data = b"#!" + guest_python.encode() + sep + rest
        dest = venv_bin / script.name
        dest.write_bytes(data)
        dest.chmod(0o755)
        script.unlink()
        # RECORD paths are relative to site-packages: --target's layout had bin beside lib/python.
        new_entry = (f"../../../bin/{script.name}", f"{record_hash(data)},{len(data)}")
        moved[f"../../bin/{script.name}"] = new_entry
    target_bin.rmdir()
    return moved


def compile_site(root: Path, site: Path) -> None:
    if sys.version_info[:2] != GUEST_PYTHON:
        raise SystemExit(f"arm64_guest_venv: needs CPython {GUEST_PYTHON} (the guest's) to compile its .pyc")
    # Paths inside the .pyc (tracebacks) are the guest's: ROOT stripped, / put before.
    compileall.compile_dir(site, quiet=1, stripdir=str(root), prependdir="/", workers=0)


def fix_records(site: Path, moved: dict[str, tuple[str, str]]) -> None:
    for record in site.glob("*.dist-info/RECORD"):
        rows = []
        with record.open(newline="") as f:
            for row in csv.reader(f):
                path = row[0]
                if path in moved:
                    new_path, hash_size = moved[path]
                    rows.append([new_path, *hash_size.split(",")])
                    continue
                rows.append(row)
                if path.endswith(".py"):
                    # The host's cache tag is the guest's (cpython-311): compile_site checked the version.
                    pyc = Path(importlib.util.cache_from_source(path))
                    if (site / pyc).is_file():
                        rows.append([pyc.as_posix(), "", ""])
        # As pip writes it: the csv module's dialect, \r\n line ends included.
        with record.open("w", newline="") as f:
            csv.writer(f).writerows(rows)


def main(argv: list[str]) -> None:
    if "--" not in argv or len(argv[: argv.index("--")]) < 4:
        raise SystemExit(__doc__.split("\n\n")[1])
    split = argv.index("--")
    root, venv, requirements, *find_links = argv[:split]
    platform = argv[split + 1 :]
    root_path = Path(root)
    venv_path = root_path / venv.lstrip("/")
    site = venv_path / "lib" / f"python{GUEST_PYTHON[0]}.{GUEST_PYTHON[1]}" / "site-packages"
    if not site.is_dir():
        raise SystemExit(
            f"arm64_guest_venv: no venv at {venv_path} (`python3 -m venv --without-pip` makes it)"
        )
    pip_install(site, Path(requirements), find_links, platform)
    moved = move_scripts(site, venv_path / "bin", f"{venv.rstrip('/')}/bin/python3")
    compile_site(root_path, site)
    fix_records(site, moved)


if __name__ == "__main__":
    main(sys.argv[1:])
