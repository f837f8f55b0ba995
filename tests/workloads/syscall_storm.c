/* Syscall storms for tests/agent/test_syscalls_bpf.py and bench/syscalls.py.
 *
 *   syscall_storm count N THREADS BATCHES PAUSE_MS
 *       make exactly N getppid calls (syscall(SYS_getppid), no libc caching), split over THREADS threads,
 *       each doing its share in BATCHES batches with PAUSE_MS ms of sleep between them; print "N"
 *   syscall_storm bench MODE SECONDS
 *       loop one kind of cheap syscall for SECONDS of wall time; print "CALLS ELAPSED_NS CPU_NS".
 *       MODE: getppid (one call a round), pipe (1-byte write then 1-byte read on a pipe: two calls a round),
 *       devnull (1-byte write to /dev/null)
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

static long per_thread_calls, batches, pause_ms;

static int64_t clock_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts); /* vDSO: not a syscall */
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void pause_between_batches(void)
{
	struct timespec ts = {pause_ms / 1000, (pause_ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static void *count_worker(void *arg)
{
	long calls = (long)arg;
	for (long b = 0; b < batches; b++) {
		long share = calls / batches + (b < calls % batches ? 1 : 0);
		for (long i = 0; i < share; i++)
			syscall(SYS_getppid);
		if (b + 1 < batches)
			pause_between_batches();
	}
	return NULL;
}

static int run_count(long n, long threads)
{
	pthread_t tids[256];
	if (threads < 1 || threads > 256 || batches < 1)
		return 2;
	per_thread_calls = n / threads;
	for (long t = 0; t < threads; t++) {
		long calls = per_thread_calls + (t < n % threads ? 1 : 0);
		if (pthread_create(&tids[t], NULL, count_worker, (void *)calls) != 0)
			return 1;
	}
	for (long t = 0; t < threads; t++)
		pthread_join(tids[t], NULL);
	printf("%ld\n", n);
	return 0;
}

static int run_bench(const char *mode, double seconds)
{
	int fds[2] = {-1, -1};
	char byte = 'x';
	int kind = !strcmp(mode, "getppid") ? 0 : !strcmp(mode, "pipe") ? 1 : !strcmp(mode, "devnull") ? 2 : -1;
	if (kind < 0)
		return 2;
	if (kind == 1 && pipe(fds) != 0)
		return 1;
	if (kind == 2 && (fds[1] = open("/dev/null", O_WRONLY)) < 0)
		return 1;
	int64_t t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
	int64_t end = t0 + (int64_t)(seconds * 1e9), now;
	long calls = 0;
	do {
		for (int i = 0; i < 1000; i++) {
			if (kind == 0) {
				syscall(SYS_getppid);
			} else if (kind == 1) {
				if (write(fds[1], &byte, 1) != 1 || read(fds[0], &byte, 1) != 1)
					return 1;
			} else if (write(fds[1], &byte, 1) != 1) {
				return 1;
			}
		}
		calls += kind == 1 ? 2000 : 1000;
		now = clock_ns(CLOCK_MONOTONIC);
	} while (now < end);
	printf("%ld %lld %lld\n", calls, (long long)(now - t0), (long long)(clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0));
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 6 && !strcmp(argv[1], "count")) {
		batches = atol(argv[4]);
		pause_ms = atol(argv[5]);
		return run_count(atol(argv[2]), atol(argv[3]));
	}
	if (argc == 4 && !strcmp(argv[1], "bench"))
		return run_bench(argv[2], atof(argv[3]));
	fprintf(stderr, "usage: syscall_storm count N THREADS BATCHES PAUSE_MS | bench getppid|pipe|devnull SECONDS\n");
	return 2;
}
