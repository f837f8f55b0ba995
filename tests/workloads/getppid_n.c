/* Makes exactly N getppid system calls (raw syscall(2), so libc cannot cache or skip any), sleeping
 * SLEEP_MS between batches of 1000 so the run spans several drains.  usage: getppid_n N SLEEP_MS */
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    long n = atol(argv[1]);
    struct timespec pause = {0, atol(argv[2]) * 1000000L};
    for (long i = 0; i < n; i++) {
        syscall(SYS_getppid);
        if (i % 1000 == 999) nanosleep(&pause, NULL);
    }
    return 0;
}
