// Calls NVIDIA's real libcudart (tests only): dlopen()s the file given, then calls cudaLaunchKernel N times
// from launch_from_here() with the host stub fleetprof_test_kernel_stub. Without a GPU driver every call
// fails at once ("no driver"), but each is made: what the agent's uprobes on cudaLaunchKernel need to see.
// Prints {"calls":N,"error":E,"error_name":"..."} and, with HOLD=1, waits for a line on stdin first. With
// SPIN=1 as well it keeps calling into libcudart while it waits (cudaGetErrorName): a real agent described
// the process at its exec, before the dlopen(), and learns of the library when a sample's walk lands in it
// (a trainer's do, in its launches): then it reads the mappings again and attaches the probes (the arm64
// guest's test, tests/support/arm64_guest_driver.py). With LINGER=1 it then waits for stdin to close before it
// exits (that test, once the collector has its launches).
#include <dlfcn.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

typedef cudaError_t (*launch_fn)(const void *, dim3, dim3, void **, size_t, cudaStream_t);
typedef const char *(*name_fn)(cudaError_t);

// The host stub a real nvcc build would pass: its address is the launch's first argument.
__attribute__((noinline)) void fleetprof_test_kernel_stub(void) { __asm__ volatile(""); }

__attribute__((noinline)) cudaError_t launch_from_here(launch_fn launch, int n) {
    cudaError_t last = cudaSuccess;
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    for (int i = 0; i < n; i++) last = launch((const void *)fleetprof_test_kernel_stub, grid, block, NULL, 0, NULL);
    return last;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cudart_real LIBCUDART N\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "cudart_real: %s\n", dlerror());
        return 1;
    }
    launch_fn launch = (launch_fn)dlsym(lib, "cudaLaunchKernel");
    name_fn name = (name_fn)dlsym(lib, "cudaGetErrorName");
    if (launch == NULL || name == NULL) {
        fprintf(stderr, "cudart_real: cudaLaunchKernel or cudaGetErrorName missing\n");
        return 1;
    }
    if (getenv("HOLD")) {
        printf("{\"holding\":true}\n");
        fflush(stdout);
        if (getenv("SPIN")) {
            struct pollfd in = {0, POLLIN, 0};
            volatile unsigned long x = 0;
            while (poll(&in, 1, 0) == 0)
                for (int i = 0; i < 1000000; i++) x += (unsigned long)name((cudaError_t)(i & 63));
        }
        char line[16];
        if (fgets(line, sizeof line, stdin) == NULL) { /* EOF: go on */ }
    }
    int n = atoi(argv[2]);
    cudaError_t e = launch_from_here(launch, n);
    printf("{\"calls\":%d,\"error\":%d,\"error_name\":\"%s\"}\n", n, (int)e, name(e));
    if (getenv("LINGER")) {   // alive until stdin closes: the agent names its launches from its live mappings
        fflush(stdout);
        char rest[16];
        while (fgets(rest, sizeof rest, stdin) != NULL) {}
    }
    return 0;
}
