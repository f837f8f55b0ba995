// The ring that libfleetprof_cupti.so (fleetprof_cupti.c) fills inside a CUDA process and the agent reads
// from outside through /proc/PID/mem (agent/gpu/cupti_ring.py mirrors every layout here; a test compiles
// this header and compares offsets).
//
// Rules this layout keeps:
//   * One static object, exported as `fleetprof_cupti_ring`: header, records, names, in that order, at the
//     offsets the header states. It lives in .bss (zero until written), so its pages cost memory only once
//     touched; the whole object is FP_CUPTI_RING_BYTES, fixed at build time.
//   * The library is the only writer and never waits for a reader. Writers claim a record by an atomic
//     increment of `write_seq` (index = old value), mark the slot busy (seq = 0), write the body, then
//     store seq = index + 1 with release ordering. When the ring is full the oldest records are simply
//     overwritten: the reader sees the gap in the sequence and counts it lost.
//   * A reader copies records, then re-reads `write_seq`: a slot whose index is below write_seq - capacity
//     by then may have been rewritten during the copy (torn), whatever its seq says. A record is accepted
//     only when its seq is index + 1, it was not claimed again before the re-read, and its `check` matches
//     (the last guard against a writer preempted for a whole lap of the ring).
//   * Names are appended once, never changed, never reused: a record names its kernel by the offset of an
//     entry in the names area (+1; 0 = no name), and the entry is complete before `names_used` covers it
//     and before any record that refers to it is published.
//   * Every field is naturally aligned and little-endian; nothing here depends on the compiler's padding.
#ifndef FLEETPROF_CUPTI_RING_H
#define FLEETPROF_CUPTI_RING_H

#include <stdint.h>

#define FP_CUPTI_MAGIC 0x3149545055435046ULL  // "FPCUPTI1" as little-endian bytes
#define FP_CUPTI_LAYOUT 1
#define FP_CUPTI_RING_SYMBOL "fleetprof_cupti_ring"
#define FP_CUPTI_MARKER_SYMBOL "fleetprof_cupti_launch"

#define FP_CUPTI_CAPACITY 65536u          // records; a power of two (64 B each: 4 MiB)
#define FP_CUPTI_NAMES_BYTES (1u << 20)   // the append-only names area
#define FP_CUPTI_MAX_NAME 8192u           // longer kernel names are stored cut (counted)

// Library states (header.state).
enum fp_cupti_state {
    FP_STATE_LOADED = 1,       // the library is mapped; the driver has not called InitializeInjection yet
    FP_STATE_RUNNING = 2,      // recording
    FP_STATE_DISABLED = 3,     // FLEETPROF_CUPTI=0: nothing is recorded
    FP_STATE_NO_CUPTI = 4,     // no usable libcupti found (state_message says where it looked)
    FP_STATE_CUPTI_ERROR = 5,  // a CUPTI call failed (state_detail: its CUptiResult; state_message: which)
    FP_STATE_STOPPED = 6,      // the process is exiting; the final flush is done
    FP_STATE_FORKED = 7,       // a fork()ed child's copy of its parent's ring: nothing is recorded here
};

// Counters (header.counters[i]); monotonic for the life of the process.
enum fp_cupti_counter {
    FP_C_LAUNCHES = 0,        // launch API calls seen (outermost only: a runtime launch and the driver
                              // launch it makes are one)
    FP_C_SAMPLED = 1,         // launches sampled: a launch record written and the marker called
    FP_C_SAMPLE_CAPPED = 2,   // sampled launches refused by the per-thread hard cap (their weight moves to
                              // the thread's next sampled launch)
    FP_C_KERNELS = 3,         // kernel records written
    FP_C_COPIES = 4,          // memcpy and memset records written
    FP_C_CUPTI_DROPPED = 5,   // records CUPTI itself dropped (cuptiActivityGetNumDroppedRecords)
    FP_C_BUFFERS_REFUSED = 6, // activity buffers refused to CUPTI (FP_CUPTI_MAX_BUFFERS in use): CUPTI
                              // drops what it could not store, counted in FP_C_CUPTI_DROPPED
    FP_C_NAMES_FULL = 7,      // kernel records written without a name: names area or table full
    FP_C_NAMES_CUT = 8,       // names longer than FP_CUPTI_MAX_NAME, stored cut
    FP_C_FLUSHES = 9,         // flushes done (periodic and final)
    FP_C_OTHER_RECORDS = 10,  // activity records of kinds not asked for (skipped)
    FP_C_NESTING_REPAIRS = 11,// a launch callback's enter/exit did not pair up; the thread's depth was reset
    FP_C_LAUNCHES_OPEN_AT_EXIT = 12, // launches still open when the process exited (no record written)
    FP_C_SAMPLED_WEIGHT = 13, // the sum of the sampled launches' weights: an unbiased estimate of
                              // FP_C_LAUNCHES, which lets the agent check its own accounting
    FP_C_SAMPLED_WEIGHT_MAX = 14, // the largest weight one sampled launch carried (a maximum, so it too
                                  // only grows): it bounds the variance of FP_C_SAMPLED_WEIGHT's estimate
    FP_C_COUNT = 16,
};

// Record kinds (record.kind).
enum fp_cupti_kind {
    FP_KIND_KERNEL = 1,
    FP_KIND_MEMCPY = 2,  // subkind: CUpti_ActivityMemcpyKind
    FP_KIND_MEMSET = 3,
    FP_KIND_LAUNCH = 4,  // a sampled launch; subkind: the outermost API's callback id (CUPTI cbid)
};

// record.launch.domains: the CUPTI callback domains of the outermost (low byte) and first nested (high
// byte) launch calls (CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2; 0 = none).

struct fp_cupti_activity {   // FP_KIND_KERNEL, FP_KIND_MEMCPY, FP_KIND_MEMSET
    uint64_t start_ns;       // CLOCK_MONOTONIC (bpf_ktime_get_ns's clock)
    uint64_t end_ns;
    uint64_t bytes;          // copies: bytes moved or set; kernels: 0
    uint32_t device_id;
    uint32_t context_id;
    uint32_t stream_id;
    uint32_t name_ref;       // kernels: offset of the name's entry in the names area + 1; 0 = no name
    uint32_t name_hash;      // kernels: FNV-1a 32 of the whole name (also when name_ref is 0)
    uint32_t check;          // fp_cupti_check() of the record's bytes 8..59
};

struct fp_cupti_launch {     // FP_KIND_LAUNCH
    uint64_t enter_ns;       // CLOCK_MONOTONIC at the outermost launch call's entry and exit callbacks
    uint64_t exit_ns;
    uint64_t weight;         // how many launches of this thread this one stands for (>= 1)
    uint32_t inner_correlation_id;  // the first nested launch call's CUPTI correlation id (0: none)
    uint32_t tid;            // the launching thread (gettid(), the process's own pid namespace)
    uint16_t inner_cbid;     // its callback id (0: none)
    uint16_t domains;        // see above
    uint32_t result;         // the outermost call's return value (CUresult or cudaError_t)
    uint32_t reserved;
    uint32_t check;          // as in fp_cupti_activity: at the same offset
};

struct fp_cupti_record {     // 64 bytes
    uint64_t seq;            // index + 1 once complete; 0 while being written
    uint16_t kind;           // enum fp_cupti_kind
    uint16_t subkind;
    uint32_t correlation_id; // CUPTI's: kernels and copies as CUPTI reported them; launches: the outermost
                             // call's (the one the marker passes)
    union {
        struct fp_cupti_activity activity;
        struct fp_cupti_launch launch;
    } u;                     // the last 4 bytes of either body: `check`
};

struct fp_cupti_header {
    uint64_t magic;          // FP_CUPTI_MAGIC, written by the library's constructor
    uint32_t layout;         // FP_CUPTI_LAYOUT
    uint32_t header_size;    // sizeof(struct fp_cupti_header)
    uint32_t record_size;    // sizeof(struct fp_cupti_record)
    uint32_t capacity;       // records
    uint32_t records_offset; // from the start of the ring object
    uint32_t names_offset;
    uint32_t names_size;
    uint32_t state;          // enum fp_cupti_state
    int32_t state_detail;    // FP_STATE_CUPTI_ERROR: the CUptiResult
    uint32_t cupti_version;  // cuptiGetVersion() (CUPTI_API_VERSION of the library in use)
    uint32_t sample_every;   // a launch is sampled with probability 1/sample_every ...
    uint32_t sample_cap;     // ... and at most about this many per second per thread
    uint32_t flush_ms;       // the flusher's period
    uint32_t clock_id;       // CLOCK_MONOTONIC (1): every *_ns field and record time
    uint64_t init_ns;        // when InitializeInjection ran
    uint64_t flushed_ns;     // start of the last completed flush: every activity CUPTI had complete
                             // then is in the ring (written with release ordering after those records)
    uint64_t counters[FP_C_COUNT];
    char cupti_path[256];    // the libcupti in use (NUL-terminated)
    char state_message[192]; // why the state is what it is, for people (NUL-terminated)
    uint8_t reserved0[24];
    uint64_t write_seq __attribute__((aligned(64)));  // records claimed so far (own cache line: every
    uint8_t reserved1[56];                              // writer increments it)
    uint64_t names_used __attribute__((aligned(64))); // bytes of the names area complete
    uint8_t reserved2[56];
};

#define FP_CUPTI_RECORDS_OFFSET 4096u
#define FP_CUPTI_NAMES_OFFSET (FP_CUPTI_RECORDS_OFFSET + FP_CUPTI_CAPACITY * 64u)
#define FP_CUPTI_RING_BYTES (FP_CUPTI_NAMES_OFFSET + FP_CUPTI_NAMES_BYTES)

// A names-area entry: uint32 length (bytes, without the NUL), uint32 FNV-1a 32 hash of the whole name
// (before any cut), the bytes, a NUL, then zero padding to a multiple of 8.
#define FP_CUPTI_NAME_HEADER 8u

_Static_assert(sizeof(struct fp_cupti_activity) == 48, "activity body");
_Static_assert(sizeof(struct fp_cupti_launch) == 48, "launch body");
_Static_assert(__builtin_offsetof(struct fp_cupti_record, u.activity.check) == 60, "check is last");
_Static_assert(__builtin_offsetof(struct fp_cupti_record, u.launch.check) == 60, "check is last");
_Static_assert(sizeof(struct fp_cupti_record) == 64, "record");
_Static_assert(sizeof(struct fp_cupti_header) <= FP_CUPTI_RECORDS_OFFSET, "header fits its page");
_Static_assert((FP_CUPTI_CAPACITY & (FP_CUPTI_CAPACITY - 1)) == 0, "capacity is a power of two");

// The record's check: a 32-bit mix of the 13 little-endian uint32 words at bytes 8..59 (kind through the
// end of the body). agent/gpu/cupti_ring.py computes the same.
static inline uint32_t fp_cupti_check(const struct fp_cupti_record *r) {
    const uint32_t *w = (const uint32_t *)((const char *)r + 8);
    uint32_t h = 0x9E3779B9u;
    for (int i = 0; i < 13; i++) {
        h ^= w[i];
        h *= 0x85EBCA6Bu;
        h ^= h >> 13;
    }
    return h;
}

static inline uint32_t fp_cupti_fnv1a(const char *s, uint32_t *len_out) {
    uint32_t h = 2166136261u, n = 0;
    for (; s[n]; n++) {
        h ^= (uint8_t)s[n];
        h *= 16777619u;
    }
    *len_out = n;
    return h;
}

#endif
