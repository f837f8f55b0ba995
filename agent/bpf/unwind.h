// User-stack unwinding by call-frame information (.eh_frame / .debug_frame), for code built without frame
// pointers: the layouts and the walk's design. The maps and the walk itself are in cpu_sampler.c (BCC
// rewrites map calls in the main source file only). agent/unwind/ builds the tables and fills the maps.
//
// Defined with -D flags by agent/sampler.py: UNWIND_ROWS, UNWIND_FILES, UNWIND_MAPS, UNWIND_PROCS,
// UNWIND_FRAMES_PER_PROG, UNWIND_MAX_FRAMES.
//
// A walk is a chain of tail calls of a step program (each unwinds UNWIND_FRAMES_PER_PROG frames; the kernel
// allows 33 tail calls), state in the per-CPU unwind_state or the task's own task_walks (cpu_sampler.c says
// which program types use which). Per frame:
//   1. the mapping that holds ip: binary search of the process's range of unwind_maps (sorted by start);
//   2. the row for ip's file address (for a return address, vaddr - 1: the call may be the last instruction
//      of a function): its 64 KB page's rows, found by the file's page index, then a binary search of them
//      for the last row whose page offset <= vaddr's; the row names its rule in unwind_rules;
//   3. CFA = rsp or rbp + offset; the return address is at CFA - 8 (x86-64); rbp is restored from CFA + off
//      when the row says it was saved; the caller's rsp is the CFA. On arm64 (ARCH_ARM64): CFA = sp or x29
//      + offset; the return address is read from its row's slot, or, in the interrupted frame only, taken
//      from x30 where the row says it was not saved yet; x29 likewise; pointer-authentication signatures
//      are stripped from every return address (STRIP_PAC).
// Where a file has no table (not built yet, or none) or a row says NO_INFO, the frame is stepped by frame
// pointer instead (rbp -> saved rbp, return address above it); so is anonymous executable memory (JIT code,
// which has no file), and the walk goes on only if the return address that gives lies in a known mapping.
// No address outside the process's executable mappings is recorded but the leaf (where the CPU was): a
// return address there is garbage from a bad step, or code mapped since the process was described (the
// walk flags the process in unwind_unmapped and user space re-reads its mappings: at once where the
// address came from a table, at the drain where it came from a frame pointer). Every walk ends exactly
// once, counted by reason in stats (STAT_UNWIND_*).
//
// The rule encoding mirrors agent/unwind/table.py: bits 0-2 kind, bits 3-19 CFA offset in bytes, bits
// 20-31 the rbp save slot as a signed count of 8 bytes from the CFA (0: rbp unchanged). arm64's rows have
// a layout of their own, the same kinds (CFA_RSP: from sp, CFA_RBP: from x29): table.py's module doc.

#define UNWIND_KIND_CFA_RSP     0
#define UNWIND_KIND_CFA_RBP     1
#define UNWIND_KIND_END         2
#define UNWIND_KIND_UNSUPPORTED 3
#define UNWIND_KIND_SIGNAL      4
#define UNWIND_KIND_NO_INFO     5

// A file id in unwind_maps for an executable mapping of no file (JIT code, anonymous memory). The vDSO is
// not one: it has a file id and a table like any file (agent/symbols/vdso.py).
#define UNWIND_FILE_JIT 0xffffffff

// A file's table, in unwind_rows (u32 words) from `first`: its page index, then its rows.
//   words [first, first + pages]: for each 64 KB page of the file's addresses from page `page_base` on,
//     where its rows start, counted from the first row (first + pages + 1); one more word ends the last
//     page's rows. Every page has a row at offset 0 (the rule in effect where it starts), so the last row
//     at or before an address of the page is always in the page.
//   a row: bits 0-15 the page offset where it starts (it applies up to the next row's), bits 16-31 its
//     rule's id: unwind_rules[id] is the rule (agent/unwind/table.py encodes them), shared by every file.
// 4 bytes a row: a node's ~1,400 distinct rules of libtorch_cpu.so's 2.6 M rows fit 16 bits, and a page's
// search is 16 steps at most (8 bytes a row and 24 steps over the whole file before). pages = 0: no table
// loaded for it. `delta`: its executable segment's p_vaddr - p_offset, so that file address =
// ip - unwind_map.bias + delta.
struct unwind_file {
    u32 first;
    u32 pages;
    u32 page_base;
    u32 pad;
    s64 delta;
};

#define UNWIND_PAGE_SHIFT 16
#define UNWIND_RULE_IDS   65536

// One executable mapping of a process: addresses [start, end) hold file `file`'s bytes at file offset
// ip - bias (bias = start - the mapping's file offset).
struct unwind_map {
    u64 start;
    u64 end;
    u64 bias;
    u32 file;
    u32 pad;
};

// A process's mappings: unwind_maps[first, first + n), sorted by start.
struct unwind_proc {
    u32 first;
    u32 n;
};

// The walk in progress on this CPU, across tail calls.
struct unwind_state {
    struct sample_key key;   // everything but user_stack: taken before the walk
    u64 ip;
    u64 sp;
    u64 bp;
    u64 lr;                  // x30 where the walk began (arm64: a leaf's return address); 0 on x86-64
    u32 set;                 // the map set this sample goes into (control[0] when it was taken)
    u32 calls;               // tail calls made
    u32 leaf;                // 1 while ip is the interrupted instruction (not a return address)
    u32 done;
    u32 from_jit;            // 1 when ip came from a frame-pointer step out of JIT code
    u32 from_fp;             // 1 when ip came from a frame-pointer step (JIT code, or a file without rows)
    u32 purpose;             // what the walk is for (WALK_* in cpu_sampler.c): walk_finish does it
    u32 at_entry;            // 1 while ip is a function's first instruction (an entry uprobe's leaf)
    u64 arg[4];              // the purpose's own values
    struct stack_trace frames;   // leaf first, as bpf_get_stack gives them
    u64 guard;                   // what a masked index one past frames.ip may touch (never written)
};
