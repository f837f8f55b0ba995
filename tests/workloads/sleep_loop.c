/* Sleeps K times for MS milliseconds each with the clock_nanosleep syscall itself (not libc's wrapper,
 * which may pick another syscall), so that a tracer sees exactly K clock_nanosleep calls of ~MS ms.
 * usage: sleep_loop K MS */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	long k = atol(argv[1]), ms = atol(argv[2]);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	for (long i = 0; i < k; i++)
		if (syscall(SYS_clock_nanosleep, CLOCK_MONOTONIC, 0, &ts, NULL) != 0)
			return 1;
	printf("%ld\n", k);
	return 0;
}
