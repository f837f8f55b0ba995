// CUDA uprobes (issue 28 part 1): kernel launches with their CPU stacks and the latency of the CUDA calls in
// which the CPU waits for the GPU or the allocator. Included by cpu_sampler.c at its end when CUDA is 1 (it
// shares the map sets, the stack tables and the user-stack walk); the programs are attached by
// agent/gpu/cuda_probes.py to libcudart.so.*, libcuda.so.1 and libnccl.so.2 in the processes that map them.
// agent/sampler.py defines CUDA_LAUNCH_SAMPLE_EVERY, CUDA_LAUNCHES_SIZE, CUDA_CALLS_SIZE, CUDA_CALL_IDS,
// CUDA_HIST, CUDA_NAME_LEN and CUDA_PROCS_SIZE, and mirrors every struct here with ctypes.
//
// Rules this file keeps:
//  * Arguments and return values are read with BCC's PT_REGS_PARMn / PT_REGS_RC, the return address at an
//    entry by architecture (x86-64: at sp; arm64: the link register): nothing else of pt_regs is assumed.
//  * A launch is counted once. NVIDIA's runtime launches through the driver (cudaLaunchKernel calls
//    cuLaunchKernel): a driver launch whose return address lies in the process's libcudart text
//    (cuda_runtimes, written by user space) is the runtime's own and is not counted again.
//  * Every launch is counted exactly in a per-CPU counter (STAT_CUDA_LAUNCHES); one in
//    CUDA_LAUNCH_SAMPLE_EVERY, at random, takes its stacks and adds 1 to its row (user space scales it).
//  * Timed calls nest (cudaMemcpy calls cuMemcpyHtoD): each thread keeps its open calls in a small stack;
//    uretprobes return in LIFO order per thread, so a return always closes the innermost open call.
//  * A uprobe program can be preempted (cpu_sampler.c): every walk uses the task's own state (task_walks).

#define CUDA_API_RUNTIME 1   // handle: the host stub's address (nvcc's __global__ host function)
#define CUDA_API_DRIVER  2   // handle: the CUfunction (or a CUkernel, which the driver takes in its place)
#define CUDA_API_GRAPH   3   // handle: the CUgraphExec / cudaGraphExec_t
#define CUDA_API_MARKER  4   // our CUPTI library's fleetprof_cupti_launch(correlation id, weight): a launch it
                             // sampled already; handle: weight << 32 | correlation id. Not counted as a launch
                             // (the launch probes count it), its stack joins CUPTI's kernel records

// What a launch row is keyed by: the launching thread's sample key (its stacks) and the kernel.
struct cuda_launch_key {
    struct sample_key key;   // kernel_stack is STACK_NONE: a launch is all user code
    u64 handle;
    u32 api;                 // CUDA_API_*
    u32 pad;
};

// cuda_launches{0,1}: cuda_launch_key -> sampled launches in this window. Written by cuda_walk_done, drained
// and emptied by user space with counts{0,1} of the same set.
BPF_HASH(cuda_launches0, struct cuda_launch_key, u64, CUDA_LAUNCHES_SIZE);
BPF_HASH(cuda_launches1, struct cuda_launch_key, u64, CUDA_LAUNCHES_SIZE);

// One process's calls of one timed function (id: agent/gpu/cuda_probes.py CALLS).
struct cuda_call_key {
    u32 tgid;
    u32 call;
};
struct cuda_call_value {
    u64 count;
    u64 ns;
    u64 hist[CUDA_HIST];     // [2^i, 2^(i+1)) ns; the last bucket is open-ended
};
// cuda_calls{0,1}: cuda_call_key -> the calls that returned in this window. Written at each return, drained
// and emptied by user space with the other maps of the same set.
BPF_HASH(cuda_calls0, struct cuda_call_key, struct cuda_call_value, CUDA_CALLS_SIZE);
BPF_HASH(cuda_calls1, struct cuda_call_key, struct cuda_call_value, CUDA_CALLS_SIZE);

// A thread's open timed calls, outermost first (depth counts past 4 so that returns stay paired).
#define CUDA_OPEN_MAX 4
struct cuda_open_calls {
    u32 depth;
    u32 call[CUDA_OPEN_MAX];
    u32 pad;
    u64 start[CUDA_OPEN_MAX];
};
// cuda_open: tid -> its open calls. Created at a thread's first timed call, never emptied (a thread's entry
// is reused); LRU-bounded for threads that are gone.
BPF_TABLE("lru_hash", u32, struct cuda_open_calls, cuda_open, CUDA_PROCS_SIZE * 4);

// cuModuleGetFunction(CUfunction *out, CUmodule, const char *name) and cuLibraryGetKernel(CUkernel *out,
// CUlibrary, const char *name) between entry and return: tid -> (out, name).
struct cuda_name_args {
    u64 out;
    u64 name;
};
BPF_TABLE("lru_hash", u32, struct cuda_name_args, cuda_name_args, CUDA_PROCS_SIZE);

struct cuda_function_key {
    u32 tgid;
    u32 pad;
    u64 handle;
};
struct cuda_function_name {
    char name[CUDA_NAME_LEN];
};
// cuda_functions: (tgid, CUfunction or CUkernel) -> the kernel's name, learnt at the return of a successful
// cuModuleGetFunction / cuLibraryGetKernel. Read and the entries read deleted by user space at each drain
// (it keeps the names per process). LRU: names not read in time are lost, and the kernel is shown unnamed.
BPF_TABLE("lru_hash", struct cuda_function_key, struct cuda_function_name, cuda_functions, CUDA_PROCS_SIZE * 16);

// The executable ranges of a process's libcudart (up to 4 copies). Written by user space when it attaches
// to the process's runtime, deleted when it forgets the process.
struct cuda_runtime_text {
    u64 start[4];
    u64 end[4];
};
BPF_HASH(cuda_runtimes, u32, struct cuda_runtime_text, CUDA_PROCS_SIZE);


// The return address of the function the current uprobe entered (its first instruction).
static __always_inline u64 entry_return_address(struct pt_regs *ctx) {
#if ARCH_ARM64
    return ctx->regs[30];   // the link register
#else
    u64 ra = 0;
    bpf_probe_read_user(&ra, sizeof(ra), (void *)PT_REGS_SP(ctx));
    return ra;
#endif
}

static __always_inline void cuda_walk_done(u32 set, struct sample_key *key, u64 *arg) {
    struct cuda_launch_key k = {};
    k.key = *key;
    k.handle = arg[0];
    k.api = (u32)arg[1];
    u64 zero = 0, *c;
    if (set == 0)
        c = cuda_launches0.lookup_or_try_init(&k, &zero);
    else
        c = cuda_launches1.lookup_or_try_init(&k, &zero);
    if (c)
        __sync_fetch_and_add(c, 1);
    else
        count_stat(STAT_CUDA_TABLE_FULL);
}

// The walk in `s` (a launch's) ended: store its frames and count the launch under them.
static __always_inline void cuda_walk_finish(struct unwind_state *s) {
    struct sample_key key = s->key;
    if (s->frames.len > 0)
        key.user_stack = store_stack(s->set, &s->frames, USER_STACK_SEED);
    cuda_walk_done(s->set, &key, s->arg);
}

#if UNWIND
BPF_PROG_ARRAY(unwind_progs_kp, 1);   // unwind_step_kp, for the uprobes

// The table walk for the uprobes (kprobe programs; the task's own state).
int unwind_step_kp(struct pt_regs *ctx) {
    struct task_walk *w = task_walks.task_storage_get(bpf_get_current_task_btf(), 0, 0);
    if (!w)
        return 0;
    if (unwind_more(&w->walk))
        unwind_progs_kp.call(ctx, 0);
    if (!w->walk.done)
        count_stat(STAT_UNWIND_DEPTH);
    cuda_walk_finish(&w->walk);
    return 0;
}
#endif

// cuda_walk_progs[0]: cuda_launch_walk (user space puts its fd there after loading it). Every launch probe
// tail-calls the one walk program, so its code (the launch's Python and native walks, the heaviest here) is
// compiled and verified once, not once per probe: seven inlined copies made the CUDA probes most of the
// agent's BCC compile (bench/bpf_compile.py).
BPF_PROG_ARRAY(cuda_walk_progs, 1);

// A launch of `handle` through `api` in the current thread: count it; if sampled, hand it to
// cuda_launch_walk (its stacks), in the task's own storage.
static __always_inline int cuda_launch(struct pt_regs *ctx, u32 api, u64 handle, int driver) {
    if (!in_scope())   // outside --cgroup
        return 0;
    if (api == CUDA_API_MARKER)
        goto walk;
    if (driver) {
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        u64 ra = entry_return_address(ctx);
        struct cuda_runtime_text *rt = cuda_runtimes.lookup(&tgid);
        if (rt) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (ra >= rt->start[i] && ra < rt->end[i]) {
                    count_stat(STAT_CUDA_NESTED);
                    return 0;
                }
            }
        }
    }
    count_stat(STAT_CUDA_LAUNCHES);
#if CUDA_LAUNCH_SAMPLE_EVERY > 1
    if (bpf_get_prandom_u32() % CUDA_LAUNCH_SAMPLE_EVERY)
        return 0;
#endif
walk:;
    struct task_walk *w = task_walks.task_storage_get(bpf_get_current_task_btf(), 0,
                                                      BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!w) {
        count_stat(STAT_TASK_STORAGE_FAILED);
        return 0;
    }
    w->walk.arg[0] = handle;
    w->walk.arg[1] = api;
    cuda_walk_progs.call(ctx, 0);
    return 0;   // the tail call failed: the launch counted, its stacks not taken (not counted as sampled)
}

// A sampled launch's stacks (tail-called by the launch probes, with the handle and api in the task's walk
// state): the Python stack, then the user stack by the tables (unwind_step_kp) or by frame pointer.
int cuda_launch_walk(struct pt_regs *ctx) {
    struct task_walk *w = task_walks.task_storage_get(bpf_get_current_task_btf(), 0, 0);
    if (!w)
        return 0;
    u64 handle = w->walk.arg[0];
    u32 api = (u32)w->walk.arg[1];
    if (api != CUDA_API_MARKER)
        count_stat(STAT_CUDA_SAMPLED);
    u32 zero = 0;
    u32 *active = control.lookup(&zero);
    if (!active)
        return 0;
    u32 set = *active;
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    u64 ra = entry_return_address(ctx);
    struct sample_key key = {};
    key.tgid = tgid;
    key.tid = (u32)pid_tgid;
    key.cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&key.comm, sizeof(key.comm));
    key.gpu_slot = gpu_slot_at(tgid, bpf_ktime_get_ns());
#if PYTHON_STACKS
    struct py_proc *py = python_procs.lookup(&tgid);
    if (py)
        key.python_stack = python_stack(set, pid_tgid, py, 0, &w->py);
#endif
    u64 ip = PT_REGS_IP(ctx), sp = PT_REGS_SP(ctx), bp = PT_REGS_FP(ctx);
#if ARCH_ARM64
    u64 lr = ra;   // x30, the caller, at a function's first instruction (the walk's at_entry)
#else
    u64 lr = 0;
#endif
    walk_init(&w->walk, &key, set, WALK_CUDA, ip, sp, bp, lr, 1);
    w->walk.arg[0] = handle;
    w->walk.arg[1] = api;
#if UNWIND
    if (unwind_procs.lookup(&tgid)) {
        count_stat(STAT_UNWIND_WALKS);
        unwind_progs_kp.call(ctx, 0);
        count_stat(STAT_UNWIND_FALLBACK);   // the tail call failed
        walk_init(&w->walk, &key, set, WALK_CUDA, ip, sp, bp, lr, 0);
        w->walk.arg[0] = handle;
        w->walk.arg[1] = api;
    }
#endif
    // By frame pointer. At a function's entry the caller's frame record is the caller's caller's: kernels
    // since 6.11 put the return address in themselves (a uprobe at an entry), older ones skip the caller,
    // and it is put in by hand, walking again one slot further on.
    int n = bpf_get_stack(ctx, w->walk.frames.ip, sizeof(w->walk.frames.ip), BPF_F_USER_STACK);
    w->walk.frames.len = n > 0 ? n / sizeof(u64) : 0;
    if (w->walk.frames.len < 2 || w->walk.frames.ip[1] != ra) {
        n = bpf_get_stack(ctx, &w->walk.frames.ip[1], sizeof(w->walk.frames.ip) - sizeof(u64), BPF_F_USER_STACK);
        w->walk.frames.ip[0] = ip;
        w->walk.frames.ip[1] = ra;
        w->walk.frames.len = n >= (int)(2 * sizeof(u64)) ? n / sizeof(u64) + 1 : 2;
    }
    cuda_walk_finish(&w->walk);
    return 0;
}

int cuda_launch_rt1(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_RUNTIME, PT_REGS_PARM1(ctx), 0); }
int cuda_launch_rt2(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_RUNTIME, PT_REGS_PARM2(ctx), 0); }
int cuda_launch_drv1(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_DRIVER, PT_REGS_PARM1(ctx), 1); }
int cuda_launch_drv2(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_DRIVER, PT_REGS_PARM2(ctx), 1); }
int cuda_graph_rt(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_GRAPH, PT_REGS_PARM1(ctx), 0); }
int cuda_graph_drv(struct pt_regs *ctx) { return cuda_launch(ctx, CUDA_API_GRAPH, PT_REGS_PARM1(ctx), 1); }
int cuda_marker(struct pt_regs *ctx) {
    u64 handle = (PT_REGS_PARM2(ctx) << 32) | (u32)PT_REGS_PARM1(ctx);
    return cuda_launch(ctx, CUDA_API_MARKER, handle, 0);
}

// -- timed calls --------------------------------------------------------------------------------------------
#include "log2.h"   // log2_u64, as syscalls.c buckets its latencies

static __always_inline int cuda_call_enter(u32 call) {
    if (!in_scope())   // outside --cgroup (and so its return finds no open call)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cuda_open_calls zero = {};
    struct cuda_open_calls *o = cuda_open.lookup_or_try_init(&tid, &zero);
    if (!o) {
        count_stat(STAT_CUDA_TABLE_FULL);
        return 0;
    }
    u32 d = o->depth;
    if (d < CUDA_OPEN_MAX) {
        o->call[d & (CUDA_OPEN_MAX - 1)] = call;
        o->start[d & (CUDA_OPEN_MAX - 1)] = bpf_ktime_get_ns();
    }
    o->depth = d + 1;
    return 0;
}

int cuda_call_return(struct pt_regs *ctx) {
    u64 now = bpf_ktime_get_ns();
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tid = (u32)pid_tgid;
    struct cuda_open_calls *o = cuda_open.lookup(&tid);
    if (!o || o->depth == 0)
        return 0;   // entered before the probes were attached
    u32 d = o->depth - 1;
    o->depth = d;
    if (d >= CUDA_OPEN_MAX)
        return 0;   // too deep to have been timed
    struct cuda_call_key k = {};
    k.tgid = pid_tgid >> 32;
    k.call = o->call[d & (CUDA_OPEN_MAX - 1)];
    u64 start = o->start[d & (CUDA_OPEN_MAX - 1)];
    u64 ns = now > start ? now - start : 0;
    u32 zero_idx = 0;
    u32 *active = control.lookup(&zero_idx);
    if (!active)
        return 0;
    struct cuda_call_value zero = {};
    struct cuda_call_value *v;
    if (*active == 0)
        v = cuda_calls0.lookup_or_try_init(&k, &zero);
    else
        v = cuda_calls1.lookup_or_try_init(&k, &zero);
    if (!v) {
        count_stat(STAT_CUDA_TABLE_FULL);
        return 0;
    }
    u32 b = log2_u64(ns);
    if (b >= CUDA_HIST)
        b = CUDA_HIST - 1;
    // Linux 6.1's verifier loses that bound when clang makes the clamp a conditional select ("R0 unbounded
    // memory access" on hist[b]; the arm64 guest's 6.1 refused this program, and with it every probe of the
    // library): an opaque copy and a real branch, never taken, as agent/bpf/syscalls.c does.
    asm volatile("" : "+r"(b));
    if (b >= CUDA_HIST)
        return 0;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->ns, ns);
    __sync_fetch_and_add(&v->hist[b], 1);
    count_stat(STAT_CUDA_CALLS);
    return 0;
}

// One entry program per timed function: the id says which (BCC attaches a program, not a program and a value).
#define CUDA_CALL_ENTRY(n) \
    int cuda_call_##n(struct pt_regs *ctx) { return n < CUDA_CALL_IDS ? cuda_call_enter(n) : 0; }
CUDA_CALL_ENTRY(0) CUDA_CALL_ENTRY(1) CUDA_CALL_ENTRY(2) CUDA_CALL_ENTRY(3) CUDA_CALL_ENTRY(4)
CUDA_CALL_ENTRY(5) CUDA_CALL_ENTRY(6) CUDA_CALL_ENTRY(7) CUDA_CALL_ENTRY(8) CUDA_CALL_ENTRY(9)
CUDA_CALL_ENTRY(10) CUDA_CALL_ENTRY(11) CUDA_CALL_ENTRY(12) CUDA_CALL_ENTRY(13) CUDA_CALL_ENTRY(14)
CUDA_CALL_ENTRY(15) CUDA_CALL_ENTRY(16) CUDA_CALL_ENTRY(17) CUDA_CALL_ENTRY(18) CUDA_CALL_ENTRY(19)
CUDA_CALL_ENTRY(20) CUDA_CALL_ENTRY(21) CUDA_CALL_ENTRY(22) CUDA_CALL_ENTRY(23) CUDA_CALL_ENTRY(24)
CUDA_CALL_ENTRY(25) CUDA_CALL_ENTRY(26) CUDA_CALL_ENTRY(27) CUDA_CALL_ENTRY(28) CUDA_CALL_ENTRY(29)
CUDA_CALL_ENTRY(30) CUDA_CALL_ENTRY(31) CUDA_CALL_ENTRY(32) CUDA_CALL_ENTRY(33) CUDA_CALL_ENTRY(34)
CUDA_CALL_ENTRY(35) CUDA_CALL_ENTRY(36) CUDA_CALL_ENTRY(37) CUDA_CALL_ENTRY(38) CUDA_CALL_ENTRY(39)

// -- kernel names of the driver API --------------------------------------------------------------------------
int cuda_name_enter(struct pt_regs *ctx) {
    if (!in_scope())   // outside --cgroup
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cuda_name_args a = {PT_REGS_PARM1(ctx), PT_REGS_PARM3(ctx)};
    cuda_name_args.update(&tid, &a);
    return 0;
}

int cuda_name_return(struct pt_regs *ctx) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tid = (u32)pid_tgid;
    struct cuda_name_args *a = cuda_name_args.lookup(&tid);
    if (!a)
        return 0;
    u64 out = a->out, name = a->name;
    cuda_name_args.delete(&tid);
    if (PT_REGS_RC(ctx) != 0 || !out || !name)   // CUDA_SUCCESS is 0
        return 0;
    struct cuda_function_key k = {};
    k.tgid = pid_tgid >> 32;
    if (bpf_probe_read_user(&k.handle, sizeof(k.handle), (void *)out) != 0 || !k.handle)
        return 0;
    u32 zero = 0;
    // The per-CPU launch scratch is too small a name buffer to share; the name goes straight into the map.
    struct cuda_function_name empty = {};
    if (cuda_functions.update(&k, &empty) != 0)
        return 0;
    struct cuda_function_name *n = cuda_functions.lookup(&k);
    if (n)
        bpf_probe_read_user_str(n->name, sizeof(n->name), (void *)name);
    (void)zero;
    return 0;
}
