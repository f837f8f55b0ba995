/* The gate of a workload whose start a test holds back (GATE=1 in its environment): gate_spin() burns CPU,
 * so that the profiler samples the process and describes it, until a line arrives on stdin; the part the
 * workload measures starts after it. Without GATE the workload starts at once. Its samples stay in
 * gate_spin, apart from the functions the tests judge. */
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

static volatile unsigned long gate_sink;

__attribute__((noinline)) static void gate_spin(void)
{
	struct pollfd in = {.fd = 0, .events = POLLIN};
	char line[64];
	while (poll(&in, 1, 0) == 0)
		for (unsigned long i = 0; i < 200000; i++)  /* ~1 ms a round: a poll per round costs nothing */
			gate_sink += i * i ^ (gate_sink >> 3);
	if (fgets(line, sizeof line, stdin) == NULL) { /* EOF: go on */ }
}

/* SIGUSR1 ends the measured part early (stop_early): a driver that sizes a run by the samples the profiler
 * has of it (tests/support/arm64_guest_driver.py) stops it there; the part's own CPU time is its cap. */
static volatile sig_atomic_t stop_early;

static void on_stop(int sig)
{
	(void)sig;
	stop_early = 1;
}

static void gate_if_asked(void)
{
	signal(SIGUSR1, on_stop);
	if (getenv("GATE"))
		gate_spin();
}
