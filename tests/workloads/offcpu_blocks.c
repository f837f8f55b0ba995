/* Off-CPU workload for tests/agent/test_offcpu_bpf.py: blocks in a known function for known times.
 *
 *   offcpu_blocks random SECONDS MIN_US MAX_US BURN_MS
 *       The main thread blocks in fp_block_here for durations drawn uniformly from [MIN_US, MAX_US] until
 *       SECONDS of wall time pass, and measures each block with CLOCK_MONOTONIC; a second thread burns
 *       BURN_MS of its own CPU time in fp_burn and exits. Prints JSON: the main thread's tid, the number of
 *       blocks, their total and the sum of their squares (for the sampling noise), the burner's tid.
 *   offcpu_blocks once MS
 *       Blocks once for MS milliseconds in fp_block_here; prints JSON with the tid and CLOCK_MONOTONIC just
 *       before and just after the block.
 *   offcpu_blocks mixed SECONDS MIN_US MAX_US BURN_US POOL
 *       The main thread alternates: burns BURN_US of its own CPU time in fp_burn_cpu, then blocks in
 *       fp_block_here as `random` does, until SECONDS pass; it measures the wall time of each with
 *       CLOCK_MONOTONIC (a burn's includes any time it waited for a CPU). POOL more threads sleep meanwhile
 *       in fp_pool_wait, 50 ms at a time, as an idle thread pool does. Prints JSON: the main thread's tid,
 *       its blocks, their total and sum of squares, its burns' wall time, the pool's tids and the pool's
 *       time past its naps (timer slack, and waiting for a CPU once woken).
 *
 * fp_block_here issues clock_nanosleep with its own `syscall` instruction: the user stack the kernel
 * records at the switch-out starts in fp_block_here. Through glibc's wrapper (no frame pointer) the frame
 * walk would skip the wrapper's caller and start at the caller's caller.
 * Built with -O0 -fno-omit-frame-pointer (tests/conftest.py workload_bin). x86-64 only.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile uint64_t sink;
static long burner_tid;

static int64_t clock_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts); /* vDSO: no syscall, no switch */
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

__attribute__((noinline)) long fp_block_here(int64_t ns)
{
	struct timespec ts = {ns / 1000000000, ns % 1000000000};
	register long r10 __asm__("r10") = 0; /* rmtp = NULL */
	long ret;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"((long)SYS_clock_nanosleep), "D"((long)CLOCK_MONOTONIC), "S"(0L), "d"(&ts), "r"(r10)
			 : "rcx", "r11", "memory");
	return ret;
}

__attribute__((noinline)) void fp_burn(long n)
{
	for (long i = 0; i < n; i++)
		sink += i * i ^ (sink >> 3);
}

static void *burner(void *arg)
{
	int64_t budget = (int64_t)(long)arg * 1000000, start = clock_ns(CLOCK_THREAD_CPUTIME_ID);
	burner_tid = syscall(SYS_gettid);
	while (clock_ns(CLOCK_THREAD_CPUTIME_ID) - start < budget)
		fp_burn(100000);
	return NULL;
}

__attribute__((noinline)) void fp_burn_cpu(int64_t ns)
{
	int64_t start = clock_ns(CLOCK_THREAD_CPUTIME_ID);
	while (clock_ns(CLOCK_THREAD_CPUTIME_ID) - start < ns)
		for (int i = 0; i < 1000; i++)
			sink += i * i ^ (sink >> 3);
}

static volatile int pool_stop;
static long pool_tids[64];
static int64_t pool_late[64]; /* per thread: its naps' time beyond 50 ms (woken, then waiting for a CPU) */

/* nanosleep with its own `syscall` instruction, as fp_block_here. */
__attribute__((noinline)) int64_t fp_pool_wait(void)
{
	struct timespec nap = {0, 50 * 1000 * 1000};
	int64_t late = 0;
	while (!pool_stop) {
		long ret;
		int64_t t0 = clock_ns(CLOCK_MONOTONIC);
		__asm__ volatile("syscall" : "=a"(ret) : "a"((long)SYS_nanosleep), "D"(&nap), "S"(0L)
				 : "rcx", "r11", "memory");
		int64_t took = clock_ns(CLOCK_MONOTONIC) - t0 - nap.tv_nsec;
		late += took > 0 ? took : 0;
	}
	return late;
}

static void *pool_thread(void *arg)
{
	pool_tids[(long)arg] = syscall(SYS_gettid);
	pool_late[(long)arg] = fp_pool_wait();
	return NULL;
}

static uint64_t next_random(uint64_t *state)
{
	*state ^= *state << 13;
	*state ^= *state >> 7;
	*state ^= *state << 17;
	return *state;
}

static int run_random(double seconds, long min_us, long max_us, long burn_ms)
{
	pthread_t thread;
	if (min_us < 1 || max_us < min_us || burn_ms < 0)
		return 2;
	if (pthread_create(&thread, NULL, burner, (void *)burn_ms) != 0)
		return 1;
	uint64_t seed = 0x9e3779b97f4a7c15ULL ^ (uint64_t)getpid();
	int64_t end = clock_ns(CLOCK_MONOTONIC) + (int64_t)(seconds * 1e9), total = 0;
	double squares = 0;
	long blocks = 0;
	while (clock_ns(CLOCK_MONOTONIC) < end) {
		int64_t want = (min_us + (int64_t)(next_random(&seed) % (uint64_t)(max_us - min_us + 1))) * 1000;
		int64_t t0 = clock_ns(CLOCK_MONOTONIC);
		if (fp_block_here(want) != 0)
			return 1;
		int64_t took = clock_ns(CLOCK_MONOTONIC) - t0;
		total += took;
		squares += (double)took * (double)took;
		blocks++;
	}
	pthread_join(thread, NULL); /* long done: BURN_MS is small against SECONDS */
	printf("{\"tid\": %ld, \"blocks\": %ld, \"blocked_ns\": %lld, \"blocked_sq_ns2\": %.17g, \"burner_tid\": %ld}\n",
	       (long)syscall(SYS_gettid), blocks, (long long)total, squares, burner_tid);
	return 0;
}

static int run_mixed(double seconds, long min_us, long max_us, long burn_us, long pool)
{
	pthread_t threads[64];
	if (min_us < 1 || max_us < min_us || burn_us < 1 || pool < 0 || pool > 64)
		return 2;
	for (long i = 0; i < pool; i++)
		if (pthread_create(&threads[i], NULL, pool_thread, (void *)i) != 0)
			return 1;
	uint64_t seed = 0x2545f4914f6cdd1dULL ^ (uint64_t)getpid();
	int64_t end = clock_ns(CLOCK_MONOTONIC) + (int64_t)(seconds * 1e9), blocked = 0, burned = 0;
	double squares = 0;
	long blocks = 0;
	while (clock_ns(CLOCK_MONOTONIC) < end) {
		int64_t t0 = clock_ns(CLOCK_MONOTONIC);
		fp_burn_cpu(burn_us * 1000);
		int64_t t1 = clock_ns(CLOCK_MONOTONIC);
		int64_t want = (min_us + (int64_t)(next_random(&seed) % (uint64_t)(max_us - min_us + 1))) * 1000;
		if (fp_block_here(want) != 0)
			return 1;
		int64_t took = clock_ns(CLOCK_MONOTONIC) - t1;
		burned += t1 - t0;
		blocked += took;
		squares += (double)took * (double)took;
		blocks++;
	}
	pool_stop = 1;
	int64_t pool_late_ns = 0;
	for (long i = 0; i < pool; i++) {
		pthread_join(threads[i], NULL);
		pool_late_ns += pool_late[i];
	}
	printf("{\"tid\": %ld, \"blocks\": %ld, \"blocked_ns\": %lld, \"blocked_sq_ns2\": %.17g, \"burned_ns\": %lld, "
	       "\"pool_late_ns\": %lld, \"pool_tids\": [",
	       (long)syscall(SYS_gettid), blocks, (long long)blocked, squares, (long long)burned,
	       (long long)pool_late_ns);
	for (long i = 0; i < pool; i++)
		printf("%s%ld", i ? ", " : "", pool_tids[i]);
	printf("]}\n");
	return 0;
}

static int run_once(long ms)
{
	int64_t before = clock_ns(CLOCK_MONOTONIC);
	if (fp_block_here(ms * 1000000) != 0)
		return 1;
	int64_t after = clock_ns(CLOCK_MONOTONIC);
	printf("{\"tid\": %ld, \"before_ns\": %lld, \"after_ns\": %lld}\n", (long)syscall(SYS_gettid),
	       (long long)before, (long long)after);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 6 && !strcmp(argv[1], "random"))
		return run_random(atof(argv[2]), atol(argv[3]), atol(argv[4]), atol(argv[5]));
	if (argc == 3 && !strcmp(argv[1], "once"))
		return run_once(atol(argv[2]));
	if (argc == 7 && !strcmp(argv[1], "mixed"))
		return run_mixed(atof(argv[2]), atol(argv[3]), atol(argv[4]), atol(argv[5]), atol(argv[6]));
	fprintf(stderr, "usage: %s random SECONDS MIN_US MAX_US BURN_MS | once MS | mixed SECONDS MIN_US MAX_US BURN_US POOL\n",
		argv[0]);
	return 2;
}
