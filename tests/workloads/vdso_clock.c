/* Code whose CPU goes through the vDSO, or through JIT-like memory, for tests/agent/test_vdso_jit.py.
 *
 *   vdso_clock clock WARM_S CPU_S
 *       warm_up: a plain loop for WARM_S seconds of wall time (the agent describes the process and builds
 *       its tables meanwhile; any walk finds the loop, it is the leaf). Then clock_burn: reads
 *       clock_gettime(CLOCK_THREAD_CPUTIME_ID) until CPU_S seconds of this thread's CPU time went by. That
 *       clock has no vDSO fast path: glibc enters the vDSO, which makes the syscall, so nearly every sample
 *       of clock_burn has its user IP in [vdso] and its callers only behind it.
 *   vdso_clock jit WARM_S CPU_S
 *   vdso_clock jit-nofp WARM_S CPU_S
 *       makes an anonymous executable page (mmap, code copied there, mprotect: what a JIT does), then
 *       warm_up as above, then jit_run calls into the page, whose code calls back into jit_callback, a loop
 *       that burns CPU_S seconds of CPU in total. The page is made before the warm-up so that the agent has
 *       heard of it (its unmapped-code event, then a re-read of the mappings) before the part measured: a
 *       walk taken before that ends at the page's address, as it must for code nobody has described yet. "jit": the page's code keeps a frame pointer (push rbp; mov rbp, rsp); "jit-nofp":
 *       it keeps rbp but zeroed while it calls (as JIT code that uses rbp for itself), so no frame-pointer
 *       walk can get past it.
 * With GATE=1 the measured part waits, after the warm-up, for a line on stdin (gate.h).
 * Prints nothing; exits 0. Built with -O2 -fomit-frame-pointer (tests/conftest.py no_fp_bin): only
 * call-frame information leads out of clock_burn, jit_callback and jit_run. The jit modes are x86-64 only
 * (their page holds x86-64 code); clock runs on arm64 too (tests/e2e/test_arm64_guest.py).
 */
#include "gate.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static volatile uint64_t sink;

static int64_t now_ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

__attribute__((noinline)) void warm_up(double seconds)
{
	int64_t end = now_ns(CLOCK_MONOTONIC) + (int64_t)(seconds * 1e9);
	while (now_ns(CLOCK_MONOTONIC) < end)
		for (int i = 0; i < 200000; i++)
			sink += i * i ^ (sink >> 3);
}

__attribute__((noinline)) void clock_burn(double seconds)
{
	struct timespec ts;
	int64_t start = now_ns(CLOCK_THREAD_CPUTIME_ID), spent = 0;
	while (!stop_early && spent < (int64_t)(seconds * 1e9)) {
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
		spent = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec - start;
	}
}

static int64_t jit_start, jit_budget;
static int jit_done;

/* Called from the JIT page: burns CPU until the budget is spent, 10 ms of CPU a call. */
__attribute__((noinline)) void jit_callback(void)
{
	int64_t stop = now_ns(CLOCK_THREAD_CPUTIME_ID) + 10000000;
	while (now_ns(CLOCK_THREAD_CPUTIME_ID) < stop)
		for (int i = 0; i < 20000; i++)
			sink += i * i ^ (sink >> 3);
	if (now_ns(CLOCK_THREAD_CPUTIME_ID) - jit_start >= jit_budget)
		jit_done = 1;
}

/* The page's code: [push rbp; mov rbp, rsp | push rbp; xor ebp, ebp]; movabs rax, jit_callback; call rax;
 * pop rbp; ret. */
static void (*make_jit(int frame_pointer))(void)
{
	static const uint8_t with_fp[] = {0x55, 0x48, 0x89, 0xe5};
	static const uint8_t without_fp[] = {0x55, 0x31, 0xed, 0x90};
	uint8_t code[32], *p = code;
	memcpy(p, frame_pointer ? with_fp : without_fp, 4);
	p += 4;
	*p++ = 0x48;
	*p++ = 0xb8;
	uint64_t target = (uint64_t)(uintptr_t)&jit_callback;
	memcpy(p, &target, 8);
	p += 8;
	*p++ = 0xff;
	*p++ = 0xd0;
	*p++ = 0x5d;
	*p++ = 0xc3;
	void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (page == MAP_FAILED)
		return NULL;
	memcpy(page, code, (size_t)(p - code));
	if (mprotect(page, 4096, PROT_READ | PROT_EXEC) != 0)
		return NULL;
	return (void (*)(void))page;
}

__attribute__((noinline)) int jit_run(void (*jitted)(void), double seconds)
{
	jit_start = now_ns(CLOCK_THREAD_CPUTIME_ID);
	jit_budget = (int64_t)(seconds * 1e9);
	while (!jit_done)
		jitted();
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: vdso_clock clock|jit|jit-nofp WARM_S CPU_S\n");
		return 2;
	}
	double warm = atof(argv[2]), cpu = atof(argv[3]);
	if (strcmp(argv[1], "clock") == 0) {
		warm_up(warm);
		gate_if_asked();
		clock_burn(cpu);
		return 0;
	}
	if (strcmp(argv[1], "jit") == 0 || strcmp(argv[1], "jit-nofp") == 0) {
		void (*jitted)(void) = make_jit(strcmp(argv[1], "jit") == 0);
		if (!jitted)
			return 1;
		warm_up(warm);
		gate_if_asked();
		int rc = jit_run(jitted, cpu);
		sink++; /* after the call: main stays on the stack (no tail call) */
		return rc;
	}
	fprintf(stderr, "unknown mode %s\n", argv[1]);
	return 2;
}
