// floor(log2(v)) for v >= 1, 0 for v == 0; branch-light and verifier-friendly (no loop). The latency
// histograms' bucket: syscalls.c (syscall latency) and cuda_probes.c (CUDA call latency).
#ifndef FLEETPROF_LOG2_H
#define FLEETPROF_LOG2_H

static __always_inline u32 log2_u64(u64 v) {
    u32 r = 0, s;
    s = (v > 0xFFFFFFFFULL) << 5; v >>= s; r |= s;
    s = (v > 0xFFFFULL) << 4;     v >>= s; r |= s;
    s = (v > 0xFFULL) << 3;       v >>= s; r |= s;
    s = (v > 0xFULL) << 2;        v >>= s; r |= s;
    s = (v > 0x3ULL) << 1;        v >>= s; r |= s;
    r |= (u32)(v >> 1);
    return r;
}

#endif
