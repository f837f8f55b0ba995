// The private seam between our stand-in libcuda.so.1, libcudart.so.13 and libcupti.so.13 (tests only).
//
// NVIDIA's CUPTI reaches into its driver through private interfaces; ours do the same through this one. The
// public faces (cuda.h, cuda_runtime_api.h, cupti.h) are NVIDIA's, compiled from NVIDIA's headers, so the
// library under test (agent/cupti/fleetprof_cupti.c) sees NVIDIA's signatures and record layouts.
//
// The simulated device: every stream runs its work in order; an operation starts when it has been launched
// for STANDIN_LAUNCH_LATENCY_NS and its stream is free, and lasts what the caller asked (a kernel: the
// uint64 nanoseconds its first kernel parameter points to; a copy: bytes at STANDIN_COPY_BYTES_PER_NS).
// Times are CLOCK_MONOTONIC, computed at launch; synchronising sleeps until the work's end, so the clock a
// test reads is the real one.
#ifndef FP_STANDIN_H
#define FP_STANDIN_H

#include <stdint.h>

#include <cuda.h>
#include <cupti.h>

#define STANDIN_LAUNCH_LATENCY_NS 2000ull
#define STANDIN_COPY_BYTES_PER_NS 10ull  // 10 GB/s
#define STANDIN_SET_BYTES_PER_NS 100ull

// One API call as the driver reports it to the tool.
struct standin_call {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId cbid;
    const char *function;
    const void *params;
    const char *symbol;   // launches: the kernel's name
    CUcontext context;
    uint32_t context_id;
    uint32_t correlation_id;  // assigned by the tool at entry (0: no tool)
    uint64_t correlation_data;
    int active;               // the tool wanted this call
};

// What the driver hands the tool (the stand-in libcupti fills this in at load).
struct standin_tool {
    // Entry and exit of a driver or runtime API call. `ret` is NULL at entry.
    void (*api)(struct standin_call *call, CUpti_ApiCallbackSite site, const void *ret);
    // A finished (simulated) activity; times CLOCK_MONOTONIC. kind: CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    // _MEMCPY or _MEMSET. The tool stores it and delivers it once `end_ns` has passed.
    void (*activity)(CUpti_ActivityKind kind, const char *name, uint64_t start_ns, uint64_t end_ns,
                     uint64_t bytes, uint8_t copy_kind, uint32_t device, uint32_t context, uint32_t stream,
                     uint32_t correlation_id, uint32_t runtime_correlation_id);
};

// Exported by the stand-in libcuda.so.1.
void standin_set_tool(const struct standin_tool *tool);
void standin_api_begin(struct standin_call *call, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                       const char *function, const void *params, const char *symbol);
void standin_api_end(struct standin_call *call, const void *ret);
uint64_t standin_now_ns(void);

#endif
