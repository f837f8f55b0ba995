"""bench/gpu_kernels.py, the real-GPU check, here: without torch it exits 2 with a sentence; on the CUDA
stand-ins (--backend standin) its whole path runs: the job under our library, the ring read while it runs,
kernels counted, every loader phase found inside a GPU gap."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.cuda_standin import REPO, CudaStandins, build_standins

SCRIPT = REPO / "bench" / "gpu_kernels.py"


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_without_torch_it_exits_2_and_says_why() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("gpu_kernels: torch is not installed here")


def test_on_the_standins_it_finds_every_kernel_and_loader_phase(cuda: CudaStandins, tmp_path) -> None:
    result = tmp_path / "result.json"
    steps = 8
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "standin", "--steps", str(steps), "--library",
         str(cuda.library), "--json", str(result)],
        env=cuda.env(inject=False), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(result.read_text())
    assert data["ring"]["state"] == "running" and data["ring"]["lost"] == data["ring"]["torn"] == 0
    # Each logged step launches gemm twice, relu and adam once (bench/workloads/gpu_job.py).
    ours = data["kernels"]["ours"]
    gemm = "gemm_kernel(float const*, float const*, float*, int)"
    assert {name: n for name, (n, _) in ours.items()} == {
        gemm: 2 * steps,
        "relu_kernel": steps,
        "adam_kernel": steps,
    }
    assert ours[gemm][1] == 2 * steps * 400_000  # the stand-in device's durations, exactly
    gaps = data["gaps"]
    assert gaps["loads"] == steps - 1 and gaps["found"] == steps - 1
    assert "loader phases: 7, each inside one GPU gap: 7" in out.stdout
