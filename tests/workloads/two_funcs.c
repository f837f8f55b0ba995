/* CPU workload for the end-to-end tests: splits its time between two functions by a given share and
 * measures the true split itself (thread CPU time around each call), printed as JSON on exit. The calls
 * come in rounds of varying size: a fixed round could beat in step with the sampling clock and bias the
 * sampled split, while varying rounds leave each sample an independent draw (binomial error).
 * usage: two_funcs SECONDS SHARE_A_PERCENT (GATE=1: held back until a line on stdin; SIGUSR1: stop before
 * SECONDS; gate.h) */
#include "gate.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

static long long cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

__attribute__((noinline)) void fp_hot_alpha(long n) {
    for (long i = 0; i < n; i++) sink += i * i ^ (sink >> 3);
}

__attribute__((noinline)) void fp_cold_beta(long n) {
    for (long i = 0; i < n; i++) sink += i * i ^ (sink >> 3);
}

__attribute__((noinline)) void fp_driver(double seconds, int share_a) {
    long long a = 0, b = 0, start = cpu_ns();
    unsigned long seed = 12345;
    while (!stop_early && cpu_ns() - start < (long long)(seconds * 1e9)) {
        seed = (seed * 1103515245 + 12345) % 2147483648UL;
        const long chunk = 50000 + seed % 300000;  /* rounds of 0.5M-3.5M iterations, 200k x 10 on average */
        long long t0 = cpu_ns();
        fp_hot_alpha(chunk * share_a / 10);
        long long t1 = cpu_ns();
        fp_cold_beta(chunk * (100 - share_a) / 10);
        long long t2 = cpu_ns();
        a += t1 - t0;
        b += t2 - t1;
    }
    printf("{\"alpha_ns\": %lld, \"beta_ns\": %lld, \"total_ns\": %lld}\n", a, b, cpu_ns() - start);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SECONDS SHARE_A_PERCENT\n", argv[0]);
        return 2;
    }
    gate_if_asked();
    fp_driver(atof(argv[1]), atoi(argv[2]));
    return 0;
}
