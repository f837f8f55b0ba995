/* Kernel-heavy workload: reads /dev/zero in 1 MiB chunks for SECONDS, so most CPU time is in the kernel.
 * usage: read_zero SECONDS */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 20];

__attribute__((noinline)) long fp_read_loop(int fd, double seconds) {
    struct timespec t0, t;
    long calls = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        if (read(fd, buf, sizeof buf) < 0) return -1;
        calls++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    return calls;
}

int main(int argc, char **argv) {
    int fd = open("/dev/zero", O_RDONLY);
    if (argc != 2 || fd < 0) return 2;
    printf("%ld\n", fp_read_loop(fd, atof(argv[1])));
    return 0;
}
