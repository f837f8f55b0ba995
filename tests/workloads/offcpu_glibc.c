/* Off-CPU workload for tests/agent/test_offcpu_unwind.py: blocks through glibc's own wrappers (no frame
 * pointer in them) under a known call chain, as real programs do.
 *
 *   offcpu_glibc MODE SECONDS
 *       After a line on stdin (the test describes the process and builds its tables first), the main thread
 *       blocks in loon_outer -> loon_wait -> glibc for SECONDS of wall time, ~5 ms at a time, and measures
 *       each block with CLOCK_MONOTONIC. MODE names the glibc call:
 *         read       read() on a pipe a helper thread writes a byte to every 5 ms
 *         cond       pthread_cond_wait() on a condition a helper thread signals every 5 ms
 *         epoll      epoll_wait() on an empty epoll set with a 5 ms timeout
 *         nanosleep  nanosleep() for 5 ms
 *       Prints JSON: the main thread's tid, the number of blocks and their total (ns).
 *   offcpu_glibc long MS COUNT
 *       After the line on stdin, blocks COUNT times in loon_outer -> loon_long -> nanosleep() for MS ms each,
 *       with 50 ms of other sleeps (in loon_gap) between; prints JSON: the tid and, per long block, its
 *       requested length and CLOCK_MONOTONIC just before and just after it.
 *
 * The helper thread's own waits are in helper_tick, on another tid. Built with -O0 -fno-omit-frame-pointer
 * (tests/conftest.py workload_bin): every frame of ours keeps one, glibc's wrappers do not.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TICK_NS 5000000L

static int pipe_fd[2];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int ticks;          /* signalled and not yet consumed (cond mode) */
static volatile int stop;
static const char *mode;
static int epfd;

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

__attribute__((noinline)) static void helper_tick(void)
{
	struct timespec ts = {0, TICK_NS};
	nanosleep(&ts, NULL);
	if (strcmp(mode, "read") == 0) {
		char c = 'x';
		if (write(pipe_fd[1], &c, 1) != 1)
			abort();
	} else {
		pthread_mutex_lock(&lock);
		ticks++;
		pthread_cond_signal(&cond);
		pthread_mutex_unlock(&lock);
	}
}

static void *helper(void *arg)
{
	(void)arg;
	while (!stop)
		helper_tick();
	return NULL;
}

__attribute__((noinline)) void loon_wait(void)
{
	if (strcmp(mode, "read") == 0) {
		char c;
		if (read(pipe_fd[0], &c, 1) != 1)
			abort();
	} else if (strcmp(mode, "cond") == 0) {
		pthread_mutex_lock(&lock);
		while (ticks == 0)
			pthread_cond_wait(&cond, &lock);
		ticks--;
		pthread_mutex_unlock(&lock);
	} else if (strcmp(mode, "epoll") == 0) {
		struct epoll_event ev;
		if (epoll_wait(epfd, &ev, 1, TICK_NS / 1000000) != 0)
			abort();
	} else {
		struct timespec ts = {0, TICK_NS};
		nanosleep(&ts, NULL);
	}
}

__attribute__((noinline)) void loon_outer(int64_t seconds, long *blocks, int64_t *total)
{
	int64_t end = now_ns() + seconds * 1000000000;
	while (now_ns() < end) {
		int64_t t0 = now_ns();
		loon_wait();
		*total += now_ns() - t0;
		(*blocks)++;
	}
}

__attribute__((noinline)) void loon_long(int64_t ms, int64_t *t0, int64_t *t1)
{
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
	*t0 = now_ns();
	nanosleep(&ts, NULL);
	*t1 = now_ns();
}

__attribute__((noinline)) void loon_gap(void)
{
	struct timespec ts = {0, 1000000};
	for (int i = 0; i < 50; i++)
		nanosleep(&ts, NULL);
}

/* The gate: read(0) by our own `syscall` instruction, so that its wait (while the test builds tables) is
 * under wait_for_go, not inside a glibc wrapper the test judges. */
__attribute__((noinline)) static void wait_for_go(void)
{
	char c = 0;
	long ret;
	do {
		__asm__ volatile("syscall"
				 : "=a"(ret)
				 : "a"((long)SYS_read), "D"(0L), "S"(&c), "d"(1L)
				 : "rcx", "r11", "memory");
	} while (ret == 1 && c != '\n');
}

int main(int argc, char **argv)
{
	if (argc == 4 && strcmp(argv[1], "long") == 0) {
		int64_t ms = atoll(argv[2]);
		int count = atoi(argv[3]);
		wait_for_go();
		printf("{\"tid\": %ld, \"ms\": %lld, \"blocks\": [", (long)syscall(SYS_gettid), (long long)ms);
		for (int i = 0; i < count; i++) {
			int64_t t0, t1;
			loon_gap();
			loon_long(ms, &t0, &t1);
			printf("%s[%lld, %lld]", i ? ", " : "", (long long)t0, (long long)t1);
		}
		loon_gap();
		printf("]}\n");
		return 0;
	}
	if (argc != 3) {
		fprintf(stderr, "usage: offcpu_glibc read|cond|epoll|nanosleep SECONDS | long MS COUNT\n");
		return 2;
	}
	mode = argv[1];
	if (strcmp(mode, "read") && strcmp(mode, "cond") && strcmp(mode, "epoll") && strcmp(mode, "nanosleep")) {
		fprintf(stderr, "unknown mode %s\n", mode);
		return 2;
	}
	if (pipe(pipe_fd) != 0 || (epfd = epoll_create1(0)) < 0)
		return 1;
	pthread_t t;
	int helped = strcmp(mode, "read") == 0 || strcmp(mode, "cond") == 0;
	wait_for_go();
	if (helped && pthread_create(&t, NULL, helper, NULL) != 0)
		return 1;
	long blocks = 0;
	int64_t total = 0;
	loon_outer(atoll(argv[2]), &blocks, &total);
	stop = 1;
	if (helped)
		pthread_join(t, NULL);
	printf("{\"tid\": %ld, \"blocks\": %ld, \"total_ns\": %lld}\n", (long)syscall(SYS_gettid), blocks,
	       (long long)total);
	return 0;
}
