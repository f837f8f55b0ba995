/* CPU workload for the CFI unwinder: a call chain built without frame pointers, so only .eh_frame (or
 * .debug_frame) can walk it. main -> chain_a -> chain_b -> chain_c -> leaf_spin (the hot loop), and
 * main -> sort_round -> qsort (libc) -> compare_slow (burns CPU inside libc's frames). chain_b keeps a
 * variable-length array, which makes GCC use rbp as a frame pointer there even with
 * -fomit-frame-pointer: the chain holds rsp-based and rbp-based CFA rows both.
 * Build: gcc -O2 -fomit-frame-pointer -g -o unwind_chain unwind_chain.c
 * usage: unwind_chain [ROUNDS [gate]]   (default 200; ~2,000 rounds a second here); prints one line,
 * "checksum N", the same on every run for the same ROUNDS: no clock, no randomness beyond a fixed-seed
 * generator. With "gate" it first waits for a line on stdin (a test describes it, then lets it go). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    if (argc > 2 && !strcmp(argv[2], "gate")) {
        char line[8];
        if (!fgets(line, sizeof line, stdin))
            return 2;
    }
    unsigned long sum = 0;
    for (long r = 0; r < rounds; r++) {
        sum += chain_a(20000, (unsigned long)r);
        sum ^= sort_round((unsigned long)r + 7);
    }
    printf("checksum %lu\n", sum);
    return 0;
}
