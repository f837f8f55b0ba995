// CPU stack sampler: runs on a perf_event (software CPU clock) on every CPU, aggregates samples in the
// kernel and notifies user space of processes it has not described yet. With OFF_CPU, also records where
// threads wait: blocked nanoseconds by the stack a thread left the CPU with (sched:sched_switch).
//
// Loaded by agent/sampler.py, which defines ARCH_ARM64, MAX_DEPTH, COUNTS_SIZE, STACKS_SIZE, SEEN_SIZE, INCLUDE_IDLE,
// STACKS_MAP_FLAGS, GPU_SLOT_NS, GPU_FINE_SLOT_NS, GPU_PROCS_SIZE, PYTHON_STACKS, PY_MAX_DEPTH,
// PY_MAX_THREADS, PY_STACKS_SIZE, PY_PROCS_SIZE, PY_NEW_PAGES, OFF_CPU, OFFCPU_SAMPLE_EVERY,
// OFFCPU_MIN_BLOCK_NS, OFFCPU_EXACT_NS, OFFCPU_RUNNABLE, OFFCPU_COUNTS_SIZE, OFFCPU_TASKS_SIZE, CUDA and, for
// unwind.h, UNWIND, UNWIND_ROWS, UNWIND_FILES, UNWIND_MAPS, UNWIND_PROCS, UNWIND_FRAMES_PER_PROG and
// UNWIND_MAX_FRAMES with -D flags, and mirrors every struct here with ctypes. With CUDA, agent/bpf/cuda_probes.c
// is compiled after this file, appended to its text (BCC makes programs only of the main file's functions) (it shares the stack maps and the walk: WALK_CUDA,
// task_walks, unwind_state.at_entry); agent/gpu/cuda_probes.py attaches its uprobes.
//
// Rules this file keeps:
//  * No kernel struct is read through headers. The agent may run with headers of another kernel
//    version (measured: 6.1 headers on a 6.18 kernel read task->tgid as garbage, silently). Only BPF
//    helpers (pid/tgid, comm, cgroup id, stacks) feed the data.
//  * Stacks are hashed by us (64-bit) and stored in a hash map, not BPF_STACK_TRACE: a stack-trace
//    map's id is a hash bucket, so distinct stacks collide (-EEXIST) long before the map is full.
//  * Two sets of maps (counts + stacks), picked by control[0]. User space flips the index, waits a
//    grace period so in-flight programs finish, then drains and empties the idle set: no sample is lost
//    or attributed to the wrong window across a drain.
//  * sched_switch reads only its tracepoint arguments (prev_pid, prev_state, next_pid: BCC builds the args
//    struct from the running kernel's format file) and, for the task leaving, the same helpers as the
//    sampler: the tracepoint fires before the switch, so `current` is still prev.
//  * One table walk (unwind_one), entered from every kind of program that takes a stack (unwind.h): the
//    perf_event sampler, sched_switch (a tracepoint), sys_exit (a raw tracepoint) and the CUDA uprobes
//    (kprobe programs). A tail call stays within one program type, so each type has its own step program
//    and prog array; what the walk was for (a sample, a switch-out, ...) is in its state, and walk_finish
//    does it. The perf_event and sched_switch programs hold bpf_prog_active and run with interrupts off, so
//    neither interrupts the other: they share per-CPU state. Uprobe and raw-tracepoint programs hold
//    neither (a uprobe program can be preempted: measured PREEMPT_RCU kernels), so theirs is the task's
//    own (task storage, struct task_walk).
#include <uapi/linux/ptrace.h>

// A perf_event program's context (uapi/linux/bpf_perf_event.h, a fixed ABI): the interrupted registers as the
// architecture's bpf_user_pt_regs_t, then the period and address. Declared here, not included: on x86-64
// that header drags in the kernel's whole asm/ptrace.h tree, ~1 s of BCC's compile of this file at every
// agent start (2.2 s against 1.1 s for CPU samples alone: bench/bpf_compile.py). On arm64 it is light.
#if ARCH_ARM64
typedef struct user_pt_regs sample_regs_t;
#else
typedef struct pt_regs sample_regs_t;
#endif
struct bpf_perf_event_data {
    sample_regs_t regs;
    u64 sample_period;
    u64 addr;
};

#include "process_event.h"   // struct process_event, EVENT_*: here for sampled processes
#include "python_stack.h"
#include "scope.h"   // in_scope(): --cgroup

// A stored stack: `len` return addresses, leaf first (as the kernel unwinds them).
struct stack_trace {
    u64 len;
    u64 ip[MAX_DEPTH];
};

// What one aggregated sample is keyed by. Stack ids are our 64-bit hashes; 0 means "no stack"
// (see the stats for why) and 1 means "a stack existed but could not be stored".
struct sample_key {
    u32 tgid;
    u32 tid;
    u64 cgroup_id;     // cgroup v2 inode of the task (same value for every task on v1-only nodes)
    u64 user_stack;
    u64 kernel_stack;
    u64 python_stack;  // CPython frames of this thread (python_stacks{0,1}); 0 for other processes
    u64 gpu_slot;      // processes on a GPU: bpf_ktime_get_ns() / GPU_SLOT_NS + 1, so user space can
                       // join the sample with the GPU's busy/idle state at that time; 0 for others
    char comm[16];     // thread name at sample time
};

#include "unwind.h"   // after struct stack_trace and struct sample_key, which its walk state holds

// Per-CPU counters, cumulative since load; user space reads deltas. Each index is the position of its name
// in agent/sampler.py STAT_NAMES.
#define STAT_SAMPLES             0
#define STAT_USER_STACK_MISSING  1
#define STAT_USER_STACK_ERROR    2
#define STAT_KERNEL_STACK_ERROR  3
#define STAT_STACK_TABLE_FULL    4
#define STAT_COUNT_TABLE_FULL    5
#define STAT_EVENTS_LOST         6
#define STAT_IDLE_SKIPPED        7
#define STAT_PY_SAMPLES          8    // samples of processes with a CPython the walker supports
#define STAT_PY_NO_THREAD        9
#define STAT_PY_UNWIND_FAILED    10
#define STAT_PY_TRUNCATED        11
#define STAT_PY_STACK_TABLE_FULL 12
#define STAT_PY_NO_NAMESPACE     13
// Off-CPU (sched_switch); all zero without OFF_CPU.
#define STAT_OFFCPU_SWITCHES     14   // switch-outs of tasks on the node (the idle task's left out)
#define STAT_OFFCPU_SAMPLED      15   // switch-outs sampled: stacks taken, start kept
#define STAT_OFFCPU_RUNNABLE     16   // ... of which the task left runnable (preempted, or yielded)
#define STAT_OFFCPU_RECORDED     17   // sampled waits added to offcpu{0,1}
#define STAT_OFFCPU_BELOW_MIN    18   // sampled waits shorter than OFFCPU_MIN_BLOCK_NS: dropped
#define STAT_OFFCPU_STATE_FULL   19   // a sampled switch-out not kept: offcpu_starts could not take it
#define STAT_OFFCPU_COUNT_FULL   20   // a wait not recorded: offcpu{0,1} full
#define STAT_OFFCPU_CARRIED      21   // stacks copied into the current set for a wait that crossed a flip
// User stacks unwound by tables (UNWIND; unwind.h): walks started, then how each ended (one reason a walk),
// and frames stepped by frame pointer on the way (a file without a table, or a gap in one).
#define STAT_UNWIND_WALKS        22
#define STAT_UNWIND_END          23   // reached the outermost frame: the normal end
#define STAT_UNWIND_NO_MAPPING   24   // an address outside the process's known mappings (a dlopen since?)
#define STAT_UNWIND_JIT          25   // an address in anonymous executable memory (JIT code)
#define STAT_UNWIND_NO_TABLE     26   // a file without a table, and no frame pointer to go on with
#define STAT_UNWIND_FP_FAILED    27   // a gap in a table, and no frame pointer to go on with
#define STAT_UNWIND_READ_FAULT   28   // the stack could not be read where the table said (or went down)
#define STAT_UNWIND_DEPTH        29   // UNWIND_MAX_FRAMES reached
#define STAT_UNWIND_SIGNAL       30   // a signal frame (its caller is in the signal context: not followed)
#define STAT_UNWIND_UNSUPPORTED  31   // a rule the walker does not follow (CFA by expression)
#define STAT_UNWIND_FP_FRAMES    32   // frames stepped by frame pointer (not an end)
#define STAT_UNWIND_FALLBACK     33   // samples of a tabled process unwound by frame pointer instead:
                                      // no user registers, or the tail call failed
#define STAT_UNWIND_JIT_FP       34   // frames in anonymous executable memory (JIT code) stepped by frame
                                      // pointer back into mapped code (not an end; STAT_UNWIND_JIT: it did not)
#define STAT_PY_CYCLE            35   // CPython walks that met a frame again: stale memory, frames dropped
#define STAT_PY_STALE            36   // CPython walks cut at a frame whose owner or code object is not one
#define STAT_PY_NAMES_LOST       37   // new CPython stacks not announced (python_new full): named at the drain
// Waits at or above OFFCPU_EXACT_NS, each recorded once at its own length whether or not its switch-out was
// sampled (OFFCPU_EXACT_NS > 0).
#define STAT_OFFCPU_EXACT        38   // long waits recorded exactly
#define STAT_OFFCPU_EXACT_UNTAKEN 39  // ... of which without a user stack: not sampled, and the wait did not
                                      // end in a return to the same user context (preempted in user code)
#define STAT_TASK_STORAGE_FAILED 40   // a task's storage could not be made: its wait or walk not kept
#define STAT_OFFCPU_EXACT_WALKS  41   // user stacks of long unsampled waits walked at their syscall's return
// CUDA uprobes (cuda_probes.c); all zero without CUDA.
#define STAT_CUDA_LAUNCHES       42   // kernel launches seen (every one)
#define STAT_CUDA_SAMPLED        43   // ... of which their stacks taken (1 in CUDA_LAUNCH_SAMPLE_EVERY)
#define STAT_CUDA_NESTED         44   // driver launches made by the runtime: not counted again
#define STAT_CUDA_CALLS          45   // timed calls that returned
#define STAT_CUDA_TABLE_FULL     46   // a launch or call not recorded: its map was full
#define STAT_STACK_INSERT_FAILED 47   // a new stack the map could not take in the moment, not full: its
                                     // allocator's per-CPU cache empty (by-need maps) or its bucket busy
#define NSTATS                   48

// Stack ids below STACK_RESERVED name no stored stack: 0 none, 1 lost (not stored: its map full or busy),
// 2 not taken (a long wait recorded exactly without its stack), STACK_SYSCALL + nr: the wait was in syscall
// nr (the kernel stack of a long wait whose stack was taken at that syscall's return). Hashes are moved out
// of the range.
#define STACK_NONE     0
#define STACK_LOST     1
#define STACK_UNTAKEN  2
#define STACK_SYSCALL  0x400
#define STACK_RESERVED 0x800

// control[0]: index (0 or 1) of the map set the sampler writes. Written only by user space.
BPF_ARRAY(control, u32, 1);

// counts{0,1}: sample_key -> number of samples this window. Written by the sampler, drained and
// emptied by user space when the set is idle. Sized for the samples of one interval on this node.
BPF_HASH(counts0, struct sample_key, u64, COUNTS_SIZE);
BPF_HASH(counts1, struct sample_key, u64, COUNTS_SIZE);

// stacks{0,1}: our stack hash -> the stack. Written by the sampler (insert-if-absent), drained and
// emptied with the counts of the same set. STACKS_MAP_FLAGS is BPF_F_NO_PREALLOC where the kernel allows it
// in perf_event programs (6.1+, agent/sampler.py stacks_map_flags): ~1 KB an entry, so a preallocated pair
// sized for a 64-CPU node holds ~110 MB of kernel memory whether or not a window has that many stacks; by
// need it holds the stacks of the window. An insert the kernel's per-CPU cache cannot serve at once (a
// burst of new stacks) is counted as stack_table_full, as a full table is.
BPF_F_TABLE("hash", u64, struct stack_trace, stacks0, STACKS_SIZE, STACKS_MAP_FLAGS);
BPF_F_TABLE("hash", u64, struct stack_trace, stacks1, STACKS_SIZE, STACKS_MAP_FLAGS);

// scratch: per-CPU buffer bpf_get_stack writes into (too large for the 512-byte BPF stack).
BPF_PERCPU_ARRAY(scratch, struct stack_trace, 1);

// python_stacks{0,1}: our hash of a CPython frame chain -> the frames. Same discipline as stacks{0,1}.
BPF_F_TABLE("hash", u64, struct py_stack, python_stacks0, PY_STACKS_SIZE, STACKS_MAP_FLAGS);
BPF_F_TABLE("hash", u64, struct py_stack, python_stacks1, PY_STACKS_SIZE, STACKS_MAP_FLAGS);

// python_procs: tgid -> where its interpreter keeps its state. Filled by user space when it describes a
// process running a supported CPython (agent/python/), deleted here at exec and exit (and by user space
// when it forgets the process).
BPF_HASH(python_procs, u32, struct py_proc, PY_PROCS_SIZE);

// python_threads: pid_tgid -> that thread's PyThreadState, a cache that spares the walk over the thread
// list; validated on every use (native_thread_id must still match), LRU-bounded.
BPF_TABLE("lru_hash", u64, u64, python_threads, PY_PROCS_SIZE * 4);

// python_scratch: per-CPU buffer for the frames of one walk (1 KB; too large for the BPF stack).
BPF_PERCPU_ARRAY(python_scratch, struct py_stack, 1);

// python_new: each CPython stack as it is first stored in a window (struct py_new_stack), so that user space
// names its code objects while they and their process still live (a code object freed or a process gone by
// the drain could not be named). Consumed by the agent's process-event thread; woken adaptively (once per
// batch it has not read yet). Full: counted (STAT_PY_NAMES_LOST); the drain names what it can.
BPF_RINGBUF_OUTPUT(python_new, PY_NEW_PAGES);

// gpu_procs: tgid -> GPU_TAG_* for processes that hold a GPU context (from NVML's process lists) or whose
// GPU activity the agent reads (our CUPTI library). Written only by user space; their samples and waits
// carry a time slot (sample_key.gpu_slot, see gpu_slot_at). GPU_PROCS_SIZE entries; a process not in it (the
// map full, or no GPU) is profiled as usual, untagged.
BPF_HASH(gpu_procs, u32, u8, GPU_PROCS_SIZE);
#define GPU_TAG_POLLED   1   // NVML's utilization: slots of GPU_SLOT_NS (its poll interval)
#define GPU_TAG_TIMELINE 2   // the process's own activity timeline (agent/gpu/activity.py): GPU_FINE_SLOT_NS
#define GPU_SLOT_FINE    (1ULL << 63)   // marks a slot of GPU_FINE_SLOT_NS in sample_key.gpu_slot

// task_walks: task -> the state of a walk taken in that task's own context by a program that can be
// preempted or interrupted mid-walk (uprobes, sys_exit): per-CPU state would be overwritten by whatever ran
// in between. ~2.2 KB per task that ever took such a walk, freed by the kernel with the task.
struct task_walk {
    struct unwind_state walk;
    struct py_stack py;      // the CPython walk's scratch
};
BPF_TASK_STORAGE(task_walks, struct task_walk);

// stats: per-CPU counters (see STAT_*). Never cleared; user space computes deltas.
BPF_PERCPU_ARRAY(stats, u64, NSTATS);

// seen: tgid -> 1 for processes user space has been told about. Entries are removed at exit and
// exec (so a reused or re-executed pid is described again); LRU bounds it if exits are missed.
BPF_TABLE("lru_hash", u32, u8, seen, SEEN_SIZE);

// events: new/exec/exit notifications, consumed by the agent's process table thread.
BPF_RINGBUF_OUTPUT(events, 64);

#if OFF_CPU
// A sampled switch-out, kept until the task runs again.
struct offcpu_start {
    struct sample_key key;   // who left and with which stacks (gpu_slot is set at wake-up)
    u64 ns;                  // bpf_ktime_get_ns() at switch-out
    u64 ran_ns;              // how long it had run since its switch-in (0 if that came before the load)
    u32 set;                 // the map set its stacks went into (control[0] then)
    u32 runnable;            // 1: it left runnable (preempted or yielded), 0: it blocked
};

// What a sampled wait adds to its row, both scaled by OFFCPU_SAMPLE_EVERY: the wait, and the run that ended
// in it (switch-in to switch-out). User space tells threads that mostly wait (idle pools) from threads
// that work by the two sums (agent/offcpu.py).
struct offcpu_value {
    u64 ns;       // switched out
    u64 ran_ns;   // on CPU just before
};

// offcpu{0,1}: sample_key -> offcpu_value for this window. Added to when a sampled task runs again (the
// window of the wake-up); drained and emptied with counts/stacks of the same set. OFFCPU_COUNTS_SIZE
// entries per set (agent/sampler.py SamplerConfig.offcpu_sizes), preallocated as counts{0,1} are: an
// insert never waits on memory, in a program that runs inside the scheduler.
BPF_HASH(offcpu0, struct sample_key, struct offcpu_value, OFFCPU_COUNTS_SIZE);
BPF_HASH(offcpu1, struct sample_key, struct offcpu_value, OFFCPU_COUNTS_SIZE);

// switched_in: per CPU, bpf_ktime_get_ns() of its last context switch, i.e. when the task now on it started
// running. Written at every switch (a per-CPU slot: no hash, no lock), read at a sampled switch-out.
BPF_PERCPU_ARRAY(switched_in, u64, 1);

#if OFFCPU_EXACT_NS
// A task's last switch-out, whatever the sampling: a wait found at or above OFFCPU_EXACT_NS is recorded at
// its own length (weight 1), with the stack taken at the return of the syscall it waited in.
struct offcpu_task {
    u64 out_ns;     // bpf_ktime_get_ns() at the switch-out; 0 once its wait was dealt with
    u64 ran_ns;     // the run that ended there
    u64 user_ip;    // the user context saved at its entry into the kernel: a later syscall return with the
    u64 user_sp;    // same one is the return from this wait, and the user stack is the one it waited with
    u32 sampled;    // the switch-out was sampled: offcpu_wake records it, with the stacks taken then
    u32 pad;
    u64 pend_ns;    // long unsampled waits earlier in the same kernel entry (a syscall that blocked, woke and
    u64 pend_ran;   // was preempted or blocked again before it returned): recorded with it, as one wait
};
// offcpu_tasks: task -> its last switch-out. Written at every switch-out (sched_switch), read and cleared at
// the task's next syscall return (sys_exit) or switch-out; freed by the kernel with the task (no capacity to
// outgrow: the longest sleepers are the ones that must not be evicted).
BPF_TASK_STORAGE(offcpu_tasks, struct offcpu_task);
#endif

// offcpu_starts: tid -> its pending sampled switch-out. Created at a sampled switch-out, deleted when that
// task is next switched in; never created for a task's last switch-out (state X or Z) and deleted at
// sched_process_exit for every exiting thread, so a dying task leaves nothing behind. LRU as a backstop:
// were a deletion ever missed, old entries make room instead of filling the map. Read (not written) by
// user space at each drain, for the stack ids that waits still in progress will be recorded under.
// OFFCPU_TASKS_SIZE entries, preallocated (LRU maps always are).
BPF_TABLE("lru_hash", u32, struct offcpu_start, offcpu_starts, OFFCPU_TASKS_SIZE);
#endif

static __always_inline void count_stat(u32 idx) {
    u64 *v = stats.lookup(&idx);
    if (v)   // per-CPU slot, but a uprobe program can be interrupted by the sampler mid-increment
        __sync_fetch_and_add(v, 1);
}

// The GPU time slot of `tgid` at `t` (CLOCK_MONOTONIC) for sample_key.gpu_slot; 0 for a process on no GPU.
static __always_inline u64 gpu_slot_at(u32 tgid, u64 t) {
    u8 *tag = gpu_procs.lookup(&tgid);
    if (!tag)
        return 0;
    if (*tag == GPU_TAG_TIMELINE)
        return (t / GPU_FINE_SLOT_NS + 1) | GPU_SLOT_FINE;
    return t / GPU_SLOT_NS + 1;
}

static __always_inline void notify(u32 tgid, u32 kind) {
    struct process_event *e = events.ringbuf_reserve(sizeof(struct process_event));
    if (!e) {
        count_stat(STAT_EVENTS_LOST);
        return;
    }
    e->tgid = tgid;
    e->kind = kind;
    e->ns = bpf_ktime_get_ns();
    // An exit is not urgent: it waits for the next new/exec event (or the agent's periodic look) instead of
    // waking the agent once per process. New and exec events always wake it (a pending exit would
    // otherwise suppress the kernel's adaptive wake-up): it must read the process while it lives.
    events.ringbuf_submit(e, kind == EVENT_EXIT ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP);
}

// 64-bit mix over the frames (splitmix-style finaliser per step). Distinct stacks colliding is
// ~n^2/2^65: for a million stacks, one chance in 36 million.
static __always_inline u64 hash_stack(struct stack_trace *st, u64 seed) {
    u64 h = seed ^ (st->len * 0x9E3779B97F4A7C15ULL);
#pragma clang loop unroll(disable)
    for (int i = 0; i < MAX_DEPTH; i++) {
        if (i >= st->len)
            break;
        h ^= st->ip[i];
        h *= 0xff51afd7ed558ccdULL;
        h ^= h >> 33;
    }
    if (h < STACK_RESERVED)
        h += STACK_RESERVED;   // the reserved ids name no stored stack
    return h;
}

// Stores the stack in `st` into the stacks map of `set` (if it is not there yet) and returns its id.
// (BCC cannot rewrite map calls inside macros, hence one branch per set.)
static __always_inline u64 store_stack(u32 set, struct stack_trace *st, u64 seed) {
    u64 h = hash_stack(st, seed);
    int err;
    if (set == 0) {
        if (stacks0.lookup(&h))
            return h;
        err = stacks0.update(&h, st);
    } else {
        if (stacks1.lookup(&h))
            return h;
        err = stacks1.update(&h, st);
    }
    if (err == 0 || err == -EEXIST)
        return h;
    count_stat(err == -E2BIG ? STAT_STACK_TABLE_FULL : STAT_STACK_INSERT_FAILED);
    return STACK_LOST;
}

static __always_inline u64 hash_python_stack(struct py_stack *st) {
    u64 h = 0x707974686f6e6b31ULL ^ (st->len * 0x9E3779B97F4A7C15ULL);
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_MAX_DEPTH; i++) {
        if (i >= st->len)
            break;
        h ^= st->frames[i].code;
        h *= 0xff51afd7ed558ccdULL;
        h ^= h >> 33;
        h ^= ((u64)st->frames[i].tag << 32) | st->frames[i].instr;
        h *= 0xc4ceb9fe1a85ec53ULL;
        h ^= h >> 29;
    }
    if (h < STACK_RESERVED)
        h += STACK_RESERVED;
    return h;
}

// The current thread's CPython stack id (STACK_NONE when it has no Python frames or the walk failed).
// `sample`: a CPU sample, whose walk outcomes the python_* stats count (they are per-sample ratios; off-CPU
// walks would skew them). Table-full is counted either way: the table is shared. `st`: where the frames are
// walked into (python_scratch for the perf_event and sched_switch programs, the task's own struct task_walk
// for programs that can be preempted or interrupted mid-walk).
static __always_inline u64 python_stack(u32 set, u64 pid_tgid, struct py_proc *p, int sample,
                                        struct py_stack *st) {
    if (sample)
        count_stat(STAT_PY_SAMPLES);
    struct bpf_pidns_info ns = {};
    if (bpf_get_ns_current_pid_tgid(p->pidns_dev, p->pidns_ino, &ns, sizeof(ns)) != 0) {
        if (sample)
            count_stat(STAT_PY_NO_NAMESPACE);
        return STACK_NONE;
    }
    u64 *cached = python_threads.lookup(&pid_tgid);
    u64 ts = py_find_thread(p, ns.pid, cached ? *cached : 0);
    if (!ts) {
        if (sample)
            count_stat(STAT_PY_NO_THREAD);
        return STACK_NONE;
    }
    if (!cached || *cached != ts)
        python_threads.update(&pid_tgid, &ts);
    u32 outcome = py_walk(p, ts, st);
    if (sample && outcome == PY_TRUNCATED)
        count_stat(STAT_PY_TRUNCATED);
    else if (sample && outcome == PY_UNWIND_FAILED)
        count_stat(STAT_PY_UNWIND_FAILED);
    else if (sample && outcome == PY_STALE)
        count_stat(STAT_PY_STALE);
    if (outcome == PY_CYCLE) {
        if (sample)
            count_stat(STAT_PY_CYCLE);
        return STACK_NONE;   // which of the frames are real cannot be told: native frames only
    }
    if (st->len == 0)
        return STACK_NONE;   // idle thread state, or the first read failed: native frames only
    u64 h = hash_python_stack(st);
    int err;
    if (set == 0) {
        if (python_stacks0.lookup(&h))
            return h;
        err = python_stacks0.update(&h, st);
    } else {
        if (python_stacks1.lookup(&h))
            return h;
        err = python_stacks1.update(&h, st);
    }
    if (err != 0 && err != -EEXIST) {
        count_stat(STAT_PY_STACK_TABLE_FULL);
        return STACK_LOST;
    }
    struct py_new_stack *e = python_new.ringbuf_reserve(sizeof(struct py_new_stack));
    if (e) {
        e->tgid = pid_tgid >> 32;
        e->pad = 0;
        if (bpf_probe_read_kernel(&e->stack, sizeof(e->stack), st) == 0)
            python_new.ringbuf_submit(e, 0);
        else
            python_new.ringbuf_discard(e, 0);
    } else {
        count_stat(STAT_PY_NAMES_LOST);
    }
    return h;
}

static __always_inline void count_sample(u32 set, struct sample_key *key) {
    u64 zero = 0;
    u64 *c;
    if (set == 0)
        c = counts0.lookup_or_try_init(key, &zero);
    else
        c = counts1.lookup_or_try_init(key, &zero);
    if (c)
        __sync_fetch_and_add(c, 1);
    else
        count_stat(STAT_COUNT_TABLE_FULL);
}

// The current task's user stack, walked by frame pointer, into `key` (stored in `set`). `sample`: count the
// outcomes in the CPU sampler's stats (off-CPU switch-outs leave them to the samples).
static __always_inline void take_user_stack(void *ctx, u32 set, struct sample_key *key, struct stack_trace *st,
                                            int sample) {
    int n = bpf_get_stack(ctx, st->ip, sizeof(st->ip), BPF_F_USER_STACK);
    if (n > 0) {
        st->len = n / sizeof(u64);
        key->user_stack = store_stack(set, st, 0x7573657273746b31ULL);
    } else if (sample && (n == 0 || n == -EFAULT)) {
        count_stat(STAT_USER_STACK_MISSING);   // kernel threads, or a task without a user context
    } else if (sample) {
        count_stat(STAT_USER_STACK_ERROR);
    }
}

static __always_inline void take_kernel_stack(void *ctx, u32 set, struct sample_key *key,
                                              struct stack_trace *st, int sample) {
    int n = bpf_get_stack(ctx, st->ip, sizeof(st->ip), 0);
    if (n > 0) {
        st->len = n / sizeof(u64);
        key->kernel_stack = store_stack(set, st, 0x6b65726e656c6b31ULL);
    } else if (sample && n < 0) {
        count_stat(STAT_KERNEL_STACK_ERROR);
    }
}

static __always_inline void take_stacks(void *ctx, u32 set, struct sample_key *key, struct stack_trace *st,
                                        int sample) {
    take_user_stack(ctx, set, key, st, sample);
    take_kernel_stack(ctx, set, key, st, sample);
}

// Tell user space about a process it has not described yet (it reads /proc while the process lives).
static __always_inline void note_process(u32 tgid) {
    if (tgid != 0 && !seen.lookup(&tgid)) {
        u8 one = 1;
        seen.update(&tgid, &one);
        notify(tgid, EVENT_NEW);
    }
}

#if OFF_CPU
// Adds a wait of `ns` (and the run `ran_ns` that ended in it) to `key`'s off-CPU row of `set`.
static __always_inline void add_offcpu(u32 set, struct sample_key *key, u64 ns, u64 ran_ns) {
    struct offcpu_value zero = {};
    struct offcpu_value *c;
    if (set == 0)
        c = offcpu0.lookup_or_try_init(key, &zero);
    else
        c = offcpu1.lookup_or_try_init(key, &zero);
    if (c) {
        __sync_fetch_and_add(&c->ns, ns);
        __sync_fetch_and_add(&c->ran_ns, ran_ns);
        count_stat(STAT_OFFCPU_RECORDED);
    } else {
        count_stat(STAT_OFFCPU_COUNT_FULL);
    }
}

// The run of the current task that ends at this switch-out (at `now`), which began at `since` (this CPU's
// last switch-in; 0: before the load). The clock's span counts whatever the CPU did meanwhile; the
// scheduler's own count of the task's run (se.sum_exec_runtime since se.prev_sum_exec_runtime, which it sets
// when it picks the task; at offsets from the kernel's BTF, agent/kernel_btf.py) leaves out the time the
// hypervisor took the vCPU away (steal, on kernels with PARAVIRT_TIME_ACCOUNTING) at ns resolution. An idle
// pool thread that woke for 10 us while its vCPU was stolen read as having run for milliseconds, was judged
// active (agent/offcpu.py idle_threads) and its naps stood in the wall view. A class that does not set
// prev_sum_exec_runtime (RT, deadline) counts more than the run there: the span bounds it.
static __always_inline u64 run_ending(u64 since, u64 now) {
    u64 span = since && now > since ? now - since : 0;
#if TASK_SUM_EXEC_OFF
    u64 task = bpf_get_current_task();
    u64 sum = 0, prev = 0;
    if (bpf_probe_read_kernel(&sum, sizeof(sum), (void *)(task + TASK_SUM_EXEC_OFF)) == 0 &&
        bpf_probe_read_kernel(&prev, sizeof(prev), (void *)(task + TASK_PREV_SUM_EXEC_OFF)) == 0 &&
        sum >= prev && sum - prev < span)
        return sum - prev;
#endif
    return span;
}

// A sampled switch-out, its stacks taken (into `set`): keep its start until the task runs again. `since`:
// when it was switched in (0: before the load), so the run that ends here goes with the wait.
static __always_inline void offcpu_keep(u32 set, struct sample_key *key, u64 since, u32 runnable) {
    struct offcpu_start st = {};
    st.key = *key;
    st.set = set;
    st.runnable = runnable;
    st.ns = bpf_ktime_get_ns();   // last: the stack walks before this are on-CPU time
    st.ran_ns = run_ending(since, st.ns);
    u32 tid = key->tid;
    if (offcpu_starts.update(&tid, &st) != 0)
        count_stat(STAT_OFFCPU_STATE_FULL);
    note_process(key->tgid);   // a process that only ever waits still gets described
}
#endif

// -- Walks of a user stack, whatever took them ------------------------------------------------------------
// What a walk is for (unwind_state.purpose): walk_done does it once the user stack is known.
#define WALK_SAMPLE    0   // a CPU sample: count it
#define WALK_OFFCPU    1   // a sampled switch-out: keep its start (arg[0]: its switch-in, arg[1]: runnable)
#define WALK_LONG_WAIT 2   // a long unsampled wait, at its syscall's return: record it (arg[0] ns, arg[1] ran)
#define WALK_CUDA      3   // a CUDA uprobe: ended by cuda_probes.c's cuda_walk_finish (arg: its own)

#define USER_STACK_SEED   0x7573657273746b31ULL
#define KERNEL_STACK_SEED 0x6b65726e656c6b31ULL

// `key` (user_stack filled) is what a walk for `purpose` found: do what it was for.
static __always_inline void walk_done(u32 set, struct sample_key *key, u32 purpose, u64 *arg) {
    if (purpose == WALK_SAMPLE) {
        count_sample(set, key);
        note_process(key->tgid);
        return;
    }
#if OFF_CPU
    if (purpose == WALK_OFFCPU) {
        offcpu_keep(set, key, arg[0], (u32)arg[1]);
        return;
    }
    if (purpose == WALK_LONG_WAIT) {
        count_stat(STAT_OFFCPU_EXACT);
        add_offcpu(set, key, arg[0], arg[1]);
        return;
    }
#endif
    // WALK_CUDA walks end in cuda_probes.c's own cuda_walk_finish: a branch here would be inlined into every
    // program that walks, and sys_exit's grew past what clang keeps as direct helper calls ("unknown
    // opcode 8d", an indirect call).
}

// The walk in `s` ended: store the frames it found and do what it was for.
static __always_inline void walk_finish(struct unwind_state *s) {
    struct sample_key key = s->key;
    if (s->frames.len > 0)
        key.user_stack = store_stack(s->set, &s->frames, USER_STACK_SEED);
    walk_done(s->set, &key, s->purpose, s->arg);
}

// Makes `s` a walk for `purpose` of the current task's user stack from (ip, sp, bp, lr: x30 on arm64, 0 on
// x86-64); the caller tail-calls its program type's step. `at_entry`: ip is a function's first instruction
// (an entry uprobe), whose return address is at sp (x86-64) or in x30 (arm64) whatever its table says.
static __always_inline void walk_init(struct unwind_state *s, struct sample_key *key, u32 set, u32 purpose,
                                      u64 ip, u64 sp, u64 bp, u64 lr, u32 at_entry) {
    s->key = *key;
    s->set = set;
    s->purpose = purpose;
    s->ip = ip;
    s->sp = sp;
    s->bp = bp;
    s->lr = lr;
    s->at_entry = at_entry;
    s->calls = 0;
    s->leaf = 1;
    s->done = 0;
    s->from_jit = 0;
    s->from_fp = 0;
    s->frames.len = 0;
}

#if ARCH_ARM64
// sp, pc: adjacent in arm64's struct pt_regs (regs[31], sp, pc, pstate; a fixed ABI), read in one helper call.
struct user_ip_sp {
    u64 sp;
    u64 ip;
};
#define REGS_IP_SP(regs) (&(regs)->sp)
#define REGS_FP(regs)    (&(regs)->regs[29])   // x29, the frame pointer of the AAPCS64
// x29, x30, sp, pc: adjacent too, read in one call by user_regs.
struct user_regs_a64 {
    u64 fp;
    u64 lr;
    u64 sp;
    u64 ip;
};
// Return addresses signed by pointer authentication (-mbranch-protection, paciasp) carry the signature in
// the bits above the user address space. User code lies below 2^48 (a 52-bit kernel maps memory above that
// only where a process asks for it by an mmap hint), so keeping 48 bits strips the signature whatever the
// CPU's PAC field and the kernel's VA size are; an unsigned address is unchanged.
#define USER_ADDR_MASK ((1ULL << 48) - 1)
#define STRIP_PAC(addr) ((addr) & USER_ADDR_MASK)
#else
// ip, cs, flags, sp: adjacent in x86-64's struct pt_regs (a fixed ABI), read in one helper call.
struct user_ip_sp {
    u64 ip;
    u64 cs;
    u64 flags;
    u64 sp;
};
#define REGS_IP_SP(regs) (&(regs)->ip)
#define REGS_FP(regs)    (&(regs)->bp)
#define STRIP_PAC(addr) (addr)
#endif

// The current task's user ip and sp as its entry into the kernel saved them; 0 when it has none. What
// identifies one entry into the kernel (offcpu_exact_out runs it at every switch-out: one read, not three).
static __always_inline int user_ip_sp(u64 *ip, u64 *sp) {
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    struct user_ip_sp r;
    if (!regs || bpf_probe_read_kernel(&r, sizeof(r), REGS_IP_SP(regs)) != 0 || r.ip == 0)
        return 0;
    *ip = r.ip;
    *sp = r.sp;
    return 1;
}

// The current task's user registers as its entry into the kernel saved them (a syscall, a fault, an
// interrupt); 0 when it has none (a kernel thread). `lr`: x30 on arm64 (a leaf's return address), 0 on x86-64.
static __always_inline int user_regs(u64 *ip, u64 *sp, u64 *bp, u64 *lr) {
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
#if ARCH_ARM64
    struct user_regs_a64 r;
    if (!regs || bpf_probe_read_kernel(&r, sizeof(r), REGS_FP(regs)) != 0 || r.ip == 0)
        return 0;
    *bp = r.fp;
    *lr = r.lr;
#else
    struct user_ip_sp r;
    if (!regs || bpf_probe_read_kernel(&r, sizeof(r), REGS_IP_SP(regs)) != 0 ||
        bpf_probe_read_kernel(bp, sizeof(*bp), REGS_FP(regs)) != 0 || r.ip == 0)
        return 0;
    *lr = 0;
#endif
    *ip = r.ip;
    *sp = r.sp;
    return 1;
}

// The number of the syscall `regs` (a sys_exit's) returns from; -1 when it cannot be read.
static __always_inline long syscall_nr(struct pt_regs *regs) {
#if ARCH_ARM64
    s32 nr = -1;
    if (bpf_probe_read_kernel(&nr, sizeof(nr), &regs->syscallno) != 0)
        return -1;
    return nr;
#else
    u64 nr = 0;
    if (bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax) != 0)
        return -1;
    return (long)nr;
#endif
}

#if UNWIND
// -- User stacks by call-frame information (the design: unwind.h) ----------------------------------------
// unwind_rows: every loaded file's page index and rows (unwind.h), each file a contiguous range of words.
// Written by user space only (a range is reused only after its file's entry was cleared and a grace period
// passed).
BPF_ARRAY(unwind_rows, u32, UNWIND_ROWS);
// unwind_rules: rule id -> rule, for every file's rows; ids are handed out by user space, never taken back.
BPF_ARRAY(unwind_rules, u32, UNWIND_RULE_IDS);
// unwind_files: file id (an index handed out by user space) -> its table.
BPF_ARRAY(unwind_files, struct unwind_file, UNWIND_FILES);
// unwind_maps: every unwound process's executable mappings, each process a contiguous range.
BPF_ARRAY(unwind_maps, struct unwind_map, UNWIND_MAPS);
// unwind_procs: tgid -> its mappings. A process is unwound by tables only while it has an entry here;
// deleted by user space when it exits or execs (and re-added once it is described again).
BPF_HASH(unwind_procs, u32, struct unwind_proc, UNWIND_PROCS);
BPF_PERCPU_ARRAY(unwind_state, struct unwind_state, 1);
// unwind_wanted: file id -> 1 once a walk met the file without a table. Read and cleared by user space at
// each drain: it builds the tables of large files (agent/unwind/unwinder.py EAGER_MAX_BYTES) on demand.
BPF_ARRAY(unwind_wanted, u8, UNWIND_FILES);
// unwind_unmapped: tgid -> UNMAPPED_* once a walk met an address outside the process's known mappings (see
// unwind_flag_unmapped). Read and emptied by user space at each drain, and an entry deleted by it once it
// described that process again: it re-reads those processes' mappings, and describes again the ones that
// changed (a dlopen since). UNWIND_PROCS / 4 entries; when full, later processes wait a drain.
BPF_HASH(unwind_unmapped, u32, u8, UNWIND_PROCS / 4);
// unwind_progs[0]: unwind_step (user space puts its fd there after loading it). A tail call reaches only a
// program of its caller's type: each type that walks has its own step and array (see the top of the file).
BPF_PROG_ARRAY(unwind_progs, 1);
#if OFF_CPU
BPF_PROG_ARRAY(unwind_progs_tp, 1);    // unwind_step_tp, for sched_switch
#endif
#if OFFCPU_EXACT_NS
BPF_PROG_ARRAY(unwind_progs_raw, 1);   // unwind_step_raw, for sys_exit
#endif

// The mapping of `proc` that holds `ip`, or NULL.
static __always_inline struct unwind_map *unwind_find_map(struct unwind_proc *proc, u64 ip) {
    u32 lo = proc->first, hi = proc->first + proc->n;   // the answer is the last start <= ip, in [lo, hi)
    if (lo >= hi)
        return NULL;
#pragma clang loop unroll(disable)
    for (int i = 0; i < 16; i++) {   // up to 65,536 mappings
        if (hi - lo <= 1)
            break;
        u32 mid = lo + (hi - lo) / 2;
        struct unwind_map *m = unwind_maps.lookup(&mid);
        if (!m)
            return NULL;
        if (m->start <= ip)
            lo = mid;
        else
            hi = mid;
    }
    struct unwind_map *m = unwind_maps.lookup(&lo);
    if (!m || ip < m->start || ip >= m->end)
        return NULL;
    return m;
}

// The rule for file address `vaddr` in `file`'s table; UNWIND_KIND_NO_INFO outside it.
static __always_inline u32 unwind_find_rule(struct unwind_file *file, u64 vaddr) {
    if (vaddr > 0xffffffffULL)
        return UNWIND_KIND_NO_INFO;
    u32 page = (u32)vaddr >> UNWIND_PAGE_SHIFT;
    if (page < file->page_base || page - file->page_base >= file->pages)
        return UNWIND_KIND_NO_INFO;
    u32 at = file->first + (page - file->page_base);
    u32 *start = unwind_rows.lookup(&at);
    at++;
    u32 *end = unwind_rows.lookup(&at);
    if (!start || !end)
        return UNWIND_KIND_NO_INFO;
    u32 rows = file->first + file->pages + 1;
    u32 lo = rows + *start, hi = rows + *end;   // the page's rows; the first starts at offset 0
    if (lo >= hi)
        return UNWIND_KIND_NO_INFO;
    u32 off = (u32)vaddr & 0xffff;
#pragma clang loop unroll(disable)
    for (int i = 0; i < 16; i++) {   // up to 65,536 rows a page: one a byte
        if (hi - lo <= 1)
            break;
        u32 mid = lo + (hi - lo) / 2;
        u32 *r = unwind_rows.lookup(&mid);
        if (!r)
            return UNWIND_KIND_NO_INFO;
        if ((*r & 0xffff) <= off)
            lo = mid;
        else
            hi = mid;
    }
    u32 *r = unwind_rows.lookup(&lo);
    if (!r)
        return UNWIND_KIND_NO_INFO;
    u32 id = *r >> 16;
    u32 *rule = unwind_rules.lookup(&id);
    return rule ? *rule : UNWIND_KIND_NO_INFO;
}

// A frame by frame pointer: the saved rbp at [rbp], the return address above it (arm64's frame record is
// the same pair: x29, x30 at [x29]; x30 possibly signed). 0 when it cannot be.
static __always_inline int unwind_fp_step(struct unwind_state *s) {
    u64 bp = s->bp;
    if (bp < s->sp || bp & 7)
        return 0;
    u64 saved[2];
    if (bpf_probe_read_user(saved, sizeof(saved), (void *)bp) != 0)
        return 0;
    s->bp = saved[0];
    s->sp = bp + 16;
    s->ip = STRIP_PAC(saved[1]);
    return 1;
}

// User space re-reads the mappings of a process whose walk left them. An address the walk can vouch for
// (the leaf, or a return address read where a table said) lies in code mapped since the description (a
// dlopen, a JIT's new page): it is told at once (an event), the first time since user space last looked,
// and user space clears the flag once it described the process again, so the next new mapping is told at
// once too. An address from a frame-pointer step may be garbage (code without frame pointers): flagged for
// the drain only, which re-reads every flagged process and empties unwind_unmapped. So new code is walked
// within milliseconds, and a process whose walks keep meeting garbage costs the agent one read of its
// mappings a window.
#define UNMAPPED_AT_DRAIN 1
#define UNMAPPED_TOLD     2
static __always_inline void unwind_flag_unmapped(u32 tgid, int vouched) {
    u8 *flag = unwind_unmapped.lookup(&tgid);
    if (flag && (*flag == UNMAPPED_TOLD || !vouched))
        return;
    u8 v = vouched ? UNMAPPED_TOLD : UNMAPPED_AT_DRAIN;
    if (unwind_unmapped.update(&tgid, &v) == 0 && vouched)
        notify(tgid, EVENT_UNMAPPED);
}

// Records the current ip as a frame and unwinds one frame; sets s->done (and counts why) when the walk ends.
static __always_inline void unwind_one(struct unwind_state *s, struct unwind_proc *proc) {
    u32 n = s->frames.len;
    if (n >= UNWIND_MAX_FRAMES) {
        count_stat(STAT_UNWIND_DEPTH);
        s->done = 1;
        return;
    }
    if (s->ip == 0) {
        count_stat(STAT_UNWIND_END);
        s->done = 1;
        return;
    }
    u32 leaf = s->leaf;
    u64 lookup = leaf ? s->ip : s->ip - 1;
    struct unwind_map *m = unwind_find_map(proc, lookup);
    if (!m && !s->leaf) {   // a return address outside every known mapping: not recorded (see unwind.h)
        count_stat(s->from_jit ? STAT_UNWIND_JIT : STAT_UNWIND_NO_MAPPING);
        unwind_flag_unmapped(s->key.tgid, !s->from_fp);
        s->done = 1;
        return;
    }
    if (s->from_jit) {
        count_stat(STAT_UNWIND_JIT_FP);
        s->from_jit = 0;
    }
    // n < UNWIND_MAX_FRAMES <= MAX_DEPTH (checked above), but clang may index with an unchecked copy of
    // it: the mask bounds the register the store uses (ip[127] would land in unwind_state.guard).
    s->frames.ip[n & 127] = s->ip;
    s->frames.len = n + 1;
    s->leaf = 0;
    if (!m) {   // the leaf: where the CPU was, so recorded; its mapping is newer than the description
        count_stat(STAT_UNWIND_NO_MAPPING);
        unwind_flag_unmapped(s->key.tgid, 1);
        s->done = 1;
        return;
    }
    if (s->at_entry) {
        // A function's first instruction (an entry uprobe): nothing pushed yet, its return address is at sp
        // (in x30 on arm64). Said so, not looked up: a file without a table would be stepped by frame
        // pointer here, which skips the caller (rbp is still the caller's).
        s->at_entry = 0;
#if ARCH_ARM64
        s->ip = STRIP_PAC(s->lr);
        return;
#endif
        u64 ra = 0;
        if (bpf_probe_read_user(&ra, sizeof(ra), (void *)s->sp) != 0) {
            count_stat(STAT_UNWIND_READ_FAULT);
            s->done = 1;
            return;
        }
        s->sp += 8;
        s->ip = ra;
        return;
    }
    if (m->file == UNWIND_FILE_JIT) {
        // No table for JIT code: its frame pointer, if it keeps one, gives its caller, which the next step
        // takes only if it lies in a known mapping (else the walk ends there, counted as jit).
        if (!unwind_fp_step(s)) {
            count_stat(STAT_UNWIND_JIT);
            s->done = 1;
            return;
        }
        s->from_jit = 1;
        s->from_fp = 1;
        return;
    }
    u32 fid = m->file;
    struct unwind_file *file = unwind_files.lookup(&fid);
    u32 rule = UNWIND_KIND_NO_INFO;
    if (file && file->pages)
        rule = unwind_find_rule(file, lookup - m->bias + file->delta);
    u32 kind = rule & 7;
    if (!(file && file->pages)) {
        u8 *wanted = unwind_wanted.lookup(&fid);
        if (wanted && !*wanted)
            *wanted = 1;
    }
    if (kind == UNWIND_KIND_NO_INFO) {
        if (!unwind_fp_step(s)) {
            count_stat(file && file->pages ? STAT_UNWIND_FP_FAILED : STAT_UNWIND_NO_TABLE);
            s->done = 1;
            return;
        }
        count_stat(STAT_UNWIND_FP_FRAMES);
        s->from_fp = 1;
        return;
    }
    if (kind == UNWIND_KIND_END) {
        count_stat(STAT_UNWIND_END);
        s->done = 1;
        return;
    }
    if (kind == UNWIND_KIND_SIGNAL) {
        count_stat(STAT_UNWIND_SIGNAL);
        s->done = 1;
        return;
    }
    if (kind != UNWIND_KIND_CFA_RSP && kind != UNWIND_KIND_CFA_RBP) {
        count_stat(STAT_UNWIND_UNSUPPORTED);
        s->done = 1;
        return;
    }
#if ARCH_ARM64
    // arm64's layout (agent/unwind/table.py): CFA = sp or x29 + 8 * off; x30 and x29 saved at their slots,
    // counted down from the CFA or up from its register; x30's slot 0: the return address is still in x30.
    u64 base = kind == UNWIND_KIND_CFA_RSP ? s->sp : s->bp;
    u64 cfa = base + ((rule >> 3) & 0xfff) * 8;
    u32 from_reg = rule & (1 << 15);
    u32 ra_v = (rule >> 16) & 0xff;
    u32 fp_v = rule >> 24;
    u64 ra = 0;
    if (ra_v == 0) {
        if (!leaf) {   // only the interrupted frame can still hold its return address in x30
            count_stat(STAT_UNWIND_UNSUPPORTED);
            s->done = 1;
            return;
        }
        ra = s->lr;
    } else if (bpf_probe_read_user(&ra, sizeof(ra),
                                   (void *)(from_reg ? base + (ra_v - 1) * 8 : cfa - ra_v * 8)) != 0) {
        count_stat(STAT_UNWIND_READ_FAULT);
        s->done = 1;
        return;
    }
    if (fp_v != 0) {
        u64 bp = 0;
        if (bpf_probe_read_user(&bp, sizeof(bp), (void *)(from_reg ? base + (fp_v - 1) * 8 : cfa - fp_v * 8)) !=
            0) {
            count_stat(STAT_UNWIND_READ_FAULT);
            s->done = 1;
            return;
        }
        s->bp = bp;
    }
    // A caller's frame lies at or above its callee's (a leaf that allocated no stack: CFA = sp, the return
    // address in x30); anything else is a bad table or stack.
    if (cfa < s->sp || (cfa == s->sp && ra_v != 0)) {
        count_stat(STAT_UNWIND_READ_FAULT);
        s->done = 1;
        return;
    }
    s->sp = cfa;
    s->ip = STRIP_PAC(ra);
    s->from_fp = 0;
#else
    u64 cfa = (kind == UNWIND_KIND_CFA_RSP ? s->sp : s->bp) + ((rule >> 3) & 0x1ffff);
    s32 rbp_slot = ((s32)rule) >> 20;   // arithmetic shift: signed 12 bits
    u64 ra = 0;
    if (bpf_probe_read_user(&ra, sizeof(ra), (void *)(cfa - 8)) != 0) {
        count_stat(STAT_UNWIND_READ_FAULT);
        s->done = 1;
        return;
    }
    if (rbp_slot != 0) {
        u64 bp = 0;
        if (bpf_probe_read_user(&bp, sizeof(bp), (void *)(cfa + (s64)rbp_slot * 8)) != 0) {
            count_stat(STAT_UNWIND_READ_FAULT);
            s->done = 1;
            return;
        }
        s->bp = bp;
    }
    if (cfa <= s->sp) {   // a caller's frame lies above its callee's: anything else is a bad table or stack
        count_stat(STAT_UNWIND_READ_FAULT);
        s->done = 1;
        return;
    }
    s->sp = cfa;
    s->ip = ra;
    s->from_fp = 0;
#endif
}

// One step program's share of a walk: UNWIND_FRAMES_PER_PROG frames; 1 when the walk should go on in a tail
// call of the step again.
static __always_inline int unwind_more(struct unwind_state *s) {
    u32 tgid = s->key.tgid;
    struct unwind_proc *proc = unwind_procs.lookup(&tgid);
    if (!proc) {   // forgotten meanwhile: what was walked stands
        s->done = 1;
    } else {
        // Not unrolled: clang would hoist the helpers' addresses out of many copies into registers, and
        // an indirect call is no BPF instruction ("unknown opcode 8d").
#pragma clang loop unroll(disable)
        for (int i = 0; i < UNWIND_FRAMES_PER_PROG; i++) {
            if (!s->done)
                unwind_one(s, proc);
        }
    }
    if (!s->done && s->calls < 32) {
        s->calls++;
        return 1;
    }
    return 0;
}

// After a step: a walk not done here ran out of tail calls (or the call failed); it ends with what it has.
static __always_inline void unwind_end(struct unwind_state *s) {
    if (!s->done)
        count_stat(STAT_UNWIND_DEPTH);
    walk_finish(s);
}

// Starts a table walk of the current task's user stack for a CPU sample (the key filled but for user_stack)
// and does not return when it could; returns when the sample must be unwound by frame pointer instead.
static __always_inline void unwind_begin(struct bpf_perf_event_data *ctx, u32 set, struct sample_key *key) {
    if (!unwind_procs.lookup(&key->tgid))
        return;
    u32 zero = 0;
    struct unwind_state *s = unwind_state.lookup(&zero);
    if (!s)
        return;
    u64 ip, sp, bp, lr;
#if ARCH_ARM64
    if ((ctx->regs.pstate & 0xf) == 0) {   // PSR_MODE_EL0t: the sample interrupted user mode
        ip = ctx->regs.pc;
        sp = ctx->regs.sp;
        bp = ctx->regs.regs[29];
        lr = ctx->regs.regs[30];
    }
#else
    if (ctx->regs.cs & 3) {   // the sample interrupted user mode: its registers are the user's
        ip = ctx->regs.ip;
        sp = ctx->regs.sp;
        bp = ctx->regs.bp;
        lr = 0;
    }
#endif
    else if (!user_regs(&ip, &sp, &bp, &lr)) {   // in the kernel: the user registers saved at its entry
        count_stat(STAT_UNWIND_FALLBACK);   // a kernel thread, or no user context
        return;
    }
    walk_init(s, key, set, WALK_SAMPLE, ip, sp, bp, lr, 0);
    count_stat(STAT_UNWIND_WALKS);
    unwind_progs.call(ctx, 0);
    count_stat(STAT_UNWIND_FALLBACK);   // the tail call failed: not loaded yet
}

// Tail-called from on_cpu_sample, then from itself: unwinds UNWIND_FRAMES_PER_PROG frames a call, and
// does what the walk was for once it ended.
int unwind_step(struct bpf_perf_event_data *ctx) {
    u32 zero = 0;
    struct unwind_state *s = unwind_state.lookup(&zero);
    if (!s)
        return 0;
    if (unwind_more(s))
        unwind_progs.call(ctx, 0);
    unwind_end(s);
    return 0;
}

#if OFF_CPU
// The same for a sampled switch-out (sched_switch: a tracepoint program; per-CPU state, as the sampler's).
int unwind_step_tp(void *ctx) {
    u32 zero = 0;
    struct unwind_state *s = unwind_state.lookup(&zero);
    if (!s)
        return 0;
    if (unwind_more(s))
        unwind_progs_tp.call(ctx, 0);
    unwind_end(s);
    return 0;
}
#endif

#if OFFCPU_EXACT_NS
// The same for a long wait's stack at its syscall's return (sys_exit: a raw tracepoint; the task's state).
int unwind_step_raw(struct bpf_raw_tracepoint_args *ctx) {
    struct task_walk *w = task_walks.task_storage_get(bpf_get_current_task_btf(), 0, 0);
    if (!w)
        return 0;
    if (unwind_more(&w->walk))
        unwind_progs_raw.call(ctx, 0);
    unwind_end(&w->walk);
    return 0;
}
#endif
#endif

int on_cpu_sample(struct bpf_perf_event_data *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    u32 tid = (u32)pid_tgid;

    if (tid == 0 && !INCLUDE_IDLE) {   // the per-CPU idle task (swapper)
        count_stat(STAT_IDLE_SKIPPED);
        return 0;
    }
    if (!in_scope())   // outside --cgroup: not sampled, so never described, walked or announced
        return 0;
    count_stat(STAT_SAMPLES);

    u32 zero = 0;
    u32 *active = control.lookup(&zero);
    struct stack_trace *st = scratch.lookup(&zero);
    if (!active || !st)
        return 0;

    struct sample_key key = {};
    key.tgid = tgid;
    key.tid = tid;
    key.cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&key.comm, sizeof(key.comm));

    u32 set = *active;
#if PYTHON_STACKS
    struct py_proc *py = python_procs.lookup(&tgid);
    struct py_stack *pst = python_scratch.lookup(&zero);
    if (py && pst)
        key.python_stack = python_stack(set, pid_tgid, py, 1, pst);
#endif
    key.gpu_slot = gpu_slot_at(tgid, bpf_ktime_get_ns());
#if UNWIND
    take_kernel_stack(ctx, set, &key, st, 1);
    unwind_begin(ctx, set, &key);   // returns only if the user stack is to be walked by frame pointer
    take_user_stack(ctx, set, &key, st, 1);
#else
    take_stacks(ctx, set, &key, st, 1);
#endif
    count_sample(set, &key);
    note_process(tgid);
    return 0;
}

#if OFF_CPU
// -- Off-CPU time -----------------------------------------------------------------------------------------
// sched_switch fires on every context switch of the node, so the common path is one per-CPU counter, one
// per-CPU timestamp (switched_in), one hash lookup (is the incoming task's switch-out pending?) and one
// random draw. Only a switch-out sampled with probability 1/OFFCPU_SAMPLE_EVERY takes stacks (the
// expensive part, ~as much as a CPU sample); when that task runs again, its wait is recorded scaled by
// OFFCPU_SAMPLE_EVERY: an unbiased estimate of the total, whose noise user space can state ((N - 1) x the
// sum of squared waits). The run that ended in the sampled switch-out is recorded beside it (scaled
// alike): user space tells idle threads from working ones by the two (agent/offcpu.py).
//
// Runnable waits count: a task switched out while runnable (prev_state R, or R+ when preempted in the
// kernel) waits for a CPU, and a wall-clock profile must show that time too, or a thread throttled by its
// cgroup's CPU limit or starved on a busy node looks idle. Its kernel stack says it was preempted
// (the return-to-user or IRQ-exit path into schedule), and STAT_OFFCPU_RUNNABLE counts how many were.
// OFFCPU_RUNNABLE=0 leaves them out (blocked time only, as offcputime-bpfcc's --state 1 or 2 would).
//
// GPU slot: taken at wake-up, not at switch-out. The wait is recorded into the window being written at
// wake-up, so the slot always lies in the window the row ships with and within the GPU timeline's
// horizon; a switch-out slot of a long wait would name a time whose GPU state the agent may already have
// forgotten. It also costs a gpu_procs lookup only per recorded wait, not per sampled switch-out.

// prev_state as the tracepoint reports it (kernel/sched: __trace_sched_switch_state; the format file's
// print fmt): bit i set = state "SDTtXZPI"[i]; 0 = runnable (R); TASK_REPORT_MAX (0x100) = preempted (R+).
#define TASK_REPORT_STATES  0xff
#define TASK_REPORT_DEAD    (0x10 | 0x20)   // X (EXIT_DEAD), Z (EXIT_ZOMBIE): the task's last switch-out

// A wait that crossed a flip is recorded in the current set, but its stacks went into the other one. Copy
// each body over while that set still holds it: user space reads the pending switch-outs (offcpu_starts)
// after the flip's grace and before it drains, so a wait that ends after that read is one it has seen
// and carries the bodies of itself (agent/offcpu.py StackCarry); one that ended before it finds them
// here, not yet drained. Returns the id the wait keeps: STACK_LOST when the copy could not be stored (the
// map full, or busy in the moment), so the row says its stack was lost instead of naming a body that
// no drain holds.
static __always_inline u64 carry_stack(u32 set, u64 id) {
    if (id < STACK_RESERVED)
        return id;
    struct stack_trace *old;
    int err;
    if (set == 0) {
        if (stacks0.lookup(&id))
            return id;
        old = stacks1.lookup(&id);
        if (!old)
            return id;   // drained already: user space carries it
        err = stacks0.update(&id, old);
    } else {
        if (stacks1.lookup(&id))
            return id;
        old = stacks0.lookup(&id);
        if (!old)
            return id;
        err = stacks1.update(&id, old);
    }
    if (err == 0 || err == -EEXIST) {
        count_stat(STAT_OFFCPU_CARRIED);
        return id;
    }
    count_stat(err == -E2BIG ? STAT_STACK_TABLE_FULL : STAT_STACK_INSERT_FAILED);
    return STACK_LOST;
}

static __always_inline u64 carry_python_stack(u32 set, u64 id) {
    if (id < STACK_RESERVED)
        return id;
    struct py_stack *old;
    int err;
    if (set == 0) {
        if (python_stacks0.lookup(&id))
            return id;
        old = python_stacks1.lookup(&id);
        if (!old)
            return id;
        err = python_stacks0.update(&id, old);
    } else {
        if (python_stacks1.lookup(&id))
            return id;
        old = python_stacks0.lookup(&id);
        if (!old)
            return id;
        err = python_stacks1.update(&id, old);
    }
    if (err == 0 || err == -EEXIST) {
        count_stat(STAT_OFFCPU_CARRIED);
        return id;
    }
    count_stat(STAT_PY_STACK_TABLE_FULL);
    return STACK_LOST;
}

// `tid` runs again: record its wait if its switch-out was sampled. A wait at or above OFFCPU_EXACT_NS counts
// once at its own length; shorter ones count OFFCPU_SAMPLE_EVERY times theirs (they stand for the unsampled).
static __always_inline void offcpu_wake(u32 tid, u32 set) {
    struct offcpu_start *s = offcpu_starts.lookup(&tid);
    if (!s)
        return;
    u64 now = bpf_ktime_get_ns();
    struct sample_key key = s->key;   // copied out before the delete lets another CPU reuse the entry
    u64 start = s->ns;
    u64 ran = s->ran_ns;
    u32 from = s->set;
    offcpu_starts.delete(&tid);
    u64 waited = now > start ? now - start : 0;
    if (waited < OFFCPU_MIN_BLOCK_NS) {
        count_stat(STAT_OFFCPU_BELOW_MIN);
        return;
    }
    if (from != set) {
        key.user_stack = carry_stack(set, key.user_stack);
        key.kernel_stack = carry_stack(set, key.kernel_stack);
        key.python_stack = carry_python_stack(set, key.python_stack);
    }
    key.gpu_slot = gpu_slot_at(key.tgid, now);   // the wake-up's slot (see the top of this section)
    u64 weight = OFFCPU_SAMPLE_EVERY;
#if OFFCPU_EXACT_NS
    if (waited >= OFFCPU_EXACT_NS) {
        weight = 1;
        count_stat(STAT_OFFCPU_EXACT);
    }
#endif
    add_offcpu(set, &key, waited * weight, ran * weight);
}

// The current task (tid == pid, tgid) as an off-CPU row's key, its stacks not taken yet.
static __always_inline void offcpu_key(struct sample_key *key, u64 pid_tgid) {
    key->tgid = pid_tgid >> 32;
    key->tid = (u32)pid_tgid;
    key->cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&key->comm, sizeof(key->comm));
}

#if OFFCPU_EXACT_NS
// A long wait of the current task that was not sampled and whose stack cannot be taken any more (it did not
// end in a return to the user context it left: preempted or faulted in user code, and it ran since): recorded
// at its length, under a stack that says so (STACK_UNTAKEN), woken at `woke`.
static __always_inline void offcpu_untaken(u32 set, u64 waited, u64 ran, u64 woke) {
    struct sample_key key = {};
    offcpu_key(&key, bpf_get_current_pid_tgid());
    key.user_stack = STACK_UNTAKEN;
    key.gpu_slot = gpu_slot_at(key.tgid, woke);
    count_stat(STAT_OFFCPU_EXACT);
    count_stat(STAT_OFFCPU_EXACT_UNTAKEN);
    add_offcpu(set, &key, waited, ran);
}

// Every switch-out (of a task that will run again): keep when it left, so that a wait found long at its end
// is recorded however it was sampled. Its previous wait, if long, unsampled and not recorded at a syscall
// return, is carried on while the task is still in the same kernel entry (the same saved user context: the
// syscall blocked again, or was preempted on its way out), else recorded now (its stack is gone). `since`:
// when it was switched in last.
static __always_inline void offcpu_exact_out(u32 set, u32 sampled, u64 since) {
    struct offcpu_task *t = offcpu_tasks.task_storage_get(bpf_get_current_task_btf(), 0,
                                                          BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!t) {
        count_stat(STAT_TASK_STORAGE_FAILED);
        return;
    }
    u64 now = bpf_ktime_get_ns();
    u64 ip = 0, sp = 0;
    int regs = user_ip_sp(&ip, &sp);
    if (t->out_ns && !t->sampled && since > t->out_ns) {
        u64 waited = since - t->out_ns;
        if (waited >= OFFCPU_EXACT_NS && waited >= OFFCPU_MIN_BLOCK_NS) {
            t->pend_ns += waited;
            t->pend_ran += t->ran_ns;
        }
    }
    if (t->pend_ns && !(regs && ip == t->user_ip && sp == t->user_sp)) {
        offcpu_untaken(set, t->pend_ns, t->pend_ran, since);
        t->pend_ns = t->pend_ran = 0;
    }
    t->out_ns = now;
    t->ran_ns = run_ending(since, now);
    t->sampled = sampled;
    if (t->pend_ns)
        return;   // the context the pending wait left with is kept (it is this one)
    if (!sampled && regs) {
        t->user_ip = ip;
        t->user_sp = sp;
    } else {
        t->user_ip = t->user_sp = 0;
    }
}
#endif

// `tid` (the current task) leaves the CPU in `state`, having run since `since`: sample it, take its
// stacks, keep the start.
static __always_inline void offcpu_leave(void *ctx, u32 tid, long state, u32 set, u64 since) {
    if (state & TASK_REPORT_DEAD)
        return;   // it never runs again: a start kept now would only wait for sched_process_exit or the LRU
    u32 runnable = (state & TASK_REPORT_STATES) == 0;
#if !OFFCPU_RUNNABLE
    if (runnable)
        return;
#endif
    u32 sampled = 1;
#if OFFCPU_SAMPLE_EVERY > 1
    sampled = bpf_get_prandom_u32() % OFFCPU_SAMPLE_EVERY == 0;
#endif
#if OFFCPU_EXACT_NS
    offcpu_exact_out(set, sampled, since);
#endif
    if (!sampled)
        return;
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if ((u32)pid_tgid != tid)
        return;   // not expected: the tracepoint fires in prev's context
    count_stat(STAT_OFFCPU_SAMPLED);
    if (runnable)
        count_stat(STAT_OFFCPU_RUNNABLE);
    u32 zero = 0;
    // The CPU sampler's scratch buffers: both programs run with bpf_prog_active held on this CPU, and
    // sched_switch with interrupts off, so neither can interrupt the other mid-use.
    struct stack_trace *st = scratch.lookup(&zero);
    if (!st)
        return;
    struct sample_key key = {};
    u32 tgid = pid_tgid >> 32;
    offcpu_key(&key, pid_tgid);
    take_kernel_stack(ctx, set, &key, st, 0);
#if PYTHON_STACKS
    struct py_proc *py = python_procs.lookup(&tgid);
    struct py_stack *pst = python_scratch.lookup(&zero);
    if (py && pst)
        key.python_stack = python_stack(set, pid_tgid, py, 0, pst);
#endif
#if UNWIND
    // The user stack by the tables, as a CPU sample's (tail calls of unwind_step_tp, which keep the start
    // once the walk ends); by frame pointer where the process has none or the walk cannot start.
    u64 ip, sp, bp, lr;
    struct unwind_state *s = unwind_state.lookup(&zero);
    if (s && unwind_procs.lookup(&tgid) && user_regs(&ip, &sp, &bp, &lr)) {
        walk_init(s, &key, set, WALK_OFFCPU, ip, sp, bp, lr, 0);
        s->arg[0] = since;
        s->arg[1] = runnable;
        count_stat(STAT_UNWIND_WALKS);   // every walk counts, whatever started it: the ends add up to these
        unwind_progs_tp.call(ctx, 0);
        count_stat(STAT_UNWIND_FALLBACK);   // the tail call failed: not loaded yet
    }
#endif
    take_user_stack(ctx, set, &key, st, 0);
    offcpu_keep(set, &key, since, runnable);
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u32 zero = 0;
    u32 *active = control.lookup(&zero);
    if (!active)
        return 0;
    u32 set = *active;
    u64 *in = switched_in.lookup(&zero);
    if (!in)
        return 0;
    u64 since = *in;   // when prev started running on this CPU
    *in = bpf_ktime_get_ns();
    u32 next = args->next_pid;
    if (next != 0)   // the idle task (pid 0, one per CPU) is never recorded
        offcpu_wake(next, set);
    u32 prev = args->prev_pid;
    if (prev != 0 && in_scope()) {   // current is still prev here: a wait starts only inside --cgroup
        count_stat(STAT_OFFCPU_SWITCHES);
        offcpu_leave(args, prev, args->prev_state, set, since);
    }
    return 0;
}

#if OFFCPU_EXACT_NS
// A syscall returns: if the task waited in it long enough, unsampled, record the wait now, at its length,
// with the user stack it waited with (unchanged: it has not been back in user code since) walked by the
// tables, and its Python frames. The kernel stack of the wait is gone; the syscall's number stands for it
// (STACK_SYSCALL + nr). Every syscall of the node runs this: the common path is one task-storage lookup.
RAW_TRACEPOINT_PROBE(sys_exit) {
    struct task_struct *task = bpf_get_current_task_btf();
    struct offcpu_task *t = offcpu_tasks.task_storage_get(task, 0, 0);
    if (!t || !(t->out_ns || t->pend_ns))
        return 0;
    u64 out = t->sampled ? 0 : t->out_ns;   // a sampled one is recorded at its wake-up
    u64 waited = t->pend_ns, ran = t->pend_ran;
    t->out_ns = t->pend_ns = t->pend_ran = 0;
    u32 zero = 0;
    u64 *in = switched_in.lookup(&zero);
    u32 *active = control.lookup(&zero);
    if (!in || !active)
        return 0;
    u64 woke = *in;   // the task runs: this CPU's last switch-in was its own
    if (out && woke > out && woke - out >= OFFCPU_EXACT_NS && woke - out >= OFFCPU_MIN_BLOCK_NS) {
        waited += woke - out;
        ran += t->ran_ns;
    }
    if (!waited)
        return 0;
    u32 set = *active;
    u64 ip, sp, bp, lr;
    if (!user_regs(&ip, &sp, &bp, &lr) || ip != t->user_ip || sp != t->user_sp) {
        offcpu_untaken(set, waited, ran, woke);   // the wait did not end here: another context
        return 0;
    }
    struct task_walk *w = task_walks.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!w) {
        count_stat(STAT_TASK_STORAGE_FAILED);
        offcpu_untaken(set, waited, ran, woke);
        return 0;
    }
    u64 pid_tgid = bpf_get_current_pid_tgid();
    struct sample_key key = {};
    offcpu_key(&key, pid_tgid);
    long nr = syscall_nr((struct pt_regs *)ctx->args[0]);
    if (nr >= 0 && nr < STACK_SYSCALL)
        key.kernel_stack = STACK_SYSCALL + nr;
    key.gpu_slot = gpu_slot_at(key.tgid, woke);
#if PYTHON_STACKS
    u32 tgid = key.tgid;
    struct py_proc *py = python_procs.lookup(&tgid);
    if (py)
        key.python_stack = python_stack(set, pid_tgid, py, 0, &w->py);
#endif
    count_stat(STAT_OFFCPU_EXACT_WALKS);
    walk_init(&w->walk, &key, set, WALK_LONG_WAIT, ip, sp, bp, lr, 0);
    w->walk.arg[0] = waited;
    w->walk.arg[1] = ran;
#if UNWIND
    if (unwind_procs.lookup(&key.tgid)) {
        count_stat(STAT_UNWIND_WALKS);
        unwind_progs_raw.call(ctx, 0);
        count_stat(STAT_UNWIND_FALLBACK);
    }
#endif
    int n = bpf_get_stack(ctx, w->walk.frames.ip, sizeof(w->walk.frames.ip), BPF_F_USER_STACK);
    w->walk.frames.len = n > 0 ? n / sizeof(u64) : 0;
    walk_finish(&w->walk);
    return 0;
}
#endif
#endif

// Both hooks are process-lifetime events (not per syscall), and they only speak about processes the
// sampler has seen (plus, with OFF_CPU, one map delete per exiting thread), so their cost is bounded.
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    python_procs.delete(&tgid);   // the new image is described (and detected) again
#if UNWIND
    unwind_procs.delete(&tgid);   // its mappings are gone: walked by frame pointer until described again
#endif
    if (seen.lookup(&tgid)) {
        seen.delete(&tgid);
        notify(tgid, EVENT_EXEC);
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
#if OFF_CPU
    // Fires for every exiting thread. Its pending switch-out, if any (normally none: the switch-in that
    // brought it here consumed it), goes with it, before a new thread can reuse the tid.
    u32 tid = (u32)pid_tgid;
    offcpu_starts.delete(&tid);
#endif
    if ((u32)pid_tgid != tgid)   // a thread, not the whole process
        return 0;
    python_procs.delete(&tgid);
#if UNWIND
    unwind_procs.delete(&tgid);   // before the pid can be reused (user space frees its range later)
#endif
    if (seen.lookup(&tgid)) {
        seen.delete(&tgid);
        notify(tgid, EVENT_EXIT);
    }
    return 0;
}
