// A CUDA workload of our own for the agent's uprobes (tests only): known kernels launched from known
// functions through the runtime and the driver, and synchronising calls that wait known times, on the
// stand-ins. Host stubs carry the kernel's mangled name, as nvcc's generated host functions do.
//
//   probed SECONDS [SYNC_US]   repeat, for SECONDS: train_step (2 x gemm, runtime), eval_step (relu, driver
//                              cuLaunchKernel), graph_step (cuGraphLaunch), wait_for_gpu (a SYNC_US kernel
//                              then cudaStreamSynchronize), and a cudaMalloc/cudaFree pair
//   probed loop SECONDS        launch-bound: zero-length gemm kernels through cudaLaunchKernel
//
// It prints {"ev":"ready"} and waits for a line on stdin (the test attaches its probes), then at the end one
// line of what it did: {"ev":"done","train":N,"eval":N,"graph":N,"waits":N,"allocs":N,"wait_ns":[...]} (each
// wait's own duration, measured around the call), or {"ev":"loop","launches":N,"seconds":S}.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

void **__cudaRegisterFatBinary(void *fatCubin);
void __cudaRegisterFatBinaryEnd(void **handle);
void __cudaRegisterFunction(void **handle, const char *hostFun, char *deviceFun, const char *deviceName,
                            int thread_limit, uint3 *tid, uint3 *bid, dim3 *bDim, dim3 *gDim, int *wSize);

#define GEMM_NAME "_Z11gemm_kernelPKfS0_Pfi"
#define SLEEP_NAME "_Z12sleep_kernelm"
#define RELU_NAME "relu_kernel"

// The host stubs, named as nvcc names them: the kernel's own (mangled) symbol.
__attribute__((noinline)) void gemm_stub(void) __asm__(GEMM_NAME);
__attribute__((noinline)) void gemm_stub(void) { __asm__ volatile(""); }
__attribute__((noinline)) void sleep_stub(void) __asm__(SLEEP_NAME);
__attribute__((noinline)) void sleep_stub(void) { __asm__ volatile(""); }

static CUfunction relu;
static CUgraphExec graph;

static uint64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void check(int ok, const char *what, int code) {
    if (!ok) {
        fprintf(stderr, "probed: %s failed (%d)\n", what, code);
        exit(1);
    }
}

static void runtime_launch(void (*stub)(void), uint64_t dur) {
    void *args[] = {&dur};
    dim3 grid = {1, 1, 1}, block = {128, 1, 1};
    cudaError_t e = cudaLaunchKernel((const void *)stub, grid, block, args, 0, NULL);
    check(e == cudaSuccess, "cudaLaunchKernel", e);
}

__attribute__((noinline)) void train_step(void) {
    runtime_launch(gemm_stub, 1000);
    runtime_launch(gemm_stub, 1000);
}

__attribute__((noinline)) void eval_step(void) {
    uint64_t dur = 1000;
    void *args[] = {&dur};
    CUresult r = cuLaunchKernel(relu, 1, 1, 1, 128, 1, 1, 0, NULL, args, NULL);
    check(r == CUDA_SUCCESS, "cuLaunchKernel", r);
}

__attribute__((noinline)) void graph_step(void) {
    CUresult r = cuGraphLaunch(graph, NULL);
    check(r == CUDA_SUCCESS, "cuGraphLaunch", r);
}

// A kernel of `sync_ns`, then wait for it: the wait is the kernel's length (plus the launch latency).
__attribute__((noinline)) uint64_t wait_for_gpu(uint64_t sync_ns) {
    runtime_launch(sleep_stub, sync_ns);
    uint64_t t0 = now();
    cudaError_t e = cudaStreamSynchronize(NULL);
    uint64_t t1 = now();
    check(e == cudaSuccess, "cudaStreamSynchronize", e);
    return t1 - t0;
}

__attribute__((noinline)) void allocate(void) {
    void *p = NULL;
    check(cudaMalloc(&p, 4096) == cudaSuccess, "cudaMalloc", 0);
    check(cudaFree(p) == cudaSuccess, "cudaFree", 0);
}

static void setup(void) {
    static char fatbin[16];
    void **handle = __cudaRegisterFatBinary(fatbin);
    __cudaRegisterFunction(handle, (const char *)gemm_stub, GEMM_NAME, GEMM_NAME, -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(handle, (const char *)sleep_stub, SLEEP_NAME, SLEEP_NAME, -1, 0, 0, 0, 0, 0);
    __cudaRegisterFatBinaryEnd(handle);
    printf("{\"ev\":\"ready\"}\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) { /* EOF: go on */ }
    // After the probes are attached, so the driver's names are learnt at cuModuleGetFunction's return.
    check(cudaFree(0) == cudaSuccess, "cudaFree(0)", 0);
    CUmodule module;
    check(cuModuleLoadData(&module, "probed module") == CUDA_SUCCESS, "cuModuleLoadData", 0);
    check(cuModuleGetFunction(&relu, module, RELU_NAME) == CUDA_SUCCESS, "cuModuleGetFunction", 0);
    CUgraph g;
    check(cuGraphCreate(&g, 0) == CUDA_SUCCESS, "cuGraphCreate", 0);
    static uint64_t dur = 1000;
    void *args[] = {&dur};
    CUDA_KERNEL_NODE_PARAMS p = {0};
    p.func = relu;
    p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimX = p.blockDimY = p.blockDimZ = 1;
    p.kernelParams = args;
    CUgraphNode node;
    check(cuGraphAddKernelNode(&node, g, NULL, 0, &p) == CUDA_SUCCESS, "cuGraphAddKernelNode", 0);
    check(cuGraphInstantiate(&graph, g, 0) == CUDA_SUCCESS, "cuGraphInstantiate", 0);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: probed SECONDS [SYNC_US] | probed loop SECONDS\n");
        return 2;
    }
    setup();
    if (!strcmp(argv[1], "loop")) {
        uint64_t start = now(), end = start + (uint64_t)(atof(argv[2]) * 1e9), n = 0, t;
        do {
            for (int i = 0; i < 256; i++) runtime_launch(gemm_stub, 0);
            n += 256;
        } while ((t = now()) < end);
        cudaDeviceSynchronize();
        printf("{\"ev\":\"loop\",\"launches\":%llu,\"seconds\":%.6f}\n", (unsigned long long)n, (t - start) / 1e9);
        return 0;
    }
    uint64_t end = now() + (uint64_t)(atof(argv[1]) * 1e9);
    uint64_t sync_ns = (uint64_t)(argc > 2 ? atof(argv[2]) : 3000) * 1000;
    int steps = 0;
    static uint64_t waits[100000];
    while (now() < end && steps < 100000) {
        train_step();
        eval_step();
        graph_step();
        waits[steps] = wait_for_gpu(sync_ns);
        allocate();
        steps++;
    }
    printf("{\"ev\":\"done\",\"train\":%d,\"eval\":%d,\"graph\":%d,\"waits\":%d,\"allocs\":%d,\"wait_ns\":[", steps,
           steps, steps, steps, steps);
    for (int i = 0; i < steps; i++) printf(i ? ",%llu" : "%llu", (unsigned long long)waits[i]);
    printf("]}\n");
    return 0;
}
