/* Threads that block through glibc's wrappers, as real programs do (tests/e2e/test_offcpu_top_e2e.py).
 *
 *   offcpu_reasons SECONDS INTERVAL_US
 *       A forked writer puts a byte into a pipe every INTERVAL_US until SECONDS pass, then closes it. One
 *       thread reads the pipe a byte at a time (fp_wait_for_pipe calls fp_read_pipe, which calls glibc's
 *       read()); another sleeps INTERVAL_US at a time in nanosleep() (fp_sleeper calls fp_nap) until
 *       SECONDS pass. Each measures every call with CLOCK_MONOTONIC. Prints JSON per thread: its tid, its
 *       calls, their total and the sum of their squares (ns, ns^2: the off-CPU sampling's noise).
 *
 * glibc's read() and nanosleep() (clock_nanosleep underneath) keep no frame pointer: a frame walk from
 * inside them skips their caller (fp_read_pipe, fp_nap) and goes on from the caller's caller. A walk by
 * the unwind tables keeps it. Built with -O0 -fno-omit-frame-pointer (tests/conftest.py workload_bin).
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct tally {
	long tid, calls;
	int64_t ns;
	double sq;
};

static int fds[2];
static int64_t until_ns;
static long interval_us;
static struct tally reader, sleeper;

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall, no switch */
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void count(struct tally *t, int64_t start)
{
	int64_t d = now_ns() - start;
	t->calls++;
	t->ns += d;
	t->sq += (double)d * (double)d;
}

__attribute__((noinline)) long fp_read_pipe(char *byte)
{
	return read(fds[0], byte, 1);
}

__attribute__((noinline)) void *fp_wait_for_pipe(void *arg)
{
	char byte;
	(void)arg;
	reader.tid = syscall(SYS_gettid);
	for (;;) {
		int64_t start = now_ns();
		long got = fp_read_pipe(&byte);
		count(&reader, start);
		if (got != 1)
			return NULL;
	}
}

__attribute__((noinline)) void fp_nap(void)
{
	struct timespec pause = {0, interval_us * 1000};
	nanosleep(&pause, NULL);
}

__attribute__((noinline)) void *fp_sleeper(void *arg)
{
	(void)arg;
	sleeper.tid = syscall(SYS_gettid);
	while (now_ns() < until_ns) {
		int64_t start = now_ns();
		fp_nap();
		count(&sleeper, start);
	}
	return NULL;
}

static void print(const char *name, const struct tally *t, const char *sep)
{
	printf("\"%s\": {\"tid\": %ld, \"calls\": %ld, \"ns\": %lld, \"sq_ns2\": %.0f}%s", name, t->tid, t->calls,
	       (long long)t->ns, t->sq, sep);
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	double seconds = atof(argv[1]);
	interval_us = atol(argv[2]);
	until_ns = now_ns() + (int64_t)(seconds * 1e9);
	if (pipe(fds) != 0)
		return 1;
	pid_t writer = fork();
	if (writer < 0)
		return 1;
	if (writer == 0) {
		struct timespec pause = {0, interval_us * 1000};
		close(fds[0]);
		while (now_ns() < until_ns) {
			nanosleep(&pause, NULL);
			if (write(fds[1], "x", 1) != 1)
				_exit(1);
		}
		_exit(0);
	}
	close(fds[1]);
	pthread_t threads[2];
	if (pthread_create(&threads[0], NULL, fp_wait_for_pipe, NULL) != 0 ||
	    pthread_create(&threads[1], NULL, fp_sleeper, NULL) != 0)
		return 1;
	pthread_join(threads[0], NULL);
	pthread_join(threads[1], NULL);
	int status;
	waitpid(writer, &status, 0);
	printf("{\"pid\": %d, ", (int)getpid());
	print("reader", &reader, ", ");
	print("sleeper", &sleeper, "}\n");
	return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
