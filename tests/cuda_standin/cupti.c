// Stand-in libcupti.so.13 (tests only): the CUPTI calls our library makes, with NVIDIA's signatures and
// record layouts (cupti.h), on top of the stand-in driver (standin.h).
//
// As CUPTI does: one subscriber per process (a second cuptiSubscribe fails with
// CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED); callbacks only for the (domain, cbid) pairs enabled,
// with CUpti_CallbackData filled in at entry and exit; activity records written into buffers the client
// hands out through its buffer-requested callback and returned through buffer-completed once full or
// flushed; a record is delivered only after its activity ended; no buffer means the records are dropped
// and counted (cuptiActivityGetNumDroppedRecords). Timestamps are CLOCK_REALTIME nanoseconds (CUPTI's
// default on Linux) unless a timestamp callback is registered, whose clock they are then converted to.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "standin.h"

#define EXPORT __attribute__((visibility("default")))
#define WORKER_PERIOD_NS 5000000ull  // how often full buffers are handed back without a flush

struct pending {
    CUpti_ActivityKind kind;
    const char *name;
    uint64_t start, end, bytes;
    uint8_t copy_kind;
    uint32_t device, context, stream, correlation, runtime_correlation;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t deliver_lock = PTHREAD_MUTEX_INITIALIZER;  // one delivery at a time, in order
static int subscribed;
static CUpti_CallbackFunc subscriber_fn;
static void *subscriber_data;
static uint8_t enabled_cb[2][1024];  // [driver, runtime][cbid]
static int activity_on[64];
static CUpti_BuffersCallbackRequestFunc buffer_requested;
static CUpti_BuffersCallbackCompleteFunc buffer_completed;
static int64_t clock_offset;  // added to CLOCK_MONOTONIC to get the record's clock
static uint32_t next_correlation = 1;
static struct pending *pending;
static size_t pending_n, pending_cap;
static uint64_t dropped;
static uint8_t *buf;
static size_t buf_size, buf_used;
static int worker_started;

static int64_t realtime_minus_monotonic(void) {
    struct timespec r, m;
    clock_gettime(CLOCK_REALTIME, &r);
    clock_gettime(CLOCK_MONOTONIC, &m);
    return ((int64_t)r.tv_sec - (int64_t)m.tv_sec) * 1000000000ll + ((int64_t)r.tv_nsec - (int64_t)m.tv_nsec);
}

static int any_activity(void) {
    for (int i = 0; i < 64; i++)
        if (activity_on[i]) return 1;
    return 0;
}

// ---- callbacks ----------------------------------------------------------------------------------------

static void tool_api(struct standin_call *call, CUpti_ApiCallbackSite site, const void *ret) {
    if (site == CUPTI_API_ENTER) {
        if (!subscribed && !any_activity()) return;
        call->correlation_id = __atomic_fetch_add(&next_correlation, 1, __ATOMIC_RELAXED);
        int d = call->domain == CUPTI_CB_DOMAIN_RUNTIME_API;
        call->active = subscribed && call->cbid < 1024 && enabled_cb[d][call->cbid];
    }
    if (!call->active) return;
    CUpti_CallbackData data = {
        .callbackSite = site,
        .functionName = call->function,
        .functionParams = call->params,
        .functionReturnValue = (void *)ret,
        .symbolName = call->symbol,
        .context = call->context,
        .contextUid = call->context_id,
        .correlationData = &call->correlation_data,
        .correlationId = call->correlation_id,
    };
    subscriber_fn(subscriber_data, call->domain, call->cbid, &data);
}

static void tool_activity(CUpti_ActivityKind kind, const char *name, uint64_t start, uint64_t end,
                          uint64_t bytes, uint8_t copy_kind, uint32_t device, uint32_t context, uint32_t stream,
                          uint32_t correlation, uint32_t runtime_correlation) {
    CUpti_ActivityKind enabled_as = kind;
    if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && !activity_on[kind] && activity_on[CUPTI_ACTIVITY_KIND_KERNEL])
        enabled_as = CUPTI_ACTIVITY_KIND_KERNEL;
    if (!activity_on[enabled_as]) return;
    pthread_mutex_lock(&lock);
    if (pending_n == pending_cap) {
        size_t cap = pending_cap ? pending_cap * 2 : 4096;
        struct pending *p = realloc(pending, cap * sizeof *p);
        if (p == NULL) {
            dropped++;
            pthread_mutex_unlock(&lock);
            return;
        }
        pending = p;
        pending_cap = cap;
    }
    pending[pending_n++] = (struct pending){enabled_as, name, start, end, bytes, copy_kind, device, context,
                                            stream, correlation, runtime_correlation};
    pthread_mutex_unlock(&lock);
}

static const struct standin_tool tool = {tool_api, tool_activity};

__attribute__((constructor)) static void attach(void) {
    clock_offset = realtime_minus_monotonic();
    standin_set_tool(&tool);
}

// ---- activity records ---------------------------------------------------------------------------------

static size_t record_size(CUpti_ActivityKind kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_MEMSET: return sizeof(CUpti_ActivityMemset4);
    default: return 0;
    }
}

static void write_record(uint8_t *at, const struct pending *p) {
    uint64_t start = (uint64_t)((int64_t)p->start + clock_offset), end = (uint64_t)((int64_t)p->end + clock_offset);
    memset(at, 0, record_size(p->kind));
    if (p->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
        CUpti_ActivityMemcpy6 *r = (CUpti_ActivityMemcpy6 *)at;
        r->kind = p->kind;
        r->copyKind = p->copy_kind;
        r->bytes = p->bytes;
        r->start = start;
        r->end = end;
        r->deviceId = p->device;
        r->contextId = p->context;
        r->streamId = p->stream;
        r->correlationId = p->correlation;
        r->runtimeCorrelationId = p->runtime_correlation;
    } else if (p->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
        CUpti_ActivityMemset4 *r = (CUpti_ActivityMemset4 *)at;
        r->kind = p->kind;
        r->bytes = p->bytes;
        r->start = start;
        r->end = end;
        r->deviceId = p->device;
        r->contextId = p->context;
        r->streamId = p->stream;
        r->correlationId = p->correlation;
    } else {
        CUpti_ActivityKernel10 *r = (CUpti_ActivityKernel10 *)at;
        r->kind = p->kind;
        r->start = start;
        r->end = end;
        r->completed = end;
        r->deviceId = p->device;
        r->contextId = p->context;
        r->streamId = p->stream;
        r->correlationId = p->correlation;
        r->name = p->name;
        r->gridX = r->gridY = r->gridZ = r->blockX = r->blockY = r->blockZ = 1;
    }
}

static void hand_back(void) {  // with deliver_lock held, lock not held
    if (buf == NULL) return;
    uint8_t *b = buf;
    size_t size = buf_size, used = buf_used;
    buf = NULL;
    buf_used = buf_size = 0;
    buffer_completed(NULL, 0, b, size, used);
}

// Move records whose activity has ended into buffers; hand back full ones, and the last one if `all`.
static struct pending *ready;
static size_t ready_cap;

static void deliver(int all) {
    if (buffer_requested == NULL || buffer_completed == NULL) return;
    pthread_mutex_lock(&deliver_lock);
    uint64_t now = standin_now_ns();
    size_t n = 0, keep = 0;
    pthread_mutex_lock(&lock);
    if (ready_cap < pending_n) {
        struct pending *r = realloc(ready, pending_n * sizeof *r);
        if (r != NULL) {
            ready = r;
            ready_cap = pending_n;
        }
    }
    for (size_t i = 0; i < pending_n; i++) {  // one pass, launch order kept on both sides
        if (pending[i].end <= now && n < ready_cap) ready[n++] = pending[i];
        else pending[keep++] = pending[i];
    }
    pending_n = keep;
    pthread_mutex_unlock(&lock);
    for (size_t i = 0; i < n; i++) {
        size_t need = record_size(ready[i].kind);
        if (buf != NULL && buf_used + need > buf_size) hand_back();
        if (buf == NULL) {
            size_t max_records = 0;
            buffer_requested(&buf, &buf_size, &max_records);
            if (buf == NULL || buf_size < need) {
                buf = NULL;
                buf_size = 0;
                __atomic_fetch_add(&dropped, 1, __ATOMIC_RELAXED);
                continue;
            }
        }
        write_record(buf + buf_used, &ready[i]);
        buf_used += (need + 7) & ~(size_t)7;
    }
    if (all) hand_back();
    pthread_mutex_unlock(&deliver_lock);
}

static void *worker(void *arg) {
    (void)arg;
    struct timespec period = {0, (long)WORKER_PERIOD_NS};
    for (;;) {
        nanosleep(&period, NULL);
        deliver(0);
    }
    return NULL;
}

static void start_worker(void) {
    if (__atomic_exchange_n(&worker_started, 1, __ATOMIC_ACQ_REL)) return;
    pthread_t t;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    if (pthread_create(&t, NULL, worker, NULL) == 0) pthread_detach(t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

// ---- the CUPTI API --------------------------------------------------------------------------------------

EXPORT CUptiResult CUPTIAPI cuptiGetVersion(uint32_t *version) {
    *version = CUPTI_API_VERSION;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiGetResultString(CUptiResult result, const char **str) {
    switch (result) {
    case CUPTI_SUCCESS: *str = "CUPTI_SUCCESS"; break;
    case CUPTI_ERROR_INVALID_PARAMETER: *str = "CUPTI_ERROR_INVALID_PARAMETER"; break;
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED: *str = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"; break;
    case CUPTI_ERROR_MAX_LIMIT_REACHED: *str = "CUPTI_ERROR_MAX_LIMIT_REACHED"; break;
    default: *str = "CUPTI_ERROR_UNKNOWN"; return CUPTI_ERROR_INVALID_PARAMETER;
    }
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiSubscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback,
                                           void *userdata) {
    if (subscriber == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    if (__atomic_exchange_n(&subscribed, 1, __ATOMIC_ACQ_REL)) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    subscriber_fn = callback;
    subscriber_data = userdata;
    *subscriber = (CUpti_SubscriberHandle)&subscribed;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiUnsubscribe(CUpti_SubscriberHandle subscriber) {
    (void)subscriber;
    memset(enabled_cb, 0, sizeof enabled_cb);
    __atomic_store_n(&subscribed, 0, __ATOMIC_RELEASE);
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle subscriber,
                                                CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    if (subscriber != (CUpti_SubscriberHandle)&subscribed || cbid >= 1024 ||
        (domain != CUPTI_CB_DOMAIN_DRIVER_API && domain != CUPTI_CB_DOMAIN_RUNTIME_API))
        return CUPTI_ERROR_INVALID_PARAMETER;
    enabled_cb[domain == CUPTI_CB_DOMAIN_RUNTIME_API][cbid] = enable != 0;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc requested,
                                                           CUpti_BuffersCallbackCompleteFunc completed) {
    if (requested == NULL || completed == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    buffer_requested = requested;
    buffer_completed = completed;
    start_worker();
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityRegisterTimestampCallback(CUpti_TimestampCallbackFunc fn) {
    if (fn == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    // Calibrated as a real tool would: the reading of `fn` bracketed by two of ours, tightest of a few.
    int64_t best_width = INT64_MAX, offset = 0;
    for (int i = 0; i < 8; i++) {
        int64_t a = (int64_t)standin_now_ns(), c = (int64_t)fn(), b = (int64_t)standin_now_ns();
        if (b - a < best_width) {
            best_width = b - a;
            offset = c - (a + (b - a) / 2);
        }
    }
    clock_offset = offset;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityEnable(CUpti_ActivityKind kind) {
    if (record_size(kind) == 0) return CUPTI_ERROR_NOT_COMPATIBLE;
    activity_on[kind] = 1;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityDisable(CUpti_ActivityKind kind) {
    if ((unsigned)kind < 64) activity_on[kind] = 0;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, CUpti_Activity **record) {
    uint8_t *at = *record == NULL ? buffer : (uint8_t *)*record + ((record_size((*record)->kind) + 7) & ~(size_t)7);
    if (at + sizeof(CUpti_ActivityKind) > buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    size_t size = record_size(((CUpti_Activity *)at)->kind);
    if (size == 0 || at + size > buffer + valid) return CUPTI_ERROR_INVALID_KIND;
    *record = (CUpti_Activity *)at;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityGetNumDroppedRecords(CUcontext ctx, uint32_t stream, size_t *n) {
    (void)ctx;
    (void)stream;
    *n = (size_t)__atomic_exchange_n(&dropped, 0, __ATOMIC_ACQ_REL);
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;  // records of work still running are never delivered (they are not complete)
    deliver(1);
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult CUPTIAPI cuptiGetTimestamp(uint64_t *timestamp) {
    *timestamp = (uint64_t)((int64_t)standin_now_ns() + clock_offset);
    return CUPTI_SUCCESS;
}
