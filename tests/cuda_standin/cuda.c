// Stand-in libcuda.so.1 (tests only): the subset of NVIDIA's driver API that our CUPTI library and the test
// workloads call, with NVIDIA's signatures (cuda.h), over the simulated device described in standin.h.
//
// Like the real driver, cuInit loads the library named by CUDA_INJECTION64_PATH and calls its
// InitializeInjection; API calls report to a CUPTI tool when one is attached (standin_set_tool), with a
// fresh correlation id per call, runtime calls (from our stand-in libcudart) and the driver calls they make
// each getting their own. A kernel's activity record carries the outermost call's id, or the innermost
// with STANDIN_KERNEL_CORRELATION=inner (real CUPTI documents either); copies carry the driver call's id
// and the runtime's as runtimeCorrelationId, as CUPTI's memcpy record does.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


#include "standin.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_STREAMS 256
#define MAX_NODES 64

struct CUctx_st {
    int device;
    uint32_t id;
};
struct CUstream_st {
    struct CUctx_st *ctx;
    uint32_t id;
    uint64_t busy_until;
};
struct CUmod_st {
    int unused;
};
struct CUfunc_st {
    char *name;  // stable for the life of the process: CUPTI's records point at it
};
struct CUgraph_st {
    int n;
    CUfunction func[MAX_NODES];
    uint64_t duration[MAX_NODES];
};
struct CUgraphExec_st {
    struct CUgraph_st graph;
};

static pthread_mutex_t sim_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st contexts[8];
static struct CUstream_st *streams[MAX_STREAMS];  // [0..ndev): each context's NULL stream
static int nstreams, ndevices = 1, initialised;
static uint32_t next_stream_id = 13;
static __thread struct CUctx_st *current;
static const struct standin_tool *tool;
static int kernel_cid_inner;

// Open API calls of this thread, outermost first.
static __thread struct standin_call *open_calls[8];
static __thread int open_n;

EXPORT uint64_t standin_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// A synchronizing call waits for the device here: asleep, or with STANDIN_SYNC_SPIN=1 spinning on the clock
// as CUDA's default schedule (cudaDeviceScheduleAuto with few contexts) does, so the CPU runs while the GPU
// is busy.
static void sleep_until(uint64_t t) {
    static int spin = -1;
    if (spin < 0) spin = getenv("STANDIN_SYNC_SPIN") != NULL;
    if (spin) {
        struct timespec now;
        do clock_gettime(CLOCK_MONOTONIC, &now);
        while ((uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec < t);
        return;
    }
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

EXPORT void standin_set_tool(const struct standin_tool *t) { __atomic_store_n(&tool, t, __ATOMIC_RELEASE); }

EXPORT void standin_api_begin(struct standin_call *call, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                              const char *function, const void *params, const char *symbol) {
    memset(call, 0, sizeof *call);
    call->domain = domain;
    call->cbid = cbid;
    call->function = function;
    call->params = params;
    call->symbol = symbol;
    call->context = current;
    call->context_id = current ? current->id : 0;
    if (open_n < 8) open_calls[open_n] = call;
    open_n++;
    const struct standin_tool *t = __atomic_load_n(&tool, __ATOMIC_ACQUIRE);
    if (t) t->api(call, CUPTI_API_ENTER, NULL);
}

EXPORT void standin_api_end(struct standin_call *call, const void *ret) {
    const struct standin_tool *t = __atomic_load_n(&tool, __ATOMIC_ACQUIRE);
    if (t && call->correlation_id) t->api(call, CUPTI_API_EXIT, ret);
    if (open_n > 0) open_n--;
}

static uint32_t outermost_cid(void) { return open_n > 0 ? open_calls[0]->correlation_id : 0; }
static uint32_t innermost_cid(void) { return open_n > 0 && open_n <= 8 ? open_calls[open_n - 1]->correlation_id : 0; }
static uint32_t runtime_cid(void) {
    return open_n > 1 && open_calls[0]->domain == CUPTI_CB_DOMAIN_RUNTIME_API ? open_calls[0]->correlation_id : 0;
}

#define API(cbid_name, params_ptr, symbol)                                                       \
    struct standin_call call_;                                                                    \
    standin_api_begin(&call_, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_##cbid_name, \
                      #cbid_name, params_ptr, symbol)
#define RETURN(value)                        \
    do {                                      \
        CUresult r_ = (value);                \
        standin_api_end(&call_, &r_);         \
        return r_;                            \
    } while (0)

// ---- initialisation, devices, contexts ----------------------------------------------------------------

EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&sim_lock);
    int first = !initialised;
    if (first) {
        initialised = 1;
        const char *n = getenv("STANDIN_DEVICES");
        ndevices = n && atoi(n) > 0 && atoi(n) <= 8 ? atoi(n) : 1;
        const char *inner = getenv("STANDIN_KERNEL_CORRELATION");
        kernel_cid_inner = inner && strcmp(inner, "inner") == 0;
        for (int d = 0; d < ndevices; d++) {
            contexts[d].device = d;
            contexts[d].id = (uint32_t)d + 1;
            streams[d] = calloc(1, sizeof(struct CUstream_st));
            streams[d]->ctx = &contexts[d];
            streams[d]->id = 7;  // CUPTI's id of a context's legacy default stream
        }
        nstreams = ndevices;
    }
    pthread_mutex_unlock(&sim_lock);
    if (first) {
        // The real driver's injection protocol, done once, outside our lock (the library may call us).
        const char *path = getenv("CUDA_INJECTION64_PATH");
        if (path && *path) {
            void *lib = dlopen(path, RTLD_NOW);
            int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "InitializeInjection") : NULL;
            if (init) init();
            else fprintf(stderr, "standin libcuda: cannot inject %s: %s\n", path, dlerror());
        }
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDriverGetVersion(int *version) {
    *version = 13000;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetCount(int *count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *count = ndevices;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
    snprintf(name, (size_t)len, "fleetprof stand-in GPU %d", dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &contexts[dev];
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxGetCurrent(CUcontext *ctx) {
    *ctx = current;
    return CUDA_SUCCESS;
}

// ---- streams --------------------------------------------------------------------------------------------

static struct CUstream_st *stream_of(CUstream s) {
    // NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the current context's default stream.
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
        return current ? streams[current->device] : NULL;
    return s;
}

EXPORT CUresult CUDAAPI cuStreamCreate(CUstream *out, unsigned int flags) {
    (void)flags;
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&sim_lock);
    if (nstreams == MAX_STREAMS) {
        pthread_mutex_unlock(&sim_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct CUstream_st *s = calloc(1, sizeof *s);
    s->ctx = current;
    s->id = next_stream_id++;
    streams[nstreams++] = s;
    pthread_mutex_unlock(&sim_lock);
    *out = s;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuStreamDestroy_v2(CUstream s) {
    (void)s;  // kept: records may still name it
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
    cuStreamSynchronize_params p = {s};
    API(cuStreamSynchronize, &p, NULL);
    struct CUstream_st *st = stream_of(s);
    if (st == NULL) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    pthread_mutex_lock(&sim_lock);
    uint64_t until = st->busy_until;
    pthread_mutex_unlock(&sim_lock);
    sleep_until(until);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
    API(cuCtxSynchronize, NULL, NULL);
    if (current == NULL) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    uint64_t until = 0;
    pthread_mutex_lock(&sim_lock);
    for (int i = 0; i < nstreams; i++)
        if (streams[i]->ctx == current && streams[i]->busy_until > until) until = streams[i]->busy_until;
    pthread_mutex_unlock(&sim_lock);
    sleep_until(until);
    RETURN(CUDA_SUCCESS);
}

// Queue `duration` of work on `st`; returns its [start, end).
static void occupy(struct CUstream_st *st, uint64_t duration, uint64_t *start, uint64_t *end) {
    uint64_t now = standin_now_ns();
    pthread_mutex_lock(&sim_lock);
    uint64_t s = now + STANDIN_LAUNCH_LATENCY_NS;
    if (st->busy_until > s) s = st->busy_until;
    st->busy_until = s + duration;
    pthread_mutex_unlock(&sim_lock);
    *start = s;
    *end = s + duration;
}

static void report(CUpti_ActivityKind kind, const char *name, uint64_t start, uint64_t end, uint64_t bytes,
                   uint8_t copy_kind, struct CUstream_st *st, uint32_t correlation, uint32_t runtime_cid) {
    const struct standin_tool *t = __atomic_load_n(&tool, __ATOMIC_ACQUIRE);
    if (t)
        t->activity(kind, name, start, end, bytes, copy_kind, (uint32_t)st->ctx->device, st->ctx->id, st->id,
                    correlation, runtime_cid);
}

// ---- modules, functions, launches ---------------------------------------------------------------------

EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    (void)image;
    *module = calloc(1, sizeof(struct CUmod_st));
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
    cuModuleGetFunction_params p = {f, module, name};
    API(cuModuleGetFunction, &p, NULL);
    if (module == NULL || name == NULL || *name == '\0') RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUfunc_st *fn = calloc(1, sizeof *fn);
    fn->name = strdup(name);
    *f = fn;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult CUDAAPI cuFuncGetName(const char **name, CUfunction f) {
    *name = f->name;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, CUstream s, void **params) {
    struct CUstream_st *st = stream_of(s);
    if (st == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (f == NULL) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t duration = params && params[0] ? *(const uint64_t *)params[0] : 0, start, end;
    occupy(st, duration, &start, &end);
    report(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, f->name, start, end, 0, 0, st,
           kernel_cid_inner ? innermost_cid() : outermost_cid(), 0);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                       CUstream s, void **params, void **extra) {
    cuLaunchKernel_params p = {f, gx, gy, gz, bx, by, bz, shmem, s, params, extra};
    API(cuLaunchKernel, &p, f ? f->name : NULL);
    RETURN(launch(f, s, params));
}

EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                            unsigned int bx, unsigned int by, unsigned int bz,
                                            unsigned int shmem, CUstream s, void **params, void **extra) {
    cuLaunchKernel_ptsz_params p = {f, gx, gy, gz, bx, by, bz, shmem, s, params, extra};
    API(cuLaunchKernel_ptsz, &p, f ? f->name : NULL);
    RETURN(launch(f, s, params));
}

EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                                         void **extra) {
    cuLaunchKernelEx_params p = {config, f, params, extra};
    API(cuLaunchKernelEx, &p, f ? f->name : NULL);
    if (config == NULL) RETURN(CUDA_ERROR_INVALID_VALUE);
    RETURN(launch(f, config->hStream, params));
}

EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                  unsigned int gz, unsigned int bx, unsigned int by,
                                                  unsigned int bz, unsigned int shmem, CUstream s,
                                                  void **params) {
    cuLaunchCooperativeKernel_params p = {f, gx, gy, gz, bx, by, bz, shmem, s, params};
    API(cuLaunchCooperativeKernel, &p, f ? f->name : NULL);
    RETURN(launch(f, s, params));
}

// ---- graphs: a chain of kernel nodes, run in the order added ------------------------------------------

EXPORT CUresult CUDAAPI cuGraphCreate(CUgraph *graph, unsigned int flags) {
    (void)flags;
    *graph = calloc(1, sizeof(struct CUgraph_st));
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                                size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *np) {
    (void)deps;
    (void)ndeps;
    if (graph->n == MAX_NODES || np == NULL || np->func == NULL) return CUDA_ERROR_INVALID_VALUE;
    graph->func[graph->n] = np->func;
    graph->duration[graph->n] = np->kernelParams && np->kernelParams[0] ? *(uint64_t *)np->kernelParams[0] : 0;
    *node = (CUgraphNode)(uintptr_t)(graph->n + 1);
    graph->n++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    (void)flags;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    e->graph = *graph;
    *exec = e;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec exec, CUstream s) {
    struct CUstream_st *st = stream_of(s);
    if (st == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < exec->graph.n; i++) {
        uint64_t start, end;
        occupy(st, exec->graph.duration[i], &start, &end);
        report(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, exec->graph.func[i]->name, start, end, 0, 0, st,
               kernel_cid_inner ? innermost_cid() : outermost_cid(), 0);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream s) {
    cuGraphLaunch_params p = {exec, s};
    API(cuGraphLaunch, &p, NULL);
    RETURN(graph_launch(exec, s));
}

// ---- memory -------------------------------------------------------------------------------------------

EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr ptr) {
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

static CUresult copy(CUdeviceptr dst, const void *src, size_t n, CUstream s, int sync) {
    struct CUstream_st *st = stream_of(s);
    if (st == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    memcpy((void *)(uintptr_t)dst, src, n);
    uint64_t start, end;
    occupy(st, 1000 + n / STANDIN_COPY_BYTES_PER_NS, &start, &end);
    report(CUPTI_ACTIVITY_KIND_MEMCPY, NULL, start, end, n, CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, st, innermost_cid(),
           runtime_cid());
    if (sync) sleep_until(end);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    cuMemcpyHtoD_v2_params p = {dst, src, n};
    API(cuMemcpyHtoD_v2, &p, NULL);
    RETURN(copy(dst, src, n, NULL, 1));
}

EXPORT CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    cuMemcpyHtoDAsync_v2_params p = {dst, src, n, s};
    API(cuMemcpyHtoDAsync_v2, &p, NULL);
    RETURN(copy(dst, src, n, s, 0));
}

static CUresult set(CUdeviceptr dst, unsigned char value, size_t n, CUstream s, int sync) {
    struct CUstream_st *st = stream_of(s);
    if (st == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    memset((void *)(uintptr_t)dst, value, n);
    uint64_t start, end;
    occupy(st, 500 + n / STANDIN_SET_BYTES_PER_NS, &start, &end);
    report(CUPTI_ACTIVITY_KIND_MEMSET, NULL, start, end, n, 0, st, innermost_cid(), runtime_cid());
    if (sync) sleep_until(end);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    cuMemsetD8_v2_params p = {dst, value, n};
    API(cuMemsetD8_v2, &p, NULL);
    RETURN(set(dst, value, n, NULL, 1));
}

EXPORT CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s) {
    cuMemsetD8Async_params p = {dst, value, n, s};
    API(cuMemsetD8Async, &p, NULL);
    RETURN(set(dst, value, n, s, 0));
}
