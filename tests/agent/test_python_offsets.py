"""The CPython walker's tabled offsets (agent/python/offsets.py, 3.11 and 3.12) are each architecture's own
layout: tests/cpython/walker_offsets.c prints offsetof() of every field the walker reads, compiled against
the version's internal headers by gcc (x86-64) and aarch64-linux-gnu-gcc (arm64, run through qemu-user).
3.13+ needs no table: the agent reads _Py_DebugOffsets from each binary (64-bit words, the same on both)."""

from __future__ import annotations

import dataclasses
import glob
import shutil
import subprocess
from pathlib import Path

import pytest

from fleetprof.agent.python.offsets import NO_FIELD, TABLE
from tests.conftest import REPO

SOURCE = REPO / "tests" / "cpython" / "walker_offsets.c"
COMPILERS = {"x86_64": ["gcc"], "aarch64": ["aarch64-linux-gnu-gcc", "-static"]}


def headers(version: str) -> Path:
    """A CPython's installed headers (pyenv's builds here, as tests/agent/test_python_stacks.py uses)."""
    found = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/include/python{version}"))
    if not found or not Path(found[-1], "internal", "pycore_frame.h").exists():
        pytest.fail(f"CPython {version}'s internal headers are not installed here (pyenv)")
    return Path(found[-1])


@pytest.mark.parametrize("version", ["3.11", "3.12"])
@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_tabled_offsets_are_the_layout_each_architecture_compiles(
    version: str, arch: str, tmp_path: Path
) -> None:
    compiler = COMPILERS[arch]
    if shutil.which(compiler[0]) is None:
        pytest.fail(f"{compiler[0]} is missing (scripts/setup.sh --test installs it)")
    exe = tmp_path / f"offsets-{arch}"
    subprocess.run([*compiler, "-I", str(headers(version)), "-o", str(exe), str(SOURCE)], check=True)
    # An aarch64 binary runs here through binfmt_misc and qemu-user (scripts/setup.sh --test enables it).
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, f"{exe} did not run (is qemu-aarch64 enabled in binfmt_misc?): {ran.stderr}"
    compiled = {name: int(value) for name, value in (line.split() for line in ran.stdout.splitlines())}
    major, minor = map(int, version.split("."))
    tabled = dataclasses.asdict(TABLE[(major, minor)])
    expected = {k: v for k, v in tabled.items() if k in compiled}
    assert compiled == expected, f"{arch} {version}: compiled {compiled}, tabled {tabled}"
    # Every field the table holds was compiled (frame_entry only exists in 3.11).
    assert set(tabled) - set(compiled) <= ({"frame_entry"} if tabled["frame_entry"] == NO_FIELD else set())
