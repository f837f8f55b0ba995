// A CUDA workload of our own (tests only): launches known kernels from known functions, with known gaps,
// through NVIDIA's runtime and driver APIs (here served by the stand-ins). Every kernel's first parameter
// is its duration in ns, which the stand-in device honours. It prints one JSON line per event, times in
// CLOCK_MONOTONIC ns, so a test knows the truth:
//   {"ev":"launch","fn":F,"kernel":K,"dur":D,"enter":T0,"exit":T1,"api":"runtime"|"driver"|"graph"}
//   {"ev":"sync","enter":T0,"exit":T1}  {"ev":"load","start":T0,"end":T1}  {"ev":"done",...}
//
//   launcher phases SECONDS GAP_MS[,GAP_MS...]   train/eval steps separated by CPU-busy loads of those gaps
//   launcher loop SECONDS                        launch-bound: tiny kernels as fast as possible; prints
//                                                {"ev":"loop","launches":N,"seconds":S}
//   launcher graph N                             N launches of a 3-kernel graph
//   launcher copies N                            N memcpy + memset pairs
// With HOLD=1 in the environment it waits for a line on stdin before exiting (a test reads the process's
// memory and symbols while it lives); with WAIT_AFTER_INIT=1, also once the driver (and so the injected
// library) is initialised, before its first launch: {"ev":"initialised"}. In loop mode a number on that
// line is the least count of launches, beside SECONDS: a test that needs the ring lapped asks for it by
// count, since a slow machine launches fewer in the time.
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

#define GEMM_NAME "_Z11gemm_kernelPKfS0_Pfi"  // mangled, as nvcc names C++ kernels
#define RELU_NAME "relu_kernel"               // plain, as extern "C" / triton kernels are named
#define ADAM_NAME "adam_kernel"
#define GEMM_NS 300000ull
#define RELU_NS 60000ull
#define ADAM_NS 150000ull

// Host stubs: what nvcc generates for each __global__ function; their addresses name the kernels.
__attribute__((noinline)) void gemm_kernel_stub(void) { __asm__ volatile(""); }
__attribute__((noinline)) void relu_kernel_stub(void) { __asm__ volatile(""); }

static CUfunction adam;

static uint64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void check(int ok, const char *what, int code) {
    if (!ok) {
        fprintf(stderr, "launcher: %s failed (%d)\n", what, code);
        exit(1);
    }
}

static void log_launch(const char *fn, const char *kernel, uint64_t dur, uint64_t t0, uint64_t t1,
                       const char *api) {
    printf("{\"ev\":\"launch\",\"fn\":\"%s\",\"kernel\":\"%s\",\"dur\":%llu,\"enter\":%llu,\"exit\":%llu,"
           "\"api\":\"%s\"}\n",
           fn, kernel, (unsigned long long)dur, (unsigned long long)t0, (unsigned long long)t1, api);
}

// One launch through the runtime API (as PyTorch's own kernels launch): cudaLaunchKernel(host stub, ...).
static void runtime_launch(const char *fn, void (*stub)(void), const char *kernel, uint64_t dur) {
    void *args[] = {&dur};
    dim3 grid = {1, 1, 1}, block = {128, 1, 1};
    uint64_t t0 = now();
    cudaError_t e = cudaLaunchKernel((const void *)stub, grid, block, args, 0, NULL);
    uint64_t t1 = now();
    check(e == cudaSuccess, "cudaLaunchKernel", e);
    if (fn) log_launch(fn, kernel, dur, t0, t1, "runtime");
}

// One launch through the driver API (as cuBLAS and triton launch): cuLaunchKernelEx.
static void driver_launch(const char *fn, CUfunction f, const char *kernel, uint64_t dur) {
    void *args[] = {&dur};
    CUlaunchConfig config = {1, 1, 1, 128, 1, 1, 0, NULL, NULL, 0};
    uint64_t t0 = now();
    CUresult r = cuLaunchKernelEx(&config, f, args, NULL);
    uint64_t t1 = now();
    check(r == CUDA_SUCCESS, "cuLaunchKernelEx", r);
    log_launch(fn, kernel, dur, t0, t1, "driver");
}

__attribute__((noinline)) void optimizer_step(void) { driver_launch("optimizer_step", adam, ADAM_NAME, ADAM_NS); }

__attribute__((noinline)) void train_step(void) {
    runtime_launch("train_step", gemm_kernel_stub, GEMM_NAME, GEMM_NS);
    runtime_launch("train_step", relu_kernel_stub, RELU_NAME, RELU_NS);
    runtime_launch("train_step", gemm_kernel_stub, GEMM_NAME, GEMM_NS);
    runtime_launch("train_step", relu_kernel_stub, RELU_NAME, RELU_NS);
    optimizer_step();
}

// relu is also launched from here: a kernel name under two launching functions.
__attribute__((noinline)) void eval_step(void) { runtime_launch("eval_step", relu_kernel_stub, RELU_NAME, RELU_NS); }

__attribute__((noinline)) void synchronize(void) {
    uint64_t t0 = now();
    cudaError_t e = cudaDeviceSynchronize();
    uint64_t t1 = now();
    check(e == cudaSuccess, "cudaDeviceSynchronize", e);
    printf("{\"ev\":\"sync\",\"enter\":%llu,\"exit\":%llu}\n", (unsigned long long)t0, (unsigned long long)t1);
}

// The slow data loader: the CPU is busy here while the GPU waits.
__attribute__((noinline)) void load_batch(uint64_t gap_ns) {
    uint64_t t0 = now(), t1;
    volatile uint64_t x = 0;
    while ((t1 = now()) < t0 + gap_ns) x += t1;
    printf("{\"ev\":\"load\",\"start\":%llu,\"end\":%llu}\n", (unsigned long long)t0, (unsigned long long)t1);
}

static void phases(double seconds, const char *gaps_ms) {
    uint64_t gaps[64];
    int ngaps = 0;
    char *copy = strdup(gaps_ms), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && ngaps < 64; tok = strtok_r(NULL, ",", &save))
        gaps[ngaps++] = (uint64_t)(atof(tok) * 1e6);
    check(ngaps > 0, "parsing the gaps", 0);
    uint64_t end = now() + (uint64_t)(seconds * 1e9);
    int step = 0;
    while (now() < end) {
        train_step();
        if (step % 2 == 1) eval_step();
        synchronize();
        load_batch(gaps[step % ngaps]);
        step++;
    }
    synchronize();
    printf("{\"ev\":\"done\",\"steps\":%d}\n", step);
}

// Launch-bound: zero-length kernels back to back through the runtime API.
__attribute__((noinline)) void launch_loop(double seconds, uint64_t at_least) {
    uint64_t start = now(), end = start + (uint64_t)(seconds * 1e9), n = 0, t;
    do {
        for (int i = 0; i < 256; i++) runtime_launch(NULL, relu_kernel_stub, RELU_NAME, 0);
        n += 256;
    } while ((t = now()) < end || n < at_least);
    cudaDeviceSynchronize();
    printf("{\"ev\":\"loop\",\"launches\":%llu,\"seconds\":%.6f}\n", (unsigned long long)n, (t - start) / 1e9);
}

__attribute__((noinline)) void graph_step(CUgraphExec exec) {
    uint64_t t0 = now();
    CUresult r = cuGraphLaunch(exec, NULL);
    uint64_t t1 = now();
    check(r == CUDA_SUCCESS, "cuGraphLaunch", r);
    log_launch("graph_step", "graph", GEMM_NS + RELU_NS + ADAM_NS, t0, t1, "graph");
}

static void graph(int n) {
    CUmodule module;
    CUfunction f[3];
    const char *names[3] = {GEMM_NAME, RELU_NAME, ADAM_NAME};
    static uint64_t durs[3] = {GEMM_NS, RELU_NS, ADAM_NS};
    check(cuModuleLoadData(&module, "graph module") == CUDA_SUCCESS, "cuModuleLoadData", 0);
    CUgraph g;
    check(cuGraphCreate(&g, 0) == CUDA_SUCCESS, "cuGraphCreate", 0);
    CUgraphNode prev = NULL;
    for (int i = 0; i < 3; i++) {
        check(cuModuleGetFunction(&f[i], module, names[i]) == CUDA_SUCCESS, "cuModuleGetFunction", i);
        void *args[] = {&durs[i]};
        CUDA_KERNEL_NODE_PARAMS p = {0};
        p.func = f[i];
        p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimX = p.blockDimY = p.blockDimZ = 1;
        p.kernelParams = args;
        CUgraphNode node;
        check(cuGraphAddKernelNode(&node, g, prev ? &prev : NULL, prev ? 1 : 0, &p) == CUDA_SUCCESS,
              "cuGraphAddKernelNode", i);
        prev = node;
    }
    CUgraphExec exec;
    check(cuGraphInstantiate(&exec, g, 0) == CUDA_SUCCESS, "cuGraphInstantiate", 0);
    for (int i = 0; i < n; i++) graph_step(exec);
    synchronize();
}

__attribute__((noinline)) void upload(int n) {
    void *dst = NULL;
    static char host[1 << 20];
    check(cudaMalloc(&dst, sizeof host) == cudaSuccess, "cudaMalloc", 0);
    for (int i = 0; i < n; i++) {
        check(cudaMemcpy(dst, host, sizeof host, cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy", i);
        check(cuMemsetD8((CUdeviceptr)(uintptr_t)dst, 0, 4096) == CUDA_SUCCESS, "cuMemsetD8", i);
    }
    synchronize();
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) {
        fprintf(stderr, "usage: launcher phases SECONDS GAPS_MS | loop SECONDS | graph N | copies N\n");
        return 2;
    }
    // What nvcc's generated code does at start-up: register each kernel under its host stub.
    static char fatbin[16];
    void **handle = __cudaRegisterFatBinary(fatbin);
    __cudaRegisterFunction(handle, (const char *)gemm_kernel_stub, GEMM_NAME, GEMM_NAME, -1, 0, 0, 0, 0, 0);
    __cudaRegisterFunction(handle, (const char *)relu_kernel_stub, RELU_NAME, RELU_NAME, -1, 0, 0, 0, 0, 0);
    __cudaRegisterFatBinaryEnd(handle);
    // cudaFree(0): the customary way to make the runtime initialise the driver (and so the injection).
    check(cudaFree(0) == cudaSuccess, "cudaFree(0)", 0);
    CUmodule module;
    check(cuModuleLoadData(&module, "optimizer module") == CUDA_SUCCESS, "cuModuleLoadData", 0);
    check(cuModuleGetFunction(&adam, module, ADAM_NAME) == CUDA_SUCCESS, "cuModuleGetFunction", 0);

    unsigned long long at_least = 0;
    if (getenv("WAIT_AFTER_INIT")) {  // the injection is loaded: a test lets the agent find it first
        printf("{\"ev\":\"initialised\"}\n");
        char line[32];
        if (fgets(line, sizeof line, stdin) != NULL) at_least = strtoull(line, NULL, 10);  // EOF: go on
    }
    if (!strcmp(argv[1], "phases") && argc >= 4) phases(atof(argv[2]), argv[3]);
    else if (!strcmp(argv[1], "loop")) launch_loop(atof(argv[2]), at_least);
    else if (!strcmp(argv[1], "graph")) graph(atoi(argv[2]));
    else if (!strcmp(argv[1], "copies")) upload(atoi(argv[2]));
    else {
        fprintf(stderr, "launcher: unknown mode %s\n", argv[1]);
        return 2;
    }
    if (getenv("HOLD")) {
        printf("{\"ev\":\"holding\"}\n");
        char line[16];
        if (fgets(line, sizeof line, stdin) == NULL) { /* EOF: exit too */ }
    }
    return 0;
}
