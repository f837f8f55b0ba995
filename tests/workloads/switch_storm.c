/* A context-switch storm for bench/offcpu.py: two processes ping-pong one byte over two pipes.
 *
 *   switch_storm SECONDS
 *       Runs for SECONDS of wall time; prints "ROUNDS ELAPSED_NS CPU_NS SWITCHES": round trips, wall time,
 *       CPU time of both processes, and their context switches (voluntary + involuntary, getrusage).
 *       Pinned to one CPU (taskset), every round trip is two switches, each straight from one process to
 *       the other, and the CPU time is the cost of the switches and of the tiny reads and writes between.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t clock_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t usage_ns(const struct rusage *ru)
{
	return (int64_t)(ru->ru_utime.tv_sec + ru->ru_stime.tv_sec) * 1000000000 +
	       (int64_t)(ru->ru_utime.tv_usec + ru->ru_stime.tv_usec) * 1000;
}

int main(int argc, char **argv)
{
	if (argc != 2)
		return 2;
	int64_t run_ns = (int64_t)(atof(argv[1]) * 1e9);
	int ping[2], pong[2];
	char byte = 'p';
	if (pipe(ping) != 0 || pipe(pong) != 0)
		return 1;
	pid_t child = fork();
	if (child < 0)
		return 1;
	if (child == 0) { /* echo every byte back until the parent closes its end */
		close(ping[1]), close(pong[0]);
		while (read(ping[0], &byte, 1) == 1)
			if (write(pong[1], &byte, 1) != 1)
				_exit(1);
		_exit(0);
	}
	close(ping[0]), close(pong[1]);
	struct rusage self0;
	getrusage(RUSAGE_SELF, &self0);
	int64_t start = clock_ns(), now = start;
	long rounds = 0;
	while (now - start < run_ns) {
		for (int i = 0; i < 256; i++, rounds++)
			if (write(ping[1], &byte, 1) != 1 || read(pong[0], &byte, 1) != 1)
				return 1;
		now = clock_ns();
	}
	close(ping[1]);
	int status;
	waitpid(child, &status, 0);
	struct rusage self, kid;
	getrusage(RUSAGE_SELF, &self);
	getrusage(RUSAGE_CHILDREN, &kid);
	long switches = self.ru_nvcsw + self.ru_nivcsw - self0.ru_nvcsw - self0.ru_nivcsw + kid.ru_nvcsw + kid.ru_nivcsw;
	/* The child's usage includes its start-up before the clock started: microseconds. */
	printf("%ld %lld %lld %ld\n", rounds, (long long)(now - start),
	       (long long)(usage_ns(&self) - usage_ns(&self0) + usage_ns(&kid)), switches);
	return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
