/* Alternates between two functions in step with the wall clock, like a training loop whose GPU work and
 * CPU-side data loading take turns: during even PHASE_MS periods of CLOCK_REALTIME it spins in
 * gpu_busy_phase(), during odd ones in gpu_idle_phase(), or with "wait" it sleeps through them in 10 ms
 * naps in gpu_idle_wait() (a loop blocked on its data while the GPU idles).
 * usage: gpu_phases SECONDS PHASE_MS [wait] */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
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
    if (argc != 3 && !(argc == 4 && !strcmp(argv[3], "wait"))) return 2;
    long end = now_ms() + atol(argv[1]) * 1000L, phase_ms = atol(argv[2]);
    int wait = argc == 4;
    while (now_ms() < end) {
        gpu_busy_phase(phase_ms);
        if (wait)
            gpu_idle_wait(phase_ms);
        else
            gpu_idle_phase(phase_ms);
    }
    return 0;
}
