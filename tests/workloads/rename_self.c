/* Burns SECONDS of its own CPU time, names itself NAME with prctl(PR_SET_NAME) (as fleetprof's processes
 * do once their imports are done), and burns SECONDS more: the agent described it under its old name.
 * usage: rename_self SECONDS NAME */
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>

static volatile unsigned long sink;

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) static void burn(double seconds) {
    double end = cpu_seconds() + seconds;
    while (cpu_seconds() < end)
        for (int i = 0; i < 10000; i++) sink += i ^ (sink >> 3);
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    double seconds = atof(argv[1]);
    burn(seconds);
    prctl(PR_SET_NAME, argv[2], 0, 0, 0);
    burn(seconds);
    return 0;
}
