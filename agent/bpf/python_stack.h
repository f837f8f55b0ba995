// CPython frame walker for cpu_sampler.c: finds the sampled thread's PyThreadState and records its chain of
// interpreter frames (code object address, instruction pointer offset, frame owner), leaf first.
//
// Only user memory of the sampled process is read (bpf_probe_read_user), at offsets user space computed for
// that interpreter build (agent/python/offsets.py) and handed over in `struct py_proc`. Map accesses stay in
// cpu_sampler.c (BCC rewrites map calls in the main file only); this file holds plain functions.
//
// Verifier notes: every loop is bounded and has a single exit condition per step (an unrolled walker with
// two data-dependent branches per frame hit the 1M-instruction limit); frame headers are read in one
// 72-byte read into a zeroed buffer and fields are picked by masked word index, so variable offsets are
// provably in bounds.

// Mirrors agent/python/offsets.py PyProc (ctypes). Offsets are bytes into the named CPython struct.
struct py_proc {
    u64 runtime;            // address of _PyRuntime in the target's address space
    u64 pidns_dev;          // the target's pid namespace (nsfs dev_t, kernel encoding) ...
    u64 pidns_ino;          // ... and inode: native_thread_id is a tid as that namespace sees it
    u32 interp_head;        // _PyRuntimeState.interpreters.head
    u32 threads_head;       // PyInterpreterState.threads.head
    u32 tstate_next;        // PyThreadState.next
    u32 tstate_native_tid;  // PyThreadState.native_thread_id
    u32 tstate_frame;       // PyThreadState.cframe (3.11, 3.12) or .current_frame (3.13)
    u32 cframe_frame;       // _PyCFrame.current_frame, or PY_DIRECT_FRAME when tstate_frame is the frame
    u32 frame_code;         // _PyInterpreterFrame.f_code / f_executable (multiple of 8, < 64)
    u32 frame_previous;     // _PyInterpreterFrame.previous (multiple of 8, < 64)
    u32 frame_instr;        // _PyInterpreterFrame.prev_instr / instr_ptr (multiple of 8, < 64)
    u32 frame_owner;        // _PyInterpreterFrame.owner (one byte, < 72)
    u32 version;            // 0x030b, 0x030c, ... (for user space; the walker does not branch on it)
    u32 code_qualname;      // PyCodeObject.co_qualname: its pointer fingerprints the code object
    u32 frame_entry;        // 3.11's _PyInterpreterFrame.is_entry (one byte, < 72), or PY_NO_FIELD (3.12+
                            // mark entries with shim frames instead)
    u64 code_type;          // address of PyCode_Type in the target (every code object's ob_type), or 0:
                            // not known, frames are not checked against it
};

#define PY_NO_FIELD 0xffffffff

#define PY_DIRECT_FRAME 0xffffffff
#define PY_FRAME_READ   72   // bytes of _PyInterpreterFrame header read per frame: covers every field above

// One recorded frame. `instr` is the instruction pointer minus the code object's address (bytes);
// user space turns it into a line with co_code_adaptive's offset and co_linetable. `tag` is the frame's
// owner (bits 24-30; bit 31: 3.11's is_entry, set on the first frame each C call into the interpreter
// evaluates) and bits 4-27 of the code object's co_qualname pointer (bits 0-23): code objects are
// freed and their memory reused, and user space reads names only at the drain, so it checks this
// fingerprint against the object it finds there rather than naming a sample after a newer function.
struct py_frame {
    u64 code;
    u32 instr;
    u32 tag;
};

struct py_stack {
    u64 len;
    struct py_frame frames[PY_MAX_DEPTH];
};

// What python_new carries: a CPython stack as first stored, and whose it is. Mirrors agent/sampler.py.
struct py_new_stack {
    u32 tgid;
    u32 pad;
    struct py_stack stack;
};

// Outcomes of one walk (counted by cpu_sampler.c).
#define PY_OK             0
#define PY_NO_THREAD      1   // no thread state with this tid (a thread that never ran Python, or exiting)
#define PY_UNWIND_FAILED  2   // a read of the target's memory failed mid-way
#define PY_TRUNCATED      3   // deeper than PY_MAX_DEPTH: the root-most frames are missing
#define PY_NO_NAMESPACE   4   // the task is not in the pid namespace recorded for the process
#define PY_CYCLE          5   // the chain came back to a frame it had passed: stale memory (caller drops it)
#define PY_STALE          6   // a frame whose owner is out of range or whose code is not a code object:
                              // memory freed and reused; the frames before it are kept

#define PY_OB_TYPE        8   // PyObject.ob_type
#define PY_MAX_OWNER      3   // FRAME_OWNED_BY_THREAD, _GENERATOR, _FRAME_OBJECT, _CSTACK (3.11 has 0-2)
#define PY_OWNED_BY_CSTACK 3  // 3.12+ shim frames: 3.13's f_executable is None there, not a code object

static __always_inline u64 py_read_u64(u64 addr) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);   // leaves 0 on failure
    return v;
}

// The PyThreadState of thread `tid` (a tid in the target's namespace), starting from a cached guess.
static __always_inline u64 py_find_thread(struct py_proc *p, u32 tid, u64 guess) {
    if (guess && py_read_u64(guess + p->tstate_native_tid) == tid)
        return guess;
    u64 interp = py_read_u64(p->runtime + p->interp_head);
    u64 ts = py_read_u64(interp + p->threads_head);
    u64 ntid = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_MAX_THREADS; i++) {
        // A NULL or unreadable ts reads 0, which is never a sampled tid: one exit condition.
        ntid = py_read_u64(ts + p->tstate_native_tid);
        if (ntid == tid || ntid == 0)
            break;
        ts = py_read_u64(ts + p->tstate_next);
    }
    return ntid == tid ? ts : 0;
}

// Fills `out` with the frames of thread state `ts`, leaf first; returns a PY_* outcome.
//
// A stale thread state or frame (memory freed and reused: another thread's, a finished generator's) can
// point anywhere. A frame whose owner is out of range or whose code is not a code object ends the walk
// (PY_STALE; the frames before it are kept), and so does a frame met twice (PY_CYCLE). Brent's check: the
// frame at steps 0, 1, 3, 7, 15, 31 is kept, and meeting it again is a cycle; it finds a cycle of up to 32
// frames that starts within the first 32, at the cost of one compare a step. Real recursion is no cycle:
// each call has a frame of its own.
static __always_inline u32 py_walk(struct py_proc *p, u64 ts, struct py_stack *out) {
    u64 frame = py_read_u64(ts + p->tstate_frame);
    if (p->cframe_frame != PY_DIRECT_FRAME && frame)
        frame = py_read_u64(frame + p->cframe_frame);
    u32 code_w = (p->frame_code >> 3) & 15, prev_w = (p->frame_previous >> 3) & 15;
    u32 instr_w = (p->frame_instr >> 3) & 15, owner_w = (p->frame_owner >> 3) & 15;
    u32 owner_shift = (p->frame_owner & 7) * 8;
    int has_entry = p->frame_entry != PY_NO_FIELD;
    u32 entry_w = (p->frame_entry >> 3) & 15, entry_shift = (p->frame_entry & 7) * 8;
    u64 buf[16] = {};
    u32 n = 0;
    u32 outcome = PY_OK;
    u64 mark = 0;
    out->len = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_MAX_DEPTH; i++) {
        if (!frame || bpf_probe_read_user(buf, PY_FRAME_READ, (void *)frame) != 0)
            break;
        if (frame == mark) {
            outcome = PY_CYCLE;
            break;
        }
        if ((i & (i + 1)) == 0)
            mark = frame;
        u64 code = buf[code_w];
        u32 owner = (u32)(buf[owner_w] >> owner_shift) & 0xff;
        if (owner > PY_MAX_OWNER ||
            (p->code_type && owner != PY_OWNED_BY_CSTACK && py_read_u64(code + PY_OB_TYPE) != p->code_type)) {
            outcome = PY_STALE;
            break;
        }
        struct py_frame *f = &out->frames[i];
        f->code = code;
        f->instr = (u32)(buf[instr_w] - code);
        if (has_entry && ((buf[entry_w] >> entry_shift) & 0xff))
            owner |= 0x80;
        f->tag = (owner << 24) | (u32)((py_read_u64(code + p->code_qualname) >> 4) & 0xffffff);
        n = i + 1;
        frame = buf[prev_w];
    }
    out->len = n;
    if (outcome != PY_OK)
        return outcome;
    if (!frame)
        return PY_OK;
    return n == PY_MAX_DEPTH ? PY_TRUNCATED : PY_UNWIND_FAILED;
}
