/* CPU workload for the CFI unwinder: a call chain built without frame pointers, so only .eh_frame (or
 * .debug_frame) can walk it. main -> chain_a -> chain_b -> chain_c -> leaf_spin (the hot loop), and
 * main -> sort_round -> qsort (libc) -> compare_slow (burns CPU inside libc's frames). chain_b keeps a
 * variable-length array, which makes GCC use rbp as a frame pointer there even with
 * -fomit-frame-pointer: the chain holds rsp-based and rbp-based CFA rows both.
 * Build: gcc -O2 -fomit-frame-pointer -g -o unwind_chain unwind_chain.c
 * usage: unwind_chain [ROUNDS [gate]]   (default 200; ~2,000 rounds a second here); prints one line,
 *        "checksum N", the same on every run for the same ROUNDS: no clock, no randomness beyond a
 *        fixed-seed generator.
 *        unwind_chain cpu SECONDS [gate]   runs the two parts in turns, the one with less of this thread's
 *        CPU time so far going next, until each has had SECONDS of it: each part gets the same CPU time
 *        on any machine, however fast (a fixed number of rounds gave the sort part 27% of the samples on
 *        one CPU and 50% on another). Prints JSON: each part's CPU ns and calls, measured with
 *        CLOCK_THREAD_CPUTIME_ID around each call (~1 us of a ~0.3 ms call).
 * With "gate" it first waits for a line on stdin (a test describes it, then lets it go). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) unsigned long leaf_spin(unsigned long n, unsigned long seed) {
    unsigned long x = seed;
    for (unsigned long i = 0; i < n; i++) x = x * 6364136223846793005UL + (i ^ (x >> 29));
    return x;
}

__attribute__((noinline)) unsigned long chain_c(unsigned long n, unsigned long seed) {
    unsigned long a = leaf_spin(n, seed);
    unsigned long b = leaf_spin(n / 2, a);
    return a ^ (b << 1);
}

__attribute__((noinline)) unsigned long chain_b(unsigned long n, unsigned long seed) {
    unsigned long scratch[(seed & 7) + 1]; /* a VLA: rbp becomes this frame's frame pointer */
    for (unsigned long i = 0; i <= (seed & 7); i++) scratch[i] = chain_c(n, seed + i);
    unsigned long x = 0;
    for (unsigned long i = 0; i <= (seed & 7); i++) x += scratch[i];
    return x;
}

__attribute__((noinline)) unsigned long chain_a(unsigned long n, unsigned long seed) {
    return chain_b(n, seed) + chain_b(n / 4, seed + 1);
}

static int compare_slow(const void *pa, const void *pb) {
    unsigned long a = *(const unsigned long *)pa, b = *(const unsigned long *)pb;
    for (int i = 0; i < 64; i++) sink += (a ^ i) * (b | 1); /* the CPU cost, inside qsort's frames */
    return (a > b) - (a < b);
}

__attribute__((noinline)) unsigned long sort_round(unsigned long seed) {
    unsigned long v[256];
    for (int i = 0; i < 256; i++) v[i] = seed = seed * 1103515245UL + 12345UL;
    qsort(v, 256, sizeof v[0], compare_slow);
    return v[0] ^ v[255];
}

static long long thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int wait_for_gate(void) {
    char line[8];
    return fgets(line, sizeof line, stdin) != NULL;
}

int main(int argc, char **argv) {
    if (argc > 2 && !strcmp(argv[1], "cpu")) {
        /* The loop is main's own, so the stacks stay main -> chain_a ... and main -> sort_round ... */
        const long long want = (long long)(atof(argv[2]) * 1e9);
        if (want <= 0 || (argc > 3 && (strcmp(argv[3], "gate") || !wait_for_gate())))
            return 2;
        long long chain_ns = 0, sort_ns = 0;
        long chains = 0, sorts = 0;
        unsigned long sum = 0, jitter = 88172645463325252UL;
        while (chain_ns < want || sort_ns < want) {
            long long t0 = thread_cpu_ns();
            if (chain_ns <= sort_ns) {
                /* Each chain call 10,000-29,999 steps long, by a xorshift: with a fixed length the loop
                 * repeated every 8 calls (chain_b's seed & 7), and a sampler's timer could lock in phase
                 * with it (one quiet run gave the chain 0.35 of both ours and perf's samples, for 0.50). */
                jitter ^= jitter << 13, jitter ^= jitter >> 7, jitter ^= jitter << 17;
                sum += chain_a(10000 + jitter % 20000, (unsigned long)chains++);
                chain_ns += thread_cpu_ns() - t0;
            } else {
                sum ^= sort_round((unsigned long)sorts++ + 7);
                sort_ns += thread_cpu_ns() - t0;
            }
        }
        printf("{\"chain_ns\": %lld, \"sort_ns\": %lld, \"chains\": %ld, \"sorts\": %ld, \"checksum\": %lu}\n",
               chain_ns, sort_ns, chains, sorts, sum);
        return 0;
    }
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    if (argc > 2 && (strcmp(argv[2], "gate") || !wait_for_gate()))
        return 2;
    unsigned long sum = 0;
    for (long r = 0; r < rounds; r++) {
        sum += chain_a(20000, (unsigned long)r);
        sum ^= sort_round((unsigned long)r + 7);
    }
    printf("checksum %lu\n", sum);
    return 0;
}
