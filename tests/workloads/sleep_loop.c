/* Sleeps K times for MS milliseconds each with the clock_nanosleep syscall itself (not libc's wrapper,
 * which may pick another syscall), so that a tracer sees exactly K clock_nanosleep calls of ~MS ms.
 * Prints each call's own duration in nanoseconds (CLOCK_MONOTONIC read just before and after it), one a
 * line: a tracer's time for a call lies within it, however late a busy machine wakes the sleeper.
 * usage: sleep_loop K MS */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	long k = atol(argv[1]), ms = atol(argv[2]);
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	long long *took = calloc(k > 0 ? k : 1, sizeof(*took));
	if (!took)
		return 1;
	for (long i = 0; i < k; i++) {
		long long t0 = now_ns();
		if (syscall(SYS_clock_nanosleep, CLOCK_MONOTONIC, 0, &ts, NULL) != 0)
			return 1;
		took[i] = now_ns() - t0;
	}
	for (long i = 0; i < k; i++)
		printf("%lld\n", took[i]);
	return 0;
}
