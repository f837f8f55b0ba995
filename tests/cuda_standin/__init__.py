"""Builds the CUDA stand-ins (a libcuda.so.1, libcudart.so.13 and libcupti.so.13 of our own, compiled from
NVIDIA's headers), our CUPTI library and the C workloads, and finds NVIDIA's real libraries from the wheels.

The stand-ins replace exactly the face our library talks to (NVIDIA's driver, runtime and CUPTI ABI); our
library itself is the real build (scripts/build_cupti.sh). bench/ scripts use this module too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BUILD_SCRIPT = REPO / "scripts" / "build_cupti.sh"
LIBRARY_NAME = "libfleetprof_cupti.so"

_COMMON = ["-g", "-fno-omit-frame-pointer", "-Wall", "-Wno-unused-parameter"]
_SHARED = ["-O2", "-fPIC", "-shared", "-fvisibility=hidden", *_COMMON]


def cuda_wheels() -> Path:
    """The unpacked NVIDIA wheels (include/, lib/libcudart.so.13, lib/libcupti.so.13), fetched once by
    scripts/build_cupti.sh into its cache."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-cache"], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build_cupti.sh --print-cache failed:\n{out.stderr[-3000:]}")
    path = Path(out.stdout.strip())
    return path if path.is_absolute() else REPO / path


def real_libcudart() -> Path:
    """NVIDIA's libcudart.so.13 from the nvidia-cuda-runtime wheel."""
    return cuda_wheels() / "lib" / "libcudart.so.13"


# NVIDIA's runtime for aarch64 (Grace hosts), for the arm64 guest's probes: the newest 13.x this machine's
# package index holds for aarch64 (13.0.96, the x86-64 pin, has no aarch64 wheel there).
AARCH64_RUNTIME = "nvidia-cuda-runtime==13.5.37"


def real_libcudart_aarch64() -> Path:
    """NVIDIA's aarch64 libcudart.so.13 from the nvidia-cuda-runtime wheel, fetched once beside the
    x86-64 wheels' cache."""
    cache = cuda_wheels().parent / ("aarch64-" + AARCH64_RUNTIME.split("==")[1])
    lib = cache / "libcudart.so.13"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "--only-binary=:all:", "--platform", "manylinux_2_17_aarch64", "-d", tmp, AARCH64_RUNTIME],
            check=True, timeout=600,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            (member,) = [n for n in z.namelist() if n.endswith("/lib/libcudart.so.13")]
            cache.mkdir(parents=True, exist_ok=True)
            part = cache / "libcudart.so.13.part"
            part.write_bytes(z.read(member))
            part.rename(lib)  # whole or not at all: a later run trusts what it finds
    return lib


def real_libcupti() -> Path:
    """NVIDIA's libcupti.so.13 from the nvidia-cuda-cupti wheel."""
    return cuda_wheels() / "lib" / "libcupti.so.13"


def build_library(out_dir: Path) -> Path:
    """Our CUPTI library, built by the project's own script into `out_dir`."""
    lib = out_dir / LIBRARY_NAME
    built = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--out", str(lib)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    if built.returncode != 0:
        raise RuntimeError(f"scripts/build_cupti.sh failed:\n{built.stderr[-3000:]}")
    return lib


def _cc(args: list[str]) -> None:
    done = subprocess.run(["gcc", *args], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(args)}\n{done.stderr[-3000:]}")


@dataclass(frozen=True)
class CudaStandins:
    lib_dir: Path  # libcuda.so.1, libcudart.so.13, libcupti.so.13 (ours), and our CUPTI library
    library: Path  # libfleetprof_cupti.so
    launcher: Path  # tests/cuda_standin/launcher.c
    cudart_real: Path  # tests/cuda_standin/cudart_real.c
    include: Path  # NVIDIA's headers
    null_tool: Path  # tests/cuda_standin/null_tool.c: a CUPTI client that does nothing (bench baseline)
    probed: Path  # tests/cuda_standin/probed.c: the uprobes' workload (known launches and waits)

    def env(self, inject: bool = True, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """An environment for a workload on the stand-ins; `inject` loads our library into it."""
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith(("FLEETPROF_CUPTI", "STANDIN_", "CUDA_INJECTION"))]:
            del env[key]
        env["LD_LIBRARY_PATH"] = str(self.lib_dir)
        if inject:
            env["CUDA_INJECTION64_PATH"] = str(self.library)
        env.update(extra)
        return env


def build_standins(out: Path) -> CudaStandins:
    """Compile everything into `out` (a fresh directory)."""
    include = cuda_wheels() / "include"
    lib = out / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    inc = ["-I", str(include), "-I", str(HERE)]
    _cc([*_SHARED, *inc, "-Wl,-soname,libcuda.so.1", "-o", str(lib / "libcuda.so.1"), str(HERE / "cuda.c"),
         "-ldl", "-lpthread"])  # fmt: skip
    for source, soname in (("cupti.c", "libcupti.so.13"), ("cudart.c", "libcudart.so.13")):
        _cc([*_SHARED, *inc, f"-Wl,-soname,{soname}", "-o", str(lib / soname), str(HERE / source),
             "-L", str(lib), "-l:libcuda.so.1", "-lpthread", "-Wl,-rpath,$ORIGIN"])  # fmt: skip
    library = build_library(lib)
    launcher = out / "launcher"
    _cc(["-O0", *_COMMON, *inc, "-o", str(launcher), str(HERE / "launcher.c"),
         "-L", str(lib), "-l:libcudart.so.13", "-l:libcuda.so.1", f"-Wl,-rpath,{lib}"])  # fmt: skip
    cudart_real = out / "cudart_real"
    _cc(["-O0", *_COMMON, *inc, "-o", str(cudart_real), str(HERE / "cudart_real.c"), "-ldl"])
    null_tool = lib / "libnull_tool.so"
    _cc([*_SHARED, *inc, "-o", str(null_tool), str(HERE / "null_tool.c"), "-ldl"])
    probed = out / "probed"
    _cc(["-O0", *_COMMON, *inc, "-o", str(probed), str(HERE / "probed.c"),
         "-L", str(lib), "-l:libcudart.so.13", "-l:libcuda.so.1", f"-Wl,-rpath,{lib}"])  # fmt: skip
    return CudaStandins(lib, library, launcher, cudart_real, include, null_tool, probed)


# ---- running a workload and reading its ring -------------------------------------------------------------


@dataclass
class HeldRun:
    """A workload run to its end with HOLD=1, its ring read while it waited (agent/gpu/cupti_ring.py)."""

    events: list[dict]  # the workload's own log (tests/cuda_standin/launcher.c)
    batches: list  # RingBatch per poll
    returncode: int
    stderr: str

    @property
    def header(self):  # RingHeader
        return self.batches[-1].header

    def kernels(self) -> list:
        return [k for b in self.batches for k in b.kernels()]

    def copies(self) -> list:
        return [c for b in self.batches for c in b.copies()]

    def launches(self) -> list:
        return [launch for b in self.batches for launch in b.launch_records()]

    def logged(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]


def run_held(
    cuda: CudaStandins,
    argv: list[str],
    timeout: float = 120,
    inject: bool = True,
    on_hold: Callable[[int], None] | None = None,
    **env: str,
) -> HeldRun:
    """Run the launcher with HOLD=1; once it holds, poll its ring until a flush that began after it held
    (every record is in), call `on_hold(pid)`, then let it exit. Without the library (no injection) there
    is nothing to read."""
    from fleetprof.agent.gpu.cupti_ring import RingError, RingReader

    proc = subprocess.Popen(
        [str(cuda.launcher), *argv],
        env=cuda.env(inject=inject, HOLD="1", **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events, batches = [], []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["ev"] == "holding":
                break
        else:
            raise AssertionError(f"the workload exited ({proc.wait()}) early:\n{proc.stderr.read()}")
        held_at = time.monotonic_ns()
        deadline = time.monotonic() + timeout
        try:
            reader = RingReader.open(proc.pid)
        except RingError as e:
            if e.reason != "no_ring":
                raise
            reader = None
        while reader is not None:
            batches.append(reader.poll())
            header = batches[-1].header
            if header.state != "running" or header.flushed_ns > held_at:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"no flush after the workload held in {timeout} s: {header}")
            time.sleep(0.02)
        if on_hold is not None:
            on_hold(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.close()
        rc = proc.wait(timeout=timeout)
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return HeldRun(events, batches, rc, stderr)
