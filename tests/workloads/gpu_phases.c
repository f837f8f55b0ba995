/* Alternates between two functions in step with the wall clock, like a training loop whose GPU work and
 * CPU-side data loading take turns: during even PHASE_MS periods of CLOCK_REALTIME it spins in
 * gpu_busy_phase(), during odd ones in gpu_idle_phase().  usage: gpu_phases SECONDS PHASE_MS */
#include <stdlib.h>
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

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    long end = now_ms() + atol(argv[1]) * 1000L, phase_ms = atol(argv[2]);
    while (now_ms() < end) {
        gpu_busy_phase(phase_ms);
        gpu_idle_phase(phase_ms);
    }
    return 0;
}
