/* A process that lays out, in its own memory, what the BPF CPython walker follows (agent/bpf/python_stack.h),
 * with 3.12's offsets (agent/python/offsets.py TABLE), and spins: tests/agent/test_python_walk_guards.py registers
 * it with the walker and checks what the walk does with a frame chain that is fine, that comes round
 * (stale frames pointing back), or that holds a stale frame (its code is no code object).
 *
 *   fake_cpython ok|cycle|stale|bad_owner SECONDS
 * Prints one JSON line (the addresses of the fake _PyRuntime and PyCode_Type, the code objects in chain
 * order), then spins for SECONDS of its own CPU time in the sampled thread whose tid the fake thread state holds.
 *
 *   ok         frames A -> B -> C, then the end of the chain
 *   cycle      A -> B -> C -> B -> C ...: C's previous frame is B again
 *   stale      A -> B -> C, but B's code object is not one (its ob_type is not PyCode_Type)
 *   bad_owner  A -> B -> C, but B's owner byte is 9 (out of range: freed memory)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* 3.12 offsets: runtime.interpreters.head 40, interp.threads.head 72, tstate.next 8, native_thread_id 144,
 * tstate.cframe 56 -> cframe.current_frame 0; frame: code 0, previous 8, prev_instr 56, owner 70; code:
 * ob_type 8, qualname 128. */
static uint64_t runtime[16], interp[32], tstate[64], cframe[4];
static uint64_t frames[3][16], codes[3][40], code_type[8], other_type[8];
static volatile uint64_t sink;

static void frame(int i, int prev, uint8_t owner)
{
	frames[i][0] = (uint64_t)(uintptr_t)codes[i];
	frames[i][1] = prev < 0 ? 0 : (uint64_t)(uintptr_t)frames[prev];
	frames[i][7] = (uint64_t)(uintptr_t)codes[i] + 200; /* prev_instr: into the code object */
	((uint8_t *)frames[i])[70] = owner;
	codes[i][1] = (uint64_t)(uintptr_t)code_type; /* ob_type */
	codes[i][16] = 0x5000 + 0x10 * i;            /* co_qualname: only its bits are recorded */
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: fake_cpython ok|cycle|stale|bad_owner SECONDS\n");
		return 2;
	}
	const char *mode = argv[1];
	runtime[5] = (uint64_t)(uintptr_t)interp;
	interp[9] = (uint64_t)(uintptr_t)tstate;
	tstate[18] = (uint64_t)syscall(SYS_gettid);
	tstate[7] = (uint64_t)(uintptr_t)cframe;
	cframe[0] = (uint64_t)(uintptr_t)frames[0];
	frame(0, 1, 0);
	frame(1, 2, 0);
	frame(2, strcmp(mode, "cycle") == 0 ? 1 : -1, 0);
	if (strcmp(mode, "stale") == 0)
		codes[1][1] = (uint64_t)(uintptr_t)other_type;
	else if (strcmp(mode, "bad_owner") == 0)
		((uint8_t *)frames[1])[70] = 9;
	else if (strcmp(mode, "ok") != 0 && strcmp(mode, "cycle") != 0)
		return 2;
	printf("{\"runtime\": %llu, \"code_type\": %llu, \"codes\": [%llu, %llu, %llu]}\n",
	       (unsigned long long)(uintptr_t)runtime, (unsigned long long)(uintptr_t)code_type,
	       (unsigned long long)(uintptr_t)codes[0], (unsigned long long)(uintptr_t)codes[1],
	       (unsigned long long)(uintptr_t)codes[2]);
	fflush(stdout);
	/* SECONDS of this thread's own CPU time, not of the wall: the test's sample counts follow the CPU it got,
	 * and a busy machine gives it less per second (58 samples in 2 s of wall once, beside two CPU burners).
	 * The wall bounds it at 30x, so a starved run ends (with too few samples, and the test says so). */
	struct timespec now, cpu;
	clock_gettime(CLOCK_MONOTONIC, &now);
	double want = atof(argv[2]), wall_end = now.tv_sec + now.tv_nsec / 1e9 + 30 * want;
	do {
		for (int i = 0; i < 100000; i++)
			sink += i ^ (sink >> 3);
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while (cpu.tv_sec + cpu.tv_nsec / 1e9 < want && now.tv_sec + now.tv_nsec / 1e9 < wall_end);
	return 0;
}
