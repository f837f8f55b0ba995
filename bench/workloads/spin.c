/* A deterministic CPU-bound workload for bench/overhead.py.
 *
 *   spin run SECONDS   hash records until SECONDS of wall time pass; print "RECORDS ELAPSED_NS CPU_NS CHECKSUM"
 *   spin burn MS       burn MS milliseconds of this thread's CPU time, then exit (a short-lived process)
 *
 * Built with -O2 -fno-omit-frame-pointer; the call chain main -> run_batch -> hash_record -> mix_block is
 * kept (noinline) so a profiler sees a realistic, walkable user stack.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLOCK_WORDS 256
#define RECORDS_PER_BATCH 32

static uint64_t block[BLOCK_WORDS];
static volatile uint64_t sink; /* keeps burn()'s work observable to the optimiser */

static int64_t clock_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* xorshift-multiply fold of one block; the multiply chain keeps the core busy without touching memory. */
__attribute__((noinline)) static uint64_t mix_block(const uint64_t *words, size_t n, uint64_t seed)
{
	uint64_t h = seed ^ 0x9e3779b97f4a7c15ULL;
	for (size_t i = 0; i < n; i++) {
		h ^= words[i];
		h *= 0xff51afd7ed558ccdULL;
		h ^= h >> 33;
	}
	return h;
}

/* One record: perturb the block deterministically, then hash it. */
__attribute__((noinline)) static uint64_t hash_record(uint64_t record)
{
	block[record % BLOCK_WORDS] += record;
	return mix_block(block, BLOCK_WORDS, record) + record; /* not a tail call: keeps this frame */
}

__attribute__((noinline)) static uint64_t run_batch(uint64_t first)
{
	uint64_t sum = 0;
	for (int i = 0; i < RECORDS_PER_BATCH; i++)
		sum += hash_record(first + (uint64_t)i);
	return sum;
}

static int run(double seconds)
{
	int64_t start = clock_ns(CLOCK_MONOTONIC);
	int64_t deadline = start + (int64_t)(seconds * 1e9);
	uint64_t records = 0, checksum = 0;
	int64_t now;
	do {
		checksum ^= run_batch(records);
		records += RECORDS_PER_BATCH;
		now = clock_ns(CLOCK_MONOTONIC);
	} while (now < deadline);
	printf("%llu %lld %lld %llx\n", (unsigned long long)records, (long long)(now - start),
	       (long long)clock_ns(CLOCK_PROCESS_CPUTIME_ID), (unsigned long long)checksum);
	return 0;
}

static int burn(double ms)
{
	int64_t deadline = clock_ns(CLOCK_THREAD_CPUTIME_ID) + (int64_t)(ms * 1e6);
	uint64_t records = 0, checksum = 0;
	while (clock_ns(CLOCK_THREAD_CPUTIME_ID) < deadline) {
		checksum ^= run_batch(records);
		records += RECORDS_PER_BATCH;
	}
	sink = checksum;
	return 0;
}

int main(int argc, char **argv)
{
	for (int i = 0; i < BLOCK_WORDS; i++)
		block[i] = (uint64_t)i * 0x2545f4914f6cdd1dULL;
	if (argc == 3 && strcmp(argv[1], "run") == 0)
		return run(atof(argv[2]));
	if (argc == 3 && strcmp(argv[1], "burn") == 0)
		return burn(atof(argv[2]));
	fprintf(stderr, "usage: %s run SECONDS | burn MS\n", argv[0]);
	return 2;
}
