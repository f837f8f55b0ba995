// Stand-in libcudart.so.13 (tests only): the runtime calls our test workloads make, with NVIDIA's
// signatures (cuda_runtime_api.h), each reported to CUPTI in the runtime domain and made of driver calls,
// as NVIDIA's runtime is: cudaLaunchKernel calls cuLaunchKernel, so a tool sees both (nested).
//
// Kernels are registered the way nvcc's generated code registers them (__cudaRegisterFatBinary, then
// __cudaRegisterFunction(handle, host stub, ..., device name, ...)); a launch names its kernel by the host
// stub's address. The runtime initialises the driver lazily at its first call, as NVIDIA's does.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "standin.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_KERNELS 1024

// NVIDIA declares these in crt/host_runtime.h, which is C++ only; same signatures.
EXPORT void **CUDARTAPI __cudaRegisterFatBinary(void *fatCubin);
EXPORT void CUDARTAPI __cudaRegisterFatBinaryEnd(void **handle);
EXPORT void CUDARTAPI __cudaRegisterFunction(void **handle, const char *hostFun, char *deviceFun,
                                             const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                                             dim3 *bDim, dim3 *gDim, int *wSize);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    const void *stub;
    const char *name;
    CUfunction function;
} kernels[MAX_KERNELS];
static int nkernels;
static CUcontext ctx;
static CUmodule module;
static __thread int thread_ready;

#define RT_API(cbid_name, params_ptr, symbol)                                                        \
    struct standin_call call_;                                                                        \
    standin_api_begin(&call_, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_##cbid_name, \
                      #cbid_name, params_ptr, symbol)
#define RT_RETURN(value)                 \
    do {                                  \
        cudaError_t r_ = (value);         \
        standin_api_end(&call_, &r_);     \
        return r_;                        \
    } while (0)

static cudaError_t ready(void) {
    if (thread_ready) return cudaSuccess;
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_SUCCESS;
    if (ctx == NULL) {
        r = cuInit(0);
        if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&ctx, 0);
        if (r == CUDA_SUCCESS) r = cuModuleLoadData(&module, "stand-in fatbin");
    }
    pthread_mutex_unlock(&lock);
    if (r != CUDA_SUCCESS) return cudaErrorInitializationError;
    cuCtxSetCurrent(ctx);
    thread_ready = 1;
    return cudaSuccess;
}

EXPORT void **CUDARTAPI __cudaRegisterFatBinary(void *fatCubin) {
    static void *handle;
    handle = fatCubin;
    return &handle;
}

EXPORT void CUDARTAPI __cudaRegisterFatBinaryEnd(void **handle) { (void)handle; }

EXPORT void CUDARTAPI __cudaRegisterFunction(void **handle, const char *hostFun, char *deviceFun,
                                             const char *deviceName, int thread_limit, uint3 *tid, uint3 *bid,
                                             dim3 *bDim, dim3 *gDim, int *wSize) {
    (void)handle, (void)deviceFun, (void)thread_limit, (void)tid, (void)bid, (void)bDim, (void)gDim, (void)wSize;
    pthread_mutex_lock(&lock);
    if (nkernels < MAX_KERNELS) {
        kernels[nkernels].stub = hostFun;
        kernels[nkernels].name = strdup(deviceName);
        nkernels++;
    }
    pthread_mutex_unlock(&lock);
}

static CUfunction function_of(const void *stub) {
    CUfunction f = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nkernels; i++) {
        if (kernels[i].stub != stub) continue;
        if (kernels[i].function == NULL) cuModuleGetFunction(&kernels[i].function, module, kernels[i].name);
        f = kernels[i].function;
        break;
    }
    pthread_mutex_unlock(&lock);
    return f;
}

static const char *name_of(const void *stub) {
    const char *name = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nkernels && name == NULL; i++)
        if (kernels[i].stub == stub) name = kernels[i].name;
    pthread_mutex_unlock(&lock);
    return name;
}

EXPORT cudaError_t CUDARTAPI cudaFree(void *ptr) {
    cudaFree_v3020_params p = {ptr};
    RT_API(cudaFree_v3020, &p, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    if (ptr) cuMemFree((CUdeviceptr)(uintptr_t)ptr);
    RT_RETURN(cudaSuccess);
}

EXPORT cudaError_t CUDARTAPI cudaMalloc(void **ptr, size_t size) {
    cudaMalloc_v3020_params p = {ptr, size};
    RT_API(cudaMalloc_v3020, &p, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    CUdeviceptr d;
    if (cuMemAlloc(&d, size) != CUDA_SUCCESS) RT_RETURN(cudaErrorMemoryAllocation);
    *ptr = (void *)(uintptr_t)d;
    RT_RETURN(cudaSuccess);
}

EXPORT cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t *stream) {
    cudaStreamCreate_v3020_params p = {stream};
    RT_API(cudaStreamCreate_v3020, &p, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    RT_RETURN(cuStreamCreate((CUstream *)stream, 0) == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue);
}

EXPORT cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
    cudaStreamSynchronize_v3020_params p = {stream};
    RT_API(cudaStreamSynchronize_v3020, &p, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    RT_RETURN(cuStreamSynchronize((CUstream)stream) == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidResourceHandle);
}

EXPORT cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
    RT_API(cudaDeviceSynchronize_v3020, NULL, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    cuCtxSynchronize();
    RT_RETURN(cudaSuccess);
}

EXPORT cudaError_t CUDARTAPI cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    cudaMemcpy_v3020_params p = {dst, src, count, kind};
    RT_API(cudaMemcpy_v3020, &p, NULL);
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    if (kind != cudaMemcpyHostToDevice) RT_RETURN(cudaErrorInvalidMemcpyDirection);  // all the tests need
    RT_RETURN(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, count) == CUDA_SUCCESS ? cudaSuccess
                                                                                  : cudaErrorInvalidValue);
}

EXPORT cudaError_t CUDARTAPI cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args,
                                              size_t shmem, cudaStream_t stream) {
    cudaLaunchKernel_v7000_params p = {func, grid, block, args, shmem, stream};
    RT_API(cudaLaunchKernel_v7000, &p, name_of(func));
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    CUfunction f = function_of(func);
    if (f == NULL) RT_RETURN(cudaErrorInvalidDeviceFunction);
    CUresult r = cuLaunchKernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z, (unsigned)shmem,
                                (CUstream)stream, args, NULL);
    RT_RETURN(r == CUDA_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure);
}

EXPORT cudaError_t CUDARTAPI cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func,
                                                 void **args) {
    cudaLaunchKernelExC_v11060_params p = {config, func, args};
    RT_API(cudaLaunchKernelExC_v11060, &p, name_of(func));
    cudaError_t e = ready();
    if (e != cudaSuccess) RT_RETURN(e);
    CUfunction f = function_of(func);
    if (f == NULL || config == NULL) RT_RETURN(cudaErrorInvalidDeviceFunction);
    CUlaunchConfig c = {config->gridDim.x, config->gridDim.y, config->gridDim.z, config->blockDim.x,
                        config->blockDim.y, config->blockDim.z, (unsigned)config->dynamicSmemBytes,
                        (CUstream)config->stream, NULL, 0};
    RT_RETURN(cuLaunchKernelEx(&c, f, args, NULL) == CUDA_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure);
}
