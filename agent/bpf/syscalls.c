// Syscall tracer: counts every syscall per (tgid, syscall nr) and times a sampled fraction of them
// into log2 latency histograms, aggregated in the kernel.
//
// Loaded by agent/syscalls.py, which defines TABLE_SIZE, NBUCKETS, SAMPLE_EVERY (0 = count only, else a
// power of two: time one call in SAMPLE_EVERY), SAMPLE_BY_COUNTER, PROCESS_EVENTS (1: tell user space
// of each process at its first syscall) and KNOWN_SIZE with -D flags, and mirrors every struct here with
// ctypes (process_event.h's in agent/sampler.py).
//
// Rules this file keeps:
//  * Raw tracepoints only (no kprobes on this fleet; empty classic tracepoint programs on enter+exit cost
//    +225 ns a syscall against +147 for raw ones, measured on this machine kind).
//    Every syscall of every process runs these programs, so the untimed path is kept to one helper for
//    pid/tgid, one per-CPU hash lookup and the sampling decision.
//  * No kernel struct is read through headers (the agent may compile with another kernel's headers, which
//    corrupts field reads silently). Only helpers and the raw tracepoint arguments feed the data; the task
//    pointer is used as an opaque handle for task storage.
//  * Start times live in task storage: when a task dies inside a syscall (SIGKILL, exit_group) its
//    pending start dies with it, so nothing leaks however many tasks come and go.
//  * Two sets of aggregate maps, picked by control[0]. User space flips the index, waits a grace period
//    so in-flight programs finish, then drains and empties the idle set: no call is lost or counted twice
//    across a drain.

#include <uapi/asm-generic/errno-base.h>   // EEXIST (a stable uapi number, not a kernel struct)
#include "log2.h"                          // log2_u64: the latency histograms' bucket
#include "scope.h"                         // in_scope(): --cgroup

// What the aggregates are keyed by. `nr` is the syscall number of the task's ABI, which the raw sys_enter
// tracepoint passes as args[1] on every architecture: the node's 64-bit table (x86-64's, or arm64's, which
// is asm-generic's) for 64-bit tasks; a 32-bit compat task reports its own table's numbers, which user
// space names from the 64-bit table (agent/syscall_names.py syscall_name), wrongly.
struct syscall_key {
    u32 tgid;
    u32 nr;
};

// Timed calls of one (tgid, nr) in one window, shared by all CPUs (updated with atomics: only sampled
// calls get here, so contention is rare, and memory does not grow with the CPU count).
struct latency {
    u64 timed;              // calls timed
    u64 total_ns;           // sum of their latencies
    u32 hist[NBUCKETS];     // hist[i]: latencies in [2^i, 2^(i+1)) ns; 0 ns goes to 0, the last is open.
                            // u32: one bucket of one key would need 430M timed calls/s to wrap in 10 s
};

// A task's pending timed call. ns == 0: none pending.
struct start {
    u64 ns;                 // bpf_ktime_get_ns() at sys_enter
    u32 nr;
    u32 epoch;              // timing[TIMING_EPOCH] when the call started
};

// Per-CPU counters, cumulative since load; user space reads deltas. Indices mirror syscalls.py STAT_NAMES.
#define STAT_COUNT_TABLE_FULL    0   // a call not counted: counts map full
#define STAT_LATENCY_TABLE_FULL  1   // a timed call not recorded: latency map full
#define STAT_STORAGE_FAILED      2   // a call not timed: task storage could not be created
#define STAT_IDLE_SKIPPED        3   // sys_enter seen in the idle task (not expected; skipped)
#define STAT_STALE_START         4   // a timed call that outlived its timing window: dropped untimed
#define STAT_EVENTS_LOST         5   // a process event not delivered: ring buffer full
#define NSTATS                   6

// control[0]: index (0 or 1) of the map set the programs write. Written only by user space.
BPF_ARRAY(control, u32, 1);

// counts{0,1}: (tgid, nr) -> calls entered this window, per CPU. Written by on_sys_enter, drained and
// emptied by user space when the set is idle. TABLE_SIZE entries per set. Preallocated, because a
// BPF_F_NO_PREALLOC map allocates inserts from a per-CPU cache that bursts of new keys empty (measured:
// a storm of 3,000 forks lost 2-4% of its new count keys and over half of its latency keys to -ENOMEM,
// with the tables half empty). Memory: TABLE_SIZE x (8 B x possible CPUs + ~80 B) per set.
BPF_F_TABLE("percpu_hash", struct syscall_key, u64, counts0, TABLE_SIZE, 0);
BPF_F_TABLE("percpu_hash", struct syscall_key, u64, counts1, TABLE_SIZE, 0);

#if SAMPLE_EVERY > 0   // timing only: count-only mode creates neither (nor needs BTF for task storage)
// latency{0,1}: (tgid, nr) -> struct latency of the timed calls that exited this window. Written by
// on_sys_exit, drained and emptied with the counts of the same set. Preallocated (as counts) and not
// per-CPU: TABLE_SIZE x ~250 B per set (8 MB for both sets at 16384) whatever the CPU count, where a
// per-CPU value would take 176 B x possible CPUs per entry (1.4 GB for both sets on 256 CPUs).
BPF_F_TABLE("hash", struct syscall_key, struct latency, latency0, TABLE_SIZE, 0);
BPF_F_TABLE("hash", struct syscall_key, struct latency, latency1, TABLE_SIZE, 0);

// timing: the latency duty cycle, written only by user space (agent/syscalls.py LatencyDutyCycle).
// sys_exit is attached only during a timing window plus a tail; outside it the programs cost what count-
// only costs. [TIMING_OPEN] != 0: sys_enter may start timing calls. [TIMING_EPOCH]: the window's number,
// stamped on each start; sys_exit drops a start from an earlier window, whose call blocked past that
// window's tail (the exit that would have consumed it was detached, so its duration is unknown).
#define TIMING_OPEN   0
#define TIMING_EPOCH  1
BPF_ARRAY(timing, u32, 2);

// starts: task -> its pending timed call. Created by on_sys_enter for sampled calls, cleared by
// on_sys_exit, freed by the kernel with the task. Never read or cleared by user space.
BPF_TASK_STORAGE(starts, struct start);
#endif

// sample_counter: per-CPU call counter, used only when SAMPLE_BY_COUNTER (time every SAMPLE_EVERY-th
// call on each CPU). Never cleared.
BPF_PERCPU_ARRAY(sample_counter, u32, 1);

// stats: per-CPU counters (see STAT_*). Never cleared; user space computes deltas.
BPF_PERCPU_ARRAY(stats, u64, NSTATS);

static __always_inline void count_stat(u32 idx) {
    u64 *v = stats.lookup(&idx);
    if (v)
        (*v)++;   // per-CPU slot; syscall probes run with preemption off (bpf_probe.h), no atomics needed
}

#if PROCESS_EVENTS
// Process events: user space learns of a process at its first syscall (and again at exec), while it
// lives, so it can read the process's cgroup (its pod) even when the process exits before the next drain
// and is never sampled on CPU (a short, syscall-bound process). Mirrors cpu_sampler.c's events, plus the
// time, so user space can skip an event its own later capture already covers.
#include "process_event.h"   // struct process_event, EVENT_*: shared with cpu_sampler.c

// known: tgid -> 1 for processes user space has been told about; removed at exit. Looked up only when a
// (tgid, nr) key is new in the window (count_call's insert path), so the per-call cost is unchanged.
BPF_TABLE("lru_hash", u32, u8, known, KNOWN_SIZE);
BPF_RINGBUF_OUTPUT(events, 64);

static __always_inline int notify(u32 tgid, u32 kind) {
    struct process_event *e = events.ringbuf_reserve(sizeof(struct process_event));
    if (!e) {
        count_stat(STAT_EVENTS_LOST);
        return 0;
    }
    e->tgid = tgid;
    e->kind = kind;
    e->ns = bpf_ktime_get_ns();
    // An exit is not urgent: it waits for the next new/exec event (or the agent's periodic look) instead of
    // waking the agent once per process. New and exec events always wake it (a pending exit would
    // otherwise suppress the kernel's adaptive wake-up): it must read the process while it lives.
    events.ringbuf_submit(e, kind == EVENT_EXIT ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP);
    return 1;
}

static __always_inline void note_process(u32 tgid) {
    if (known.lookup(&tgid))
        return;
    if (notify(tgid, EVENT_NEW)) {   // not delivered (a burst filled the buffer): told at a later new key
        u8 one = 1;
        known.update(&tgid, &one);
    }
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (known.lookup(&tgid))
        notify(tgid, EVENT_EXEC);   // its cgroup may have changed before the exec (a container's init)
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    if ((u32)pid_tgid != tgid)   // a thread, not the whole process
        return 0;
    if (known.lookup(&tgid)) {
        known.delete(&tgid);
        notify(tgid, EVENT_EXIT);
    }
    return 0;
}
#endif

// counts[set][key] += 1 on this CPU. Inserting with BPF_ANY is race-free for a per-CPU hash: if another
// CPU inserts the key between our lookup and update, the update only sets this CPU's slot, which the
// other insert left at zero. (BCC cannot rewrite map calls inside macros, hence one branch per set.)
static __always_inline void count_call(u32 set, struct syscall_key *key) {
    u64 *c;
    if (set == 0)
        c = counts0.lookup(key);
    else
        c = counts1.lookup(key);
    if (c) {
        (*c)++;
        return;
    }
    u64 one = 1;
    int err;
    if (set == 0)
        err = counts0.update(key, &one);
    else
        err = counts1.update(key, &one);
    if (err)
        count_stat(STAT_COUNT_TABLE_FULL);
#if PROCESS_EVENTS
    note_process(key->tgid);
#endif
}

static __always_inline int should_time(void) {
#if SAMPLE_EVERY == 1
    return 1;
#elif SAMPLE_BY_COUNTER
    u32 zero = 0;
    u32 *n = sample_counter.lookup(&zero);
    if (!n)
        return 0;
    return ((*n)++ & (SAMPLE_EVERY - 1)) == 0;
#else
    return (bpf_get_prandom_u32() & (SAMPLE_EVERY - 1)) == 0;
#endif
}

int on_sys_enter(struct bpf_raw_tracepoint_args *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if ((u32)pid_tgid == 0) {   // the per-CPU idle task
        count_stat(STAT_IDLE_SKIPPED);
        return 0;
    }
    if (!in_scope())   // outside --cgroup (and so never timed: sys_exit finds no start)
        return 0;
    u32 zero = 0;
    u32 *active = control.lookup(&zero);
    if (!active)
        return 0;
    struct syscall_key key = {.tgid = pid_tgid >> 32, .nr = (u32)ctx->args[1]};
    count_call(*active, &key);

#if SAMPLE_EVERY > 0
    u32 open_idx = TIMING_OPEN;
    u32 *open = timing.lookup(&open_idx);
    if (!open || !*open || !should_time())
        return 0;
    u32 epoch_idx = TIMING_EPOCH;
    u32 *epoch = timing.lookup(&epoch_idx);
    if (!epoch)
        return 0;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    struct start *s = starts.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!s) {
        count_stat(STAT_STORAGE_FAILED);
        return 0;
    }
    s->nr = key.nr;
    s->epoch = *epoch;
    s->ns = bpf_ktime_get_ns();   // last: the syscall starts after this program returns
#endif
    return 0;
}

#if SAMPLE_EVERY > 0
// latency[set][key] += one call of `ns`. Inserted with BPF_NOEXIST: a racing insert from another CPU
// makes ours fail with -EEXIST and both then update the one element (BPF_ANY would replace it and lose
// the other CPU's update).
static __always_inline void record_latency(u32 set, struct syscall_key *key, u64 ns) {
    struct latency *l;
    if (set == 0)
        l = latency0.lookup(key);
    else
        l = latency1.lookup(key);
    if (!l) {
        struct latency empty = {};
        int err;
        if (set == 0) {
            err = latency0.insert(key, &empty);
            l = latency0.lookup(key);
        } else {
            err = latency1.insert(key, &empty);
            l = latency1.lookup(key);
        }
        if ((err && err != -EEXIST) || !l) {
            count_stat(STAT_LATENCY_TABLE_FULL);
            return;
        }
    }
    u32 b = log2_u64(ns);
    if (b > NBUCKETS - 1)
        b = NBUCKETS - 1;
    // Linux 6.1's verifier loses that bound when clang turns the clamp into a conditional select ("R0
    // unbounded memory access" on hist[b]: measured on Debian bookworm's 6.1, where 6.18 accepts it). An
    // opaque copy and a real branch give it a bound it follows; the branch is never taken.
    asm volatile("" : "+r"(b));
    if (b >= NBUCKETS)
        return;
    __sync_fetch_and_add(&l->timed, 1);
    __sync_fetch_and_add(&l->total_ns, ns);
    __sync_fetch_and_add(&l->hist[b], 1);
}

int on_sys_exit(struct bpf_raw_tracepoint_args *ctx) {
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    struct start *s = starts.task_storage_get(task, 0, 0);   // no create: untimed calls stop here
    if (!s || s->ns == 0)
        return 0;
    u64 ns = bpf_ktime_get_ns() - s->ns;
    s->ns = 0;
    u32 epoch_idx = TIMING_EPOCH;
    u32 *epoch = timing.lookup(&epoch_idx);
    if (!epoch || *epoch != s->epoch) {
        count_stat(STAT_STALE_START);
        return 0;
    }

    u32 zero = 0;
    u32 *active = control.lookup(&zero);
    if (!active)
        return 0;
    struct syscall_key key = {.tgid = bpf_get_current_pid_tgid() >> 32, .nr = s->nr};
    record_latency(*active, &key, ns);
    return 0;
}
#endif
