// A CUPTI client that asks for what our library asks for and does nothing with it (bench only): the same
// launch callbacks, the same activity kinds, buffers handed back untouched. bench/cuda_launch_cost.py runs it
// beside our library so that what the stand-in CUPTI itself costs is not charged to us.
#include <dlfcn.h>
#include <stdlib.h>

#include <cupti.h>

static CUptiResult (*enable_callback)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
static CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);

static void CUPTIAPI on_api(void *u, CUpti_CallbackDomain d, CUpti_CallbackId c, const void *data) {
    (void)u, (void)d, (void)c, (void)data;
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max) {
    *size = 256 << 10;
    *buffer = malloc(*size);
    *max = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (next_record(buffer, valid, &r) == CUPTI_SUCCESS) {
    }
    free(buffer);
}

__attribute__((visibility("default"))) int InitializeInjection(void) {
    void *h = dlopen("libcupti.so.13", RTLD_NOW);
    if (h == NULL) return 1;
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *) = dlsym(h, "cuptiSubscribe");
    CUptiResult (*callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) =
        dlsym(h, "cuptiActivityRegisterCallbacks");
    CUptiResult (*enable)(CUpti_ActivityKind) = dlsym(h, "cuptiActivityEnable");
    enable_callback = dlsym(h, "cuptiEnableCallback");
    next_record = dlsym(h, "cuptiActivityGetNextRecord");
    CUpti_SubscriberHandle s;
    if (subscribe(&s, on_api, NULL) != CUPTI_SUCCESS) return 1;
    enable_callback(1, s, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000);
    enable_callback(1, s, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel);
    callbacks(requested, completed);
    enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    enable(CUPTI_ACTIVITY_KIND_MEMCPY);
    enable(CUPTI_ACTIVITY_KIND_MEMSET);
    return 1;
}
