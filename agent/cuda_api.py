"""The CUDA functions the agent's uprobes watch (agent/bpf/cuda_probes.c): which library each is in, which
program each gets, and the sizes the BPF side is compiled with. Shared by the loader (agent/cuda_probes.py)
and the finder of the libraries (agent/gpu/cuda_libraries.py)."""

from __future__ import annotations

# Mirrors of cuda_probes.c's sizes (checked against the compiled maps by CpuSampler at load).
CUDA_HIST = 40  # log2 ns buckets: [2^39 ns, ∞) is the last (9 minutes and more)
CUDA_NAME_LEN = 256
CUDA_CALL_IDS = 40  # entry programs cuda_call_0 .. cuda_call_39

RUNTIME, DRIVER, NCCL = "cudart", "cuda", "nccl"
MARKER = "fleetprof_cupti"  # our CUPTI library (agent/cupti/): its sampled launches' marker


def library_kind(basename: str) -> str | None:
    """Which CUDA library a mapped file is, by its name (a wheel's copy in site-packages included)."""
    if basename.startswith("libfleetprof_cupti"):
        return MARKER
    if basename.startswith("libcudart.so"):
        return RUNTIME
    if basename.startswith("libcuda.so"):
        return DRIVER
    if basename.startswith("libnccl.so"):
        return NCCL
    return None


# Launch functions: (library, exported name, program). The program reads the kernel from the argument that
# holds it: cudaLaunchKernelExC(config, func, args) and cuLaunchKernelEx(config, f, ...) have it second.
LAUNCHES: tuple[tuple[str, str, str], ...] = (
    (RUNTIME, "cudaLaunchKernel", "cuda_launch_rt1"),
    (RUNTIME, "cudaLaunchKernel_ptsz", "cuda_launch_rt1"),
    (RUNTIME, "cudaLaunchKernelExC", "cuda_launch_rt2"),
    (RUNTIME, "cudaLaunchKernelExC_ptsz", "cuda_launch_rt2"),
    (RUNTIME, "cudaGraphLaunch", "cuda_graph_rt"),
    (RUNTIME, "cudaGraphLaunch_ptsz", "cuda_graph_rt"),
    (DRIVER, "cuLaunchKernel", "cuda_launch_drv1"),
    (DRIVER, "cuLaunchKernel_ptsz", "cuda_launch_drv1"),
    (DRIVER, "cuLaunchKernelEx", "cuda_launch_drv2"),
    (DRIVER, "cuLaunchKernelEx_ptsz", "cuda_launch_drv2"),
    (DRIVER, "cuGraphLaunch", "cuda_graph_drv"),
    (DRIVER, "cuGraphLaunch_ptsz", "cuda_graph_drv"),
    (MARKER, "fleetprof_cupti_launch", "cuda_marker"),
)
# Driver calls whose return names a kernel handle (cuda_name_enter / cuda_name_return).
NAMING = ("cuModuleGetFunction", "cuLibraryGetKernel")

# Timed calls, where the CPU waits for the GPU or the allocator; the index is the call's id in BPF (the
# entry program cuda_call_<id>). A call is named on the wire as exported.
CALLS: tuple[tuple[str, str], ...] = (
    (RUNTIME, "cudaStreamSynchronize"),
    (RUNTIME, "cudaDeviceSynchronize"),
    (RUNTIME, "cudaEventSynchronize"),
    (RUNTIME, "cudaMemcpy"),
    (RUNTIME, "cudaMalloc"),
    (RUNTIME, "cudaFree"),
    (RUNTIME, "cudaMallocHost"),
    (RUNTIME, "cudaFreeHost"),
    (DRIVER, "cuStreamSynchronize"),
    (DRIVER, "cuCtxSynchronize"),
    (DRIVER, "cuEventSynchronize"),
    (DRIVER, "cuMemcpy"),
    (DRIVER, "cuMemcpyHtoD_v2"),
    (DRIVER, "cuMemcpyDtoH_v2"),
    (DRIVER, "cuMemcpyDtoD_v2"),
    (DRIVER, "cuMemAlloc_v2"),
    (DRIVER, "cuMemFree_v2"),
    (DRIVER, "cuMemAllocHost_v2"),
    (DRIVER, "cuMemFreeHost"),
    (DRIVER, "cuMemAllocManaged"),
    (NCCL, "ncclGroupEnd"),
    (NCCL, "ncclAllReduce"),
    (NCCL, "ncclBroadcast"),
    (NCCL, "ncclReduce"),
    (NCCL, "ncclAllGather"),
    (NCCL, "ncclReduceScatter"),
    (NCCL, "ncclSend"),
    (NCCL, "ncclRecv"),
)
assert len(CALLS) <= CUDA_CALL_IDS
CALL_NAMES = tuple(name for _, name in CALLS)


def wanted_functions(kind: str) -> list[str]:
    """The exported functions of a library of `kind` that get a probe."""
    out = [n for lib, n, _ in LAUNCHES if lib == kind] + [n for lib, n in CALLS if lib == kind]
    return out + list(NAMING) if kind == DRIVER else out
