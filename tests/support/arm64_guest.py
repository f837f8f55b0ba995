"""Host side of the arm64 guest (scripts/arm64_guest.sh): build it (cached), cross-build aarch64 workloads,
boot it with an input folder and read back what it wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, WORKLOADS
from tests.cuda_standin import HERE as CUDA_STANDIN
from tests.cuda_standin import cuda_wheels, real_libcudart_aarch64

SCRIPT = REPO / "scripts" / "arm64_guest.sh"
CROSS_GCC = "aarch64-linux-gnu-gcc"
# A first build runs mmdebstrap through qemu-user: ~5 minutes on a loaded 2-core machine (bench/README.md).
BUILD_LIMIT_S = 3600

# How the aarch64 workloads are built. Both sign their return addresses (pointer authentication, as
# distributions now build: -mbranch-protection=standard), which the guest's CPU checks (-cpu max): a
# walker that does not strip the signature from a saved return address finds no code there.
# With frame pointers as distributions that keep them build (Fedora, Ubuntu 24.04): every function,
# leaves too, sets up its frame record; without -mno-omit-leaf-frame-pointer a leaf keeps its return
# address in x30 only and a frame-pointer walk skips its caller.
FP_FLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]
# Without them, optimised. -fno-ipa-icf: GCC would fold two_funcs' two identical functions into one.
NO_FP_FLAGS = ["-O2", "-g", "-fomit-frame-pointer", "-fno-ipa-icf"]
PAC_FLAGS = ["-mbranch-protection=standard"]


def build_guest() -> Path:
    """The cached guest's folder, building it first if needed (fails, never skips, when it cannot)."""
    built = subprocess.run(
        ["bash", str(SCRIPT), "build"], capture_output=True, text=True, timeout=BUILD_LIMIT_S
    )
    if built.returncode != 0:
        pytest.fail(f"the arm64 guest could not be built:\n{built.stderr[-4000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


def cross_compile(source: Path, exe: Path, flags: list[str]) -> Path:
    if shutil.which(CROSS_GCC) is None:
        pytest.fail(f"{CROSS_GCC} is missing (Debian gcc-aarch64-linux-gnu; scripts/setup.sh --test)")
    subprocess.run([CROSS_GCC, *flags, "-o", str(exe), str(source)], check=True)
    return exe


def prepare_workloads(dest: Path) -> None:
    """The aarch64 workloads into `dest`: two_funcs with and without frame pointers, getppid_n, vdso_clock
    (its CPU in the vDSO), the Python one (the guest's own python3 runs it), and cudart_real with NVIDIA's
    aarch64 libcudart.so.13."""
    cross_compile(WORKLOADS / "two_funcs.c", dest / "two_funcs_fp", FP_FLAGS + PAC_FLAGS)
    cross_compile(WORKLOADS / "two_funcs.c", dest / "two_funcs_nofp", NO_FP_FLAGS + PAC_FLAGS)
    cross_compile(WORKLOADS / "getppid_n.c", dest / "getppid_n", ["-O2"])
    cross_compile(WORKLOADS / "vdso_clock.c", dest / "vdso_clock", NO_FP_FLAGS + PAC_FLAGS)  # its clock mode
    shutil.copy2(WORKLOADS / "py_story.py", dest / "py_story.py")
    # NVIDIA's real aarch64 libcudart, called by our launcher (no driver: each launch fails, but is made)
    include = cuda_wheels() / "include"
    cross_compile(
        CUDA_STANDIN / "cudart_real.c", dest / "cudart_real", FP_FLAGS + ["-I", str(include), "-ldl"]
    )
    shutil.copy2(real_libcudart_aarch64(), dest / "libcudart.so.13")


def run_guest(inputs: Path, out: Path, limit_s: int) -> dict:
    """Boot the guest with `inputs` (holding run.sh); returns summary.json of what it wrote to `out`."""
    ran = subprocess.run(
        ["bash", str(SCRIPT), "run", str(inputs), str(out), str(limit_s)],
        capture_output=True, text=True, timeout=limit_s + 120,
    )  # fmt: skip
    console = out / "console.log"
    tail = console.read_text(errors="replace")[-3000:] if console.exists() else "(no console log)"
    if ran.returncode != 0:
        pytest.fail(f"the arm64 guest failed: {ran.stderr[-2000:]}\nconsole:\n{tail}")
    summary = out / "summary.json"
    if not summary.exists():
        run_log = out / "run.log"
        pytest.fail(
            "the guest's driver wrote no summary; its log:\n"
            + (run_log.read_text(errors="replace")[-4000:] if run_log.exists() else tail)
        )
    return json.loads(summary.read_text())
