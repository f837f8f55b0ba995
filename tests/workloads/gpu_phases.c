/* Alternates between two functions in step with the wall clock, like a training loop whose GPU work and
 * CPU-side data loading take turns: during even PHASE_MS periods of CLOCK_REALTIME it spins in
 * gpu_busy_phase(), during odd ones in gpu_idle_phase(), or with "wait" it sleeps through them in 10 ms
 * naps in gpu_idle_wait() (a loop blocked on its data while the GPU idles).
 * usage: gpu_phases SECONDS PHASE_MS MIN_S [wait]
 * Runs whole (busy, idle) pairs of phases until SECONDS of wall time have passed and each phase function
 * has had MIN_S of this thread's CPU time (with "wait": until the loop has spent MIN_S of wall time in
 * gpu_idle_wait), so a machine that gives it less CPU runs it longer rather than sampling it less. Prints JSON: each phase
 * function's CPU ns (CLOCK_THREAD_CPUTIME_ID around each call), the wall ns spent in gpu_idle_wait
 * (CLOCK_MONOTONIC around each call: on a busy machine the loop may still be waiting for a CPU in
 * gpu_busy_phase well into an idle phase) and the pairs run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static long long clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static volatile unsigned long sink;

__attribute__((noinline)) void gpu_busy_phase(long phase_ms) {
    while ((now_ms() / phase_ms) % 2 == 0)
        for (int i = 0; i < 10000; i++) sink += i * 7;
}

__attribute__((noinline)) void gpu_idle_phase(long phase_ms) {
    while ((now_ms() / phase_ms) % 2 == 1)
        for (int i = 0; i < 10000; i++) sink += i * 13;
}

/* nanosleep with its own `syscall` instruction: through glibc's wrapper (no frame pointer) the kernel's
 * frame walk would skip this function and start at its caller. x86-64 only. */
__attribute__((noinline)) void gpu_idle_wait(long phase_ms) {
    struct timespec nap = {0, 10 * 1000 * 1000};
    while ((now_ms() / phase_ms) % 2 == 1) {
        long ret;
        __asm__ volatile("syscall" : "=a"(ret) : "a"((long)SYS_nanosleep), "D"(&nap), "S"(0L)
                         : "rcx", "r11", "memory");
    }
}

int main(int argc, char **argv) {
    if (argc != 4 && !(argc == 5 && !strcmp(argv[4], "wait"))) return 2;
    long end = now_ms() + atol(argv[1]) * 1000L, phase_ms = atol(argv[2]);
    long long min_ns = (long long)(atof(argv[3]) * 1e9), busy_ns = 0, idle_ns = 0, wait_ns = 0;
    int wait = argc == 5;
    long pairs = 0;
    if (phase_ms <= 0 || min_ns < 0) return 2;
    while (now_ms() < end || (wait ? wait_ns < min_ns : busy_ns < min_ns || idle_ns < min_ns)) {
        long long t0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        gpu_busy_phase(phase_ms);
        long long t1 = clock_ns(CLOCK_THREAD_CPUTIME_ID), w = clock_ns(CLOCK_MONOTONIC);
        if (wait)
            gpu_idle_wait(phase_ms);
        else
            gpu_idle_phase(phase_ms);
        wait_ns += wait ? clock_ns(CLOCK_MONOTONIC) - w : 0;
        busy_ns += t1 - t0;
        idle_ns += clock_ns(CLOCK_THREAD_CPUTIME_ID) - t1;
        pairs++;
    }
    printf("{\"busy_cpu_ns\": %lld, \"idle_cpu_ns\": %lld, \"idle_wait_ns\": %lld, \"pairs\": %ld}\n", busy_ns,
           idle_ns, wait_ns, pairs);
    return 0;
}
