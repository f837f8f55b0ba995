"""A Python workload on the CUDA stand-ins (tests only): launches a kernel through libcudart's
cudaLaunchKernel (ctypes) from the Python function train_step, for SECONDS; the host stub lives in the
shared library given (its symbol is the kernel's mangled name, as nvcc makes it).

    python launch_from_python.py STUBS.so SECONDS

Prints {"ev":"ready"}, waits for a line on stdin (the test attaches its probes), then prints {"launches":N}
and waits for another line before it exits."""

import ctypes
import json
import sys
import time

GEMM = b"_Z11gemm_kernelPKfS0_Pfi"


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


rt = ctypes.CDLL("libcudart.so.13")
stubs = ctypes.CDLL(sys.argv[1])
stub = ctypes.cast(getattr(stubs, GEMM.decode()), ctypes.c_void_p)
register_binary = getattr(rt, "__cudaRegisterFatBinary")
register_binary.restype = ctypes.c_void_p
handle = register_binary(ctypes.create_string_buffer(16))
getattr(rt, "__cudaRegisterFunction")(
    ctypes.c_void_p(handle), stub, GEMM, GEMM, -1, None, None, None, None, None
)
launch = rt.cudaLaunchKernel
launch.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
dur = ctypes.c_uint64(0)
args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(dur), ctypes.c_void_p))
one, block = Dim3(1, 1, 1), Dim3(32, 1, 1)


def train_step() -> None:
    if launch(stub, one, block, args, 0, None) != 0:
        raise SystemExit("cudaLaunchKernel failed")


print(json.dumps({"ev": "ready"}), flush=True)
sys.stdin.readline()
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    train_step()
    n += 1
rt.cudaDeviceSynchronize()
print(json.dumps({"launches": n}), flush=True)
sys.stdin.readline()  # held: the test reads the process's Python code objects while it lives
