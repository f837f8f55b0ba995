"""A training job for bench/gpu_kernels.py: a slow loader (CPU-busy phases of 5-50 ms) alternating with
training steps on the GPU, every phase logged with its own CLOCK_MONOTONIC start and end.

    gpu_job.py --backend torch|standin --steps N --log FILE [--profile FILE] [--hold]
               [--loop SECONDS]

torch: a small MLP (forward, backward, Adam) on the GPU, seeded, so two runs launch the same kernels;
`loss.item()` ends each step, so the GPU has drained when the loader starts. standin: the same phases
through the CUDA stand-ins (tests/cuda_standin) via ctypes: LD_LIBRARY_PATH must hold them.
--profile FILE: run the steps under torch.profiler and write its per-kernel counts and CUDA time (JSON).
--hold: after the last step print "holding" and wait for a line on stdin (the reader's last look).
--loop SECONDS: instead of the steps, a launch-bound loop of tiny kernels; prints launches per second.
Log lines: {"phase": "load"|"train", "step": i, "start": ns, "end": ns}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

LOAD_MS = (5, 10, 20, 35, 50)  # the loader's phases, in turn


def spin(ms: float) -> None:
    """The slow loader: Python busy on the CPU for `ms` milliseconds."""
    end = time.monotonic_ns() + int(ms * 1e6)
    x = 0
    while time.monotonic_ns() < end:
        x += sum(range(200))


class TorchBackend:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.device = torch.device("cuda")
        self.model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
        ).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.batch = torch.randn(512, 1024)  # on the CPU: each step copies it over, as a loader's batch

    def step(self) -> None:
        x = self.batch.to(self.device)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        loss.item()

    def loop(self, seconds: float) -> int:
        x = self.torch.zeros(16, device=self.device)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(1000):
                x.add_(1.0)
            n += 1000
        self.torch.cuda.synchronize()
        return n

    def profile(self, steps: int, run) -> dict:  # the step runner
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
        kernels: dict[str, list[int]] = {}
        for evt in prof.events():
            # GPU-side user annotations (Optimizer.step#Adam.step) are ranges, not kernels or copies. Not
            # evt.is_user_annotation: an H200 run that also filtered on it lacked 240 of the 1,240 kernels
            # the run before had (the loss's reduce and elementwise kernels).
            if evt.device_type != DeviceType.CUDA or "#" in evt.name:
                continue
            entry = kernels.setdefault(evt.name, [0, 0])
            entry[0] += 1
            entry[1] += int(round(evt.time_range.elapsed_us() * 1000))
        return {"kernels": kernels}


class StandinBackend:
    """The same job through NVIDIA's runtime API, served by our stand-ins (durations are the simulation's)."""

    KERNELS = {"_Z11gemm_kernelPKfS0_Pfi": 400_000, "relu_kernel": 80_000, "adam_kernel": 150_000}

    class Dim3(ctypes.Structure):
        _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]

    def __init__(self) -> None:
        rt = ctypes.CDLL("libcudart.so.13")
        # getattr: a name starting with "__" written inside a class would be mangled by Python.
        register_fatbin = getattr(rt, "__cudaRegisterFatBinary")
        register_fatbin.restype = ctypes.c_void_p
        register_fatbin.argtypes = [ctypes.c_void_p]
        register = getattr(rt, "__cudaRegisterFunction")
        register.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                             ctypes.c_int] + [ctypes.c_void_p] * 5  # fmt: skip
        rt.cudaLaunchKernel.argtypes = [ctypes.c_void_p, self.Dim3, self.Dim3, ctypes.c_void_p,
                                        ctypes.c_size_t, ctypes.c_void_p]  # fmt: skip
        self.rt = rt
        self._fatbin = ctypes.create_string_buffer(16)
        handle = register_fatbin(self._fatbin)
        # Host stubs: any distinct addresses of ours, as nvcc's stubs are functions of the program.
        self.stubs = {name: ctypes.create_string_buffer(8) for name in self.KERNELS}
        for name, stub in self.stubs.items():
            register(handle, ctypes.addressof(stub), name.encode(), name.encode(), -1, None, None, None, None,
                     None)  # fmt: skip
        self._check(rt.cudaFree(None), "cudaFree(0)")

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed with cudaError {err}")

    def launch(self, name: str, ns: int | None = None) -> None:
        dur = ctypes.c_uint64(self.KERNELS[name] if ns is None else ns)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(dur))
        err = self.rt.cudaLaunchKernel(ctypes.addressof(self.stubs[name]), self.Dim3(1, 1, 1),
                                       self.Dim3(128, 1, 1), args, 0, None)  # fmt: skip
        self._check(err, f"cudaLaunchKernel({name})")

    def step(self) -> None:
        for name in ("_Z11gemm_kernelPKfS0_Pfi", "relu_kernel", "_Z11gemm_kernelPKfS0_Pfi", "adam_kernel"):
            self.launch(name)
        self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def loop(self, seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(1000):
                self.launch("relu_kernel", 0)
            n += 1000
        self._check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        return n

    def profile(self, steps: int, run) -> dict:
        raise SystemExit("gpu_job: --profile needs the torch backend (torch.profiler)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("torch", "standin"), required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log", required=True)
    ap.add_argument("--profile")
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--loop", type=float)
    args = ap.parse_args()
    backend = TorchBackend() if args.backend == "torch" else StandinBackend()
    if args.loop:
        t0 = time.monotonic()
        n = backend.loop(args.loop)
        rate = n / (time.monotonic() - t0)
        with open(args.log, "w") as out:
            json.dump({"launches": n, "per_s": rate}, out)
        return 0
    backend.step()  # warm-up, outside the log: lazy initialisation (cuBLAS handles, autotuning)
    log = open(args.log, "w", buffering=1)

    def run() -> None:
        for i in range(args.steps):
            t0 = time.monotonic_ns()
            spin(LOAD_MS[i % len(LOAD_MS)])
            t1 = time.monotonic_ns()
            backend.step()
            t2 = time.monotonic_ns()
            log.write(json.dumps({"phase": "load", "step": i, "start": t0, "end": t1}) + "\n")
            log.write(json.dumps({"phase": "train", "step": i, "start": t1, "end": t2}) + "\n")

    if args.profile:
        result = backend.profile(args.steps, run)
        with open(args.profile, "w") as out:
            json.dump(result, out)
    else:
        run()
    log.close()
    if args.hold:
        print("holding", flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
