// libfleetprof_cupti.so: a CUPTI client that a CUDA process loads by setting CUDA_INJECTION64_PATH to this
// library. It records kernel, memcpy and memset activity with CLOCK_MONOTONIC times, samples launches in
// user space, and leaves everything in one static ring (fleetprof_cupti_ring.h) that the fleetprof agent
// reads through /proc/PID/mem. README.md beside this file is the user's documentation.
//
// Rules this file keeps:
//   * It never blocks or crashes the workload. No call here waits on the agent; the workload's launching
//     threads take no lock (atomics and thread-local state only). When the ring is full the oldest records
//     are overwritten and the reader counts the gap; when buffers run out CUPTI drops and we count.
//   * Every failure leaves the process running without us: a missing libcupti, a CUPTI call that fails
//     (another subscriber: torch.profiler, nsys), or FLEETPROF_CUPTI=0 set the header's state and return.
//   * Bounded memory, fixed at build time: the ring object (FP_CUPTI_RING_BYTES, 5 MiB), at most
//     FP_CUPTI_MAX_BUFFERS activity buffers of FP_CUPTI_BUFFER_BYTES (2 MiB), two name tables (256 KiB).
//   * libcupti is dlopen()ed, never linked: the process's own CUPTI (12.x or 13.x) is used, and a process
//     without one is untouched. Only the fields of CUPTI's records whose offsets have been the same from
//     CUPTI 12 to 13.5 are read (static asserts below).
//   * One launch is one launch: a runtime call (cudaLaunchKernel) and the driver call it makes
//     (cuLaunchKernel) are both seen, and a per-thread depth keeps the outermost one; the launch record
//     names both correlation ids, since a kernel record may carry either.
//   * Sampled launches call fleetprof_cupti_launch(correlation_id, weight): an exported function that
//     does nothing, for the agent's uprobe to take the CPU stack. Unsampled launches never reach it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cupti.h>

#include "fleetprof_cupti_ring.h"

#define FP_EXPORT __attribute__((visibility("default")))

#define FP_CUPTI_BUFFER_BYTES (256u << 10)
#define FP_CUPTI_MAX_BUFFERS 8
#define FP_NAME_TABLE 16384u              // entries in each name table (a power of two)
#define FP_NAME_TABLE_MAX (FP_NAME_TABLE * 3 / 4)
#define FP_MAX_DEPTH 64                   // launch calls nested deeper than this are a broken pairing

#define FP_DEFAULT_SAMPLE_EVERY 8u
// Sampled launches per second per thread (0: no cap). Each costs the agent's uprobe and stack walk (about
// 6 µs with a BPF user-stack walk, measured in bench/cuda_launch_cost.py): 1,000/s bounds that to ~0.6% of
// a launching thread however fast it launches.
#define FP_DEFAULT_SAMPLE_CAP 1000u
#define FP_DEFAULT_FLUSH_MS 100u
#define FP_WINDOW_NS 100000000ull         // the rate cap looks at the launch rate over windows this long

// ---- the ring object ----------------------------------------------------------------------------------

struct fp_ring_object {
    struct fp_cupti_header header;
    uint8_t header_pad[FP_CUPTI_RECORDS_OFFSET - sizeof(struct fp_cupti_header)];
    struct fp_cupti_record records[FP_CUPTI_CAPACITY];
    char names[FP_CUPTI_NAMES_BYTES];
};
_Static_assert(offsetof(struct fp_ring_object, records) == FP_CUPTI_RECORDS_OFFSET, "records offset");
_Static_assert(offsetof(struct fp_ring_object, names) == FP_CUPTI_NAMES_OFFSET, "names offset");
_Static_assert(sizeof(struct fp_ring_object) == FP_CUPTI_RING_BYTES, "ring size");

// Zero-initialised, so it lands in .bss: the file stays small and untouched pages cost nothing.
FP_EXPORT struct fp_ring_object fleetprof_cupti_ring __attribute__((aligned(4096)));

#define H (fleetprof_cupti_ring.header)

// ---- CUPTI's record layouts: the stable prefix we read ------------------------------------------------
// The kernel, memcpy and memset records grew new versions at their ends (Kernel9 in CUPTI 12.9, Kernel10
// in 13.0, Kernel13 in 13.5); the fields below kept their offsets in all of them. A header set where they
// moved fails to compile here rather than misreading records.
#define FP_KERNEL_T CUpti_ActivityKernel10
#define FP_MEMCPY_T CUpti_ActivityMemcpy6
#define FP_MEMSET_T CUpti_ActivityMemset4
_Static_assert(offsetof(FP_KERNEL_T, start) == 16 && offsetof(FP_KERNEL_T, end) == 24, "kernel times");
_Static_assert(offsetof(FP_KERNEL_T, deviceId) == 40 && offsetof(FP_KERNEL_T, contextId) == 44 &&
                   offsetof(FP_KERNEL_T, streamId) == 48,
               "kernel ids");
_Static_assert(offsetof(FP_KERNEL_T, correlationId) == 92 && offsetof(FP_KERNEL_T, name) == 104, "kernel");
_Static_assert(offsetof(FP_MEMCPY_T, copyKind) == 4 && offsetof(FP_MEMCPY_T, bytes) == 8 &&
                   offsetof(FP_MEMCPY_T, start) == 16 && offsetof(FP_MEMCPY_T, end) == 24 &&
                   offsetof(FP_MEMCPY_T, deviceId) == 32 && offsetof(FP_MEMCPY_T, contextId) == 36 &&
                   offsetof(FP_MEMCPY_T, streamId) == 40 && offsetof(FP_MEMCPY_T, correlationId) == 44,
               "memcpy");
_Static_assert(offsetof(FP_MEMSET_T, bytes) == 8 && offsetof(FP_MEMSET_T, start) == 16 &&
                   offsetof(FP_MEMSET_T, end) == 24 && offsetof(FP_MEMSET_T, deviceId) == 32 &&
                   offsetof(FP_MEMSET_T, contextId) == 36 && offsetof(FP_MEMSET_T, streamId) == 40 &&
                   offsetof(FP_MEMSET_T, correlationId) == 44,
               "memset");

// ---- CUPTI, through dlsym -----------------------------------------------------------------------------

static struct {
    __typeof__(&cuptiGetVersion) GetVersion;
    __typeof__(&cuptiGetResultString) GetResultString;
    __typeof__(&cuptiSubscribe) Subscribe;
    __typeof__(&cuptiEnableCallback) EnableCallback;
    __typeof__(&cuptiActivityRegisterCallbacks) ActivityRegisterCallbacks;
    __typeof__(&cuptiActivityRegisterTimestampCallback) ActivityRegisterTimestampCallback;
    __typeof__(&cuptiActivityEnable) ActivityEnable;
    __typeof__(&cuptiActivityGetNextRecord) ActivityGetNextRecord;
    __typeof__(&cuptiActivityGetNumDroppedRecords) ActivityGetNumDroppedRecords;
    __typeof__(&cuptiActivityFlushAll) ActivityFlushAll;
} cupti;

static const struct {
    const char *name;
    size_t offset;
} cupti_symbols[] = {
#define FP_SYM(field, sym) {#sym, offsetof(__typeof__(cupti), field)}
    FP_SYM(GetVersion, cuptiGetVersion),
    FP_SYM(GetResultString, cuptiGetResultString),
    FP_SYM(Subscribe, cuptiSubscribe),
    FP_SYM(EnableCallback, cuptiEnableCallback),
    FP_SYM(ActivityRegisterCallbacks, cuptiActivityRegisterCallbacks),
    FP_SYM(ActivityRegisterTimestampCallback, cuptiActivityRegisterTimestampCallback),
    FP_SYM(ActivityEnable, cuptiActivityEnable),
    FP_SYM(ActivityGetNextRecord, cuptiActivityGetNextRecord),
    FP_SYM(ActivityGetNumDroppedRecords, cuptiActivityGetNumDroppedRecords),
    FP_SYM(ActivityFlushAll, cuptiActivityFlushAll),
#undef FP_SYM
};

// The launch calls we follow. Enabling one that this CUPTI does not know fails harmlessly.
static const struct {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId cbid;
} launch_calls[] = {
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000},
};

// ---- small helpers ------------------------------------------------------------------------------------

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// CUPTI's timestamp source once registered: every activity time is then in CLOCK_MONOTONIC, the clock of
// bpf_ktime_get_ns() and of the agent's samples.
static uint64_t CUPTIAPI cupti_timestamp(void) { return now_ns(); }

static void count(enum fp_cupti_counter c, uint64_t n) {
    __atomic_fetch_add(&H.counters[c], n, __ATOMIC_RELAXED);
}

static void count_max(enum fp_cupti_counter c, uint64_t n) {
    uint64_t seen = __atomic_load_n(&H.counters[c], __ATOMIC_RELAXED);
    while (n > seen && !__atomic_compare_exchange_n(&H.counters[c], &seen, n, 1, __ATOMIC_RELAXED,
                                                    __ATOMIC_RELAXED)) {
    }
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fleetprof_cupti: %s\n", line);
}

static void set_state(enum fp_cupti_state state, int detail, const char *message) {
    snprintf(H.state_message, sizeof H.state_message, "%s", message ? message : "");
    H.state_detail = detail;
    __atomic_store_n(&H.state, (uint32_t)state, __ATOMIC_RELEASE);
}

static uint32_t state_now(void) { return __atomic_load_n(&H.state, __ATOMIC_ACQUIRE); }

static const char *result_string(CUptiResult r) {
    const char *s = NULL;
    if (cupti.GetResultString == NULL || cupti.GetResultString(r, &s) != CUPTI_SUCCESS || s == NULL)
        return "unknown CUPTI error";
    return s;
}

// A CUPTI call failed: the library stops recording (what was enabled stays harmless: callbacks check the
// state) and says why, in the header and once on stderr.
static void cupti_failed(const char *call, CUptiResult r) {
    char msg[192];
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
        snprintf(msg, sizeof msg, "%s: %s (%d): another CUPTI client (torch.profiler, nsys, ncu) holds this "
                 "process", call, result_string(r), (int)r);
    else
        snprintf(msg, sizeof msg, "%s: %s (%d)", call, result_string(r), (int)r);
    set_state(FP_STATE_CUPTI_ERROR, (int)r, msg);
    say("not recording: %s", msg);
}

// ---- the ring -----------------------------------------------------------------------------------------

// Claim the next slot, write it, publish it. Lock-free and wait-free: any number of threads.
static void ring_put(struct fp_cupti_record *r) {
    // seq_cst: the claim is visible before any byte of the slot changes, so a reader that re-reads
    // write_seq after its copy knows which slots may have changed under it.
    uint64_t idx = __atomic_fetch_add(&H.write_seq, 1, __ATOMIC_SEQ_CST);
    struct fp_cupti_record *slot = &fleetprof_cupti_ring.records[idx & (FP_CUPTI_CAPACITY - 1)];
    __atomic_store_n(&slot->seq, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    r->u.activity.check = fp_cupti_check(r);
    memcpy((char *)slot + 8, (const char *)r + 8, sizeof *r - 8);
    __atomic_store_n(&slot->seq, idx + 1, __ATOMIC_RELEASE);
}

// ---- kernel names -------------------------------------------------------------------------------------
// Only the activity thread(s) add names, under names_lock. Two tables: by CUPTI's name pointer (CUPTI keeps
// one string per kernel for the life of the process) and by content (a fresh pointer to a known name).

static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { const char *ptr; uint32_t ref, hash; } names_by_ptr[FP_NAME_TABLE];
static struct { uint32_t hash; uint32_t ref; } names_by_hash[FP_NAME_TABLE];
static uint32_t names_by_ptr_n, names_by_hash_n;
static uint32_t names_used;  // private copy of H.names_used (only written under names_lock)

static uint32_t ptr_slot(const char *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x & (FP_NAME_TABLE - 1);
}

static int name_matches(uint32_t ref, const char *name, uint32_t len) {
    const char *entry = fleetprof_cupti_ring.names + (ref - 1);
    uint32_t stored;
    memcpy(&stored, entry, 4);
    return stored == len && memcmp(entry + FP_CUPTI_NAME_HEADER, name, len) == 0;
}

// The names-area reference of `name` (added if new), or 0 when it cannot be stored.
static uint32_t name_ref(const char *name, uint32_t *hash_out) {
    uint32_t i = ptr_slot(name);
    for (uint32_t n = 0; names_by_ptr[i].ptr != NULL && n < FP_NAME_TABLE; n++) {
        if (names_by_ptr[i].ptr == name) {
            *hash_out = names_by_ptr[i].hash;  // the common case: no pass over the name at all
            return names_by_ptr[i].ref;
        }
        i = (i + 1) & (FP_NAME_TABLE - 1);
    }
    uint32_t full_len, hash = fp_cupti_fnv1a(name, &full_len);
    *hash_out = hash;
    uint32_t len = full_len > FP_CUPTI_MAX_NAME ? FP_CUPTI_MAX_NAME : full_len;
    uint32_t ref = 0;
    uint32_t j = hash & (FP_NAME_TABLE - 1);
    for (uint32_t n = 0; names_by_hash[j].ref != 0 && n < FP_NAME_TABLE; n++) {
        if (names_by_hash[j].hash == hash && name_matches(names_by_hash[j].ref, name, len)) {
            ref = names_by_hash[j].ref;
            break;
        }
        j = (j + 1) & (FP_NAME_TABLE - 1);
    }
    if (ref == 0) {
        uint32_t entry = (FP_CUPTI_NAME_HEADER + len + 1 + 7) & ~7u;
        if (names_by_hash_n >= FP_NAME_TABLE_MAX || names_used + entry > FP_CUPTI_NAMES_BYTES) return 0;
        char *at = fleetprof_cupti_ring.names + names_used;
        memcpy(at, &len, 4);
        memcpy(at + 4, &hash, 4);
        memcpy(at + FP_CUPTI_NAME_HEADER, name, len);  // the NUL and padding are still zero (.bss)
        ref = names_used + 1;
        names_used += entry;
        __atomic_store_n(&H.names_used, (uint64_t)names_used, __ATOMIC_RELEASE);
        names_by_hash[j].hash = hash;
        names_by_hash[j].ref = ref;
        names_by_hash_n++;
        if (len < full_len) count(FP_C_NAMES_CUT, 1);
    }
    if (names_by_ptr_n < FP_NAME_TABLE_MAX) {
        names_by_ptr[i].ptr = name;
        names_by_ptr[i].ref = ref;
        names_by_ptr[i].hash = hash;
        names_by_ptr_n++;
    }
    return ref;
}

// ---- activity buffers ---------------------------------------------------------------------------------

static pthread_mutex_t buffers_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *free_buffers[FP_CUPTI_MAX_BUFFERS];
static int free_n, buffers_n;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    uint8_t *b = NULL;
    pthread_mutex_lock(&buffers_lock);
    if (free_n > 0) {
        b = free_buffers[--free_n];
    } else if (buffers_n < FP_CUPTI_MAX_BUFFERS) {
        if (posix_memalign((void **)&b, 8, FP_CUPTI_BUFFER_BYTES) == 0) buffers_n++;
        else b = NULL;
    }
    pthread_mutex_unlock(&buffers_lock);
    if (b == NULL) count(FP_C_BUFFERS_REFUSED, 1);
    *buffer = b;
    *size = b ? FP_CUPTI_BUFFER_BYTES : 0;
    *max_records = 0;
}

static void put_activity(uint16_t kind, uint16_t subkind, uint32_t correlation, uint64_t start, uint64_t end,
                         uint64_t bytes, uint32_t device, uint32_t context, uint32_t stream,
                         const char *name) {
    struct fp_cupti_record r = {0};
    r.kind = kind;
    r.subkind = subkind;
    r.correlation_id = correlation;
    r.u.activity.start_ns = start;
    r.u.activity.end_ns = end;
    r.u.activity.bytes = bytes;
    r.u.activity.device_id = device;
    r.u.activity.context_id = context;
    r.u.activity.stream_id = stream;
    if (kind == FP_KIND_KERNEL) {
        uint32_t hash = 0, ref = name ? name_ref(name, &hash) : 0;
        if (ref == 0) count(FP_C_NAMES_FULL, 1);
        r.u.activity.name_ref = ref;
        r.u.activity.name_hash = hash;
    }
    ring_put(&r);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)size;
    CUpti_Activity *rec = NULL;
    uint64_t kernels = 0, copies = 0, other = 0;
    pthread_mutex_lock(&names_lock);
    while (valid > 0 && cupti.ActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const FP_KERNEL_T *k = (const FP_KERNEL_T *)rec;
            put_activity(FP_KIND_KERNEL, 0, k->correlationId, k->start, k->end, 0, k->deviceId,
                         k->contextId, k->streamId, k->name);
            kernels++;
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const FP_MEMCPY_T *m = (const FP_MEMCPY_T *)rec;
            put_activity(FP_KIND_MEMCPY, m->copyKind, m->correlationId, m->start, m->end, m->bytes,
                         m->deviceId, m->contextId, m->streamId, NULL);
            copies++;
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const FP_MEMSET_T *m = (const FP_MEMSET_T *)rec;
            put_activity(FP_KIND_MEMSET, 0, m->correlationId, m->start, m->end, m->bytes, m->deviceId,
                         m->contextId, m->streamId, NULL);
            copies++;
            break;
        }
        default:
            other++;
        }
    }
    pthread_mutex_unlock(&names_lock);
    count(FP_C_KERNELS, kernels);
    count(FP_C_COPIES, copies);
    if (other) count(FP_C_OTHER_RECORDS, other);
    size_t dropped = 0;
    if (cupti.ActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        count(FP_C_CUPTI_DROPPED, dropped);
    if (buffer != NULL) {
        pthread_mutex_lock(&buffers_lock);
        free_buffers[free_n++] = buffer;  // at most buffers_n <= FP_CUPTI_MAX_BUFFERS are ever handed out
        pthread_mutex_unlock(&buffers_lock);
    }
}

// ---- launches: nesting and sampling -------------------------------------------------------------------

struct fp_thread {
    int ready;
    uint32_t tid;
    uint32_t depth;          // launch calls open on this thread
    uint64_t rng;
    uint64_t skip;           // launches until (and including) the next sampled one
    uint64_t skip_every;     // the 1-in-N that drew `skip`: the weight of the launch it lands on
    uint64_t carry;          // weight of candidates the hard cap refused, given to the next sampled launch
    uint64_t every;          // this thread's 1-in-N now (>= sample_every; raised by the rate cap)
    uint64_t window_start;
    uint64_t window_launches;
    uint64_t window_samples;
    uint64_t budget_start;   // the hard cap's windows (100 ms each, apart from the rate's)
    uint64_t budget_samples;
    // The open outermost launch, when it is sampled.
    int sampled;
    uint64_t weight;
    uint64_t enter_ns;
    uint32_t outer_cid, inner_cid;
    uint16_t outer_cbid, inner_cbid;
    uint8_t outer_domain, inner_domain;
};

static __thread struct fp_thread me;

static uint64_t next_random(struct fp_thread *t) {  // xorshift64*
    t->rng ^= t->rng >> 12;
    t->rng ^= t->rng << 25;
    t->rng ^= t->rng >> 27;
    return t->rng * 0x2545F4914F6CDD1Dull;
}

// Launches until the next sample when each launch is sampled with probability 1/every: geometric, so
// that drawing the skip once stands for a fair coin at every launch (and costs one decrement per launch).
static uint64_t draw_skip(struct fp_thread *t, uint64_t every) {
    if (every <= 1) return 1;
    double u = ((next_random(t) >> 11) + 1) * (1.0 / 9007199254740992.0);  // (0, 1]
    double k = floor(log(u) / log1p(-1.0 / (double)every));
    return k >= 1e15 ? (uint64_t)1e15 : (uint64_t)k + 1;
}

// The agent's uprobe goes here; it reads both arguments from their registers and takes the stack.
// noipa: never inlined, cloned or reasoned about across the call; the asm keeps the arguments alive.
// On x86-64 the function starts with a 5-byte NOP, as USDT probes do: Linux (6.16+) turns a uprobe on it
// into a call, with no trap. Measured on this project's 6.18 VMs: 1.3 µs a hit on the NOP, 18 µs on a
// bare `ret` (bench/README.md).
FP_EXPORT __attribute__((noinline, noipa, used)) void fleetprof_cupti_launch(uint32_t correlation_id,
                                                                            uint64_t weight) {
#if defined(__x86_64__)
    __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" : : "r"(correlation_id), "r"(weight) : "memory");
#else
    __asm__ volatile("nop" : : "r"(correlation_id), "r"(weight) : "memory");
#endif
}

static void thread_start(struct fp_thread *t, uint64_t now) {
    t->ready = 1;
    t->tid = (uint32_t)syscall(SYS_gettid);
    t->rng = (now ^ ((uint64_t)t->tid << 32) ^ (uint64_t)(uintptr_t)t) | 1;
    t->every = H.sample_every;
    t->skip_every = t->every;
    t->skip = draw_skip(t, t->every);
    t->window_start = now;
    t->budget_start = now;
}

// The rate cap: at most sample_cap sampled launches per second per thread, on average. The thread's 1-in-N
// is set from its launch rate, so the weights stay exact (each launch is sampled with probability 1/N and
// weighs N). The rate is measured over a window that ends after 100 ms, or sooner once it holds its share
// of samples (cap/10): the rate is then over the cap, and a burst (a thread's first launches, at the
// setting's 1-in-N) meets its own 1-in-N within cap/10 samples. Apart from that, a hard cap of three shares
// per 100 ms refuses candidates, and the next sample carries their weight (totals stay exact); it would pile
// a burst's weight on one launch's stack, so the re-rate comes first.
static int over_cap(struct fp_thread *t, uint64_t now) {
    uint32_t cap = H.sample_cap;
    if (cap == 0) return 0;
    uint64_t share = (uint64_t)cap * FP_WINDOW_NS / 1000000000ull;
    if (share == 0) share = 1;
    uint64_t elapsed = now - t->window_start;
    if (elapsed >= FP_WINDOW_NS || t->window_samples >= share) {
        double per_s = (double)t->window_launches * 1e9 / (double)(elapsed ? elapsed : 1);
        double need = ceil(per_s / cap);
        t->every = need > (double)H.sample_every ? (uint64_t)need : H.sample_every;
        t->window_start = now;
        t->window_launches = 0;
        t->window_samples = 0;
    }
    if (now - t->budget_start >= FP_WINDOW_NS) {
        t->budget_start = now;
        t->budget_samples = 0;
    }
    return t->budget_samples >= 3 * share + 1;
}

static void launch_enter(struct fp_thread *t, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                         const CUpti_CallbackData *d) {
    if (t->depth++ > 0) {
        if (t->depth == 2 && t->sampled && t->inner_cid == 0) {
            t->inner_cid = d->correlationId;
            t->inner_cbid = (uint16_t)cbid;
            t->inner_domain = (uint8_t)domain;
        }
        if (t->depth > FP_MAX_DEPTH) {
            t->depth = 0;
            t->sampled = 0;
            count(FP_C_NESTING_REPAIRS, 1);
        }
        return;
    }
    count(FP_C_LAUNCHES, 1);
    t->sampled = 0;
    t->window_launches++;
    if (t->skip > 1) {
        t->skip--;
        return;
    }
    uint64_t now = now_ns();
    uint64_t weight = t->skip_every + t->carry;
    int refused = over_cap(t, now);
    t->skip_every = t->every;
    t->skip = draw_skip(t, t->every);
    if (refused) {
        t->carry = weight;
        count(FP_C_SAMPLE_CAPPED, 1);
        return;
    }
    t->carry = 0;
    t->window_samples++;
    t->budget_samples++;
    t->sampled = 1;
    t->weight = weight;
    t->enter_ns = now;
    t->outer_cid = d->correlationId;
    t->outer_cbid = (uint16_t)cbid;
    t->outer_domain = (uint8_t)domain;
    t->inner_cid = 0;
    t->inner_cbid = 0;
    t->inner_domain = 0;
}

static void launch_exit(struct fp_thread *t, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                        const CUpti_CallbackData *d) {
    if (t->depth == 0) {
        count(FP_C_NESTING_REPAIRS, 1);
        return;
    }
    if (--t->depth > 0 || !t->sampled) return;
    t->sampled = 0;
    if (t->outer_cbid != (uint16_t)cbid || t->outer_domain != (uint8_t)domain) {
        count(FP_C_NESTING_REPAIRS, 1);  // an exit without its entry: the pairing is lost; drop this one
        return;
    }
    struct fp_cupti_record r = {0};
    r.kind = FP_KIND_LAUNCH;
    r.subkind = t->outer_cbid;
    r.correlation_id = t->outer_cid;
    r.u.launch.enter_ns = t->enter_ns;
    r.u.launch.exit_ns = now_ns();
    r.u.launch.weight = t->weight;
    r.u.launch.inner_correlation_id = t->inner_cid;
    r.u.launch.tid = t->tid;
    r.u.launch.inner_cbid = t->inner_cbid;
    r.u.launch.domains = (uint16_t)(t->outer_domain | (t->inner_domain << 8));
    r.u.launch.result = d->functionReturnValue ? (uint32_t) * (const int *)d->functionReturnValue : 0;
    ring_put(&r);
    count(FP_C_SAMPLED, 1);
    count(FP_C_SAMPLED_WEIGHT, t->weight);
    count_max(FP_C_SAMPLED_WEIGHT_MAX, t->weight);
    fleetprof_cupti_launch(t->outer_cid, t->weight);
}

static void CUPTIAPI on_api(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                            const void *cbdata) {
    (void)userdata;
    const CUpti_CallbackData *d = cbdata;
    if (state_now() != FP_STATE_RUNNING || d == NULL) return;
    struct fp_thread *t = &me;
    if (!t->ready) thread_start(t, now_ns());
    if (d->callbackSite == CUPTI_API_ENTER) launch_enter(t, domain, cbid, d);
    else launch_exit(t, domain, cbid, d);
}

// ---- flushing -----------------------------------------------------------------------------------------

static void flush(uint32_t flag) {
    uint64_t t0 = now_ns();
    if (cupti.ActivityFlushAll(flag) == CUPTI_SUCCESS) {
        __atomic_store_n(&H.flushed_ns, t0, __ATOMIC_RELEASE);
        count(FP_C_FLUSHES, 1);
    }
}

static void *flusher(void *arg) {
    (void)arg;
    struct timespec period = {H.flush_ms / 1000, (long)(H.flush_ms % 1000) * 1000000L};
    while (state_now() == FP_STATE_RUNNING) {
        nanosleep(&period, NULL);
        if (state_now() != FP_STATE_RUNNING) break;
        flush(0);
    }
    return NULL;
}

static void at_exit(void) {
    if (state_now() != FP_STATE_RUNNING) return;
    uint32_t open = me.depth;
    if (open) count(FP_C_LAUNCHES_OPEN_AT_EXIT, open);
    flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    set_state(FP_STATE_STOPPED, 0, "the process is exiting");
}

// A fork()ed child holds a copy of the parent's ring; the agent must not count those records twice. CUDA
// does not work in a child of a process that initialised it, so the child's copy stays inert.
static void after_fork_in_child(void) {
    uint32_t s = state_now();
    if (s != FP_STATE_LOADED) set_state(FP_STATE_FORKED, 0, "a fork()ed child: records are the parent's");
}

// ---- finding and loading libcupti ---------------------------------------------------------------------

static void *cupti_handle;

static int try_cupti(const char *path, int flags) {
    void *h = dlopen(path, flags);
    if (h == NULL) return 0;
    for (size_t i = 0; i < sizeof cupti_symbols / sizeof cupti_symbols[0]; i++) {
        void *f = dlsym(h, cupti_symbols[i].name);
        if (f == NULL) {
            say("%s lacks %s; not using it", path, cupti_symbols[i].name);
            memset(&cupti, 0, sizeof cupti);
            dlclose(h);
            return 0;
        }
        memcpy((char *)&cupti + cupti_symbols[i].offset, &f, sizeof f);
    }
    cupti_handle = h;
    struct link_map *lm = NULL;
    const char *where = path;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0]) where = lm->l_name;
    snprintf(H.cupti_path, sizeof H.cupti_path, "%s", where);
    return 1;
}

struct cudart_search {
    char dir[PATH_MAX];
    char major[8];
};

static int find_cudart(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    struct cudart_search *s = arg;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    if (base == NULL || strncmp(base + 1, "libcudart.so.", 13) != 0) return 0;
    size_t dir_len = (size_t)(base - info->dlpi_name);
    if (dir_len >= sizeof s->dir) return 0;
    memcpy(s->dir, info->dlpi_name, dir_len);
    s->dir[dir_len] = '\0';
    snprintf(s->major, sizeof s->major, "%.*s", (int)strcspn(base + 14, "."), base + 14);
    return 1;
}

// The process's own CUPTI: named by FLEETPROF_CUPTI_LIBRARY; else one already loaded; else the one beside
// the process's libcudart (pip wheels: nvidia/cu13/lib holds both; CUDA 12 wheels keep it in
// nvidia/cuda_cupti/lib; a toolkit in extras/CUPTI/lib64); else the loader's search path.
static int load_cupti(char *tried, size_t tried_len) {
    const char *explicit_path = getenv("FLEETPROF_CUPTI_LIBRARY");
    if (explicit_path && *explicit_path) {
        snprintf(tried, tried_len, "FLEETPROF_CUPTI_LIBRARY=%s", explicit_path);
        return try_cupti(explicit_path, RTLD_NOW | RTLD_LOCAL);
    }
    static const char *const sonames[] = {"libcupti.so.13", "libcupti.so.12"};
    for (size_t i = 0; i < 2; i++)
        if (try_cupti(sonames[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return 1;
    struct cudart_search s = {{0}, {0}};
    if (dl_iterate_phdr(find_cudart, &s) && s.major[0]) {
        static const char *const beside[] = {"%s/libcupti.so.%s", "%s/../../cuda_cupti/lib/libcupti.so.%s",
                                             "%s/../extras/CUPTI/lib64/libcupti.so.%s"};
        char path[PATH_MAX + 64];
        for (size_t i = 0; i < 3; i++) {
            snprintf(path, sizeof path, beside[i], s.dir, s.major);
            if (try_cupti(path, RTLD_NOW | RTLD_LOCAL)) return 1;
        }
    }
    for (size_t i = 0; i < 2; i++)
        if (try_cupti(sonames[i], RTLD_NOW | RTLD_LOCAL)) return 1;
    snprintf(tried, tried_len, "libcupti.so.13/.12 (loaded, beside libcudart%s%.120s, the loader's path)",
             s.dir[0] ? " in " : "", s.dir);
    return 0;
}

// ---- configuration ------------------------------------------------------------------------------------

static uint32_t env_uint(const char *name, uint32_t fallback, uint32_t lo, uint32_t hi) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return fallback;
    char *end = NULL;
    errno = 0;
    unsigned long x = strtoul(v, &end, 10);
    if (errno || end == v || *end != '\0' || x < lo || x > hi || v[0] == '-') {
        say("%s=%s is not an integer in [%u, %u]; using %u", name, v, lo, hi, fallback);
        return fallback;
    }
    return (uint32_t)x;
}

static int env_off(const char *name) {
    const char *v = getenv(name);
    return v && (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "off") || !strcasecmp(v, "no"));
}

// ---- start-up -----------------------------------------------------------------------------------------

__attribute__((constructor)) static void on_load(void) {
    H.layout = FP_CUPTI_LAYOUT;
    H.header_size = sizeof(struct fp_cupti_header);
    H.record_size = sizeof(struct fp_cupti_record);
    H.capacity = FP_CUPTI_CAPACITY;
    H.records_offset = FP_CUPTI_RECORDS_OFFSET;
    H.names_offset = FP_CUPTI_NAMES_OFFSET;
    H.names_size = FP_CUPTI_NAMES_BYTES;
    H.clock_id = CLOCK_MONOTONIC;
    set_state(FP_STATE_LOADED, 0, "waiting for the CUDA driver to call InitializeInjection");
    __atomic_store_n(&H.magic, FP_CUPTI_MAGIC, __ATOMIC_RELEASE);
}

static int start(void) {
    H.init_ns = now_ns();
    H.sample_every = env_uint("FLEETPROF_CUPTI_SAMPLE_EVERY", FP_DEFAULT_SAMPLE_EVERY, 1, 1u << 30);
    H.sample_cap = env_uint("FLEETPROF_CUPTI_SAMPLE_CAP", FP_DEFAULT_SAMPLE_CAP, 0, 1u << 30);
    H.flush_ms = env_uint("FLEETPROF_CUPTI_FLUSH_MS", FP_DEFAULT_FLUSH_MS, 10, 60000);
    if (env_off("FLEETPROF_CUPTI")) {
        set_state(FP_STATE_DISABLED, 0, "FLEETPROF_CUPTI=0");
        return 0;
    }
    char tried[256] = "";
    if (!load_cupti(tried, sizeof tried)) {
        char msg[192];
        snprintf(msg, sizeof msg, "no usable libcupti: tried %s", tried);
        set_state(FP_STATE_NO_CUPTI, 0, msg);
        say("not recording: %s", msg);
        return 0;
    }
    uint32_t version = 0;
    if (cupti.GetVersion(&version) == CUPTI_SUCCESS) H.cupti_version = version;

    CUptiResult r;
    CUpti_SubscriberHandle subscriber;
    // Subscribe first: it is the call that fails when another CUPTI client holds the process, and then
    // nothing else of ours may be switched on.
    if ((r = cupti.Subscribe(&subscriber, on_api, NULL)) != CUPTI_SUCCESS) {
        cupti_failed("cuptiSubscribe", r);
        return 0;
    }
    if ((r = cupti.ActivityRegisterTimestampCallback(cupti_timestamp)) != CUPTI_SUCCESS) {
        cupti_failed("cuptiActivityRegisterTimestampCallback", r);
        return 0;
    }
    if ((r = cupti.ActivityRegisterCallbacks(buffer_requested, buffer_completed)) != CUPTI_SUCCESS) {
        cupti_failed("cuptiActivityRegisterCallbacks", r);
        return 0;
    }
    int followed = 0;
    for (size_t i = 0; i < sizeof launch_calls / sizeof launch_calls[0]; i++)
        followed += cupti.EnableCallback(1, subscriber, launch_calls[i].domain, launch_calls[i].cbid) ==
                    CUPTI_SUCCESS;
    if (followed == 0) {
        cupti_failed("cuptiEnableCallback (every launch call)", CUPTI_ERROR_INVALID_PARAMETER);
        return 0;
    }
    static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                               CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};
    for (size_t i = 0; i < 3; i++) {
        if ((r = cupti.ActivityEnable(kinds[i])) != CUPTI_SUCCESS) {
            cupti_failed("cuptiActivityEnable", r);
            return 0;
        }
    }
    set_state(FP_STATE_RUNNING, 0, "recording");
    pthread_t thread;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  // the flusher takes none of the workload's signals
    int err = pthread_create(&thread, &attr, flusher, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (err) say("no flusher thread (%s): records arrive as CUPTI's buffers fill", strerror(err));
    else pthread_setname_np(thread, "fleetprof-cupti");
    atexit(at_exit);
    pthread_atfork(NULL, NULL, after_fork_in_child);
    return 1;
}

// Called by the CUDA driver (once, during cuInit) because CUDA_INJECTION64_PATH names this library.
// Returns 1 whatever happens: a failure here must not fail the workload's cuInit.
FP_EXPORT int InitializeInjection(void) {
    static int done;
    if (__atomic_exchange_n(&done, 1, __ATOMIC_ACQ_REL)) return 1;
    start();
    return 1;
}
