/* CPU workload for tests/e2e/test_debuginfo_e2e.py: SECONDS of its own CPU time (measured by itself), nearly
 * all of it in sym_hot_mix. Both functions are static: a stripped build keeps neither name (.dynsym holds
 * exported names only), so the profile names them only through a separate debug file. The test builds it
 * static (it runs chrooted too), splits it with objcopy --only-keep-debug and strips it.
 * usage: sym_hot SECONDS */
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) static unsigned long sym_hot_mix(unsigned long x) {
    for (int i = 0; i < 200000; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    return x;
}

__attribute__((noinline)) static unsigned long sym_hot_driver(double seconds) {
    unsigned long x = 88172645463325252UL;
    while (cpu_seconds() < seconds) x = sym_hot_mix(x);
    return x;
}

int main(int argc, char **argv) {
    sink = sym_hot_driver(argc > 1 ? atof(argv[1]) : 1.0);
    return 0;
}
