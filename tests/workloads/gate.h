/* The gate of a workload whose start a test holds back (GATE=1 in its environment): gate_spin() burns CPU
 * in short bursts, so that the profiler samples the process and describes it, until a line arrives on
 * stdin; the part the workload measures starts after it. Without GATE the workload starts at once. Its
 * samples stay in gate_spin, apart from the functions the tests judge.
 *
 * A tenth of the time: one sample is all the profiler needs to learn of a process, and under emulation
 * (tests/support/arm64_guest_driver.py) four gates spinning on two vCPUs took the CPU the agent needed to
 * describe them (17.8 s) and cost the host as much. */
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long gate_sink;

static double gate_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

__attribute__((noinline)) static void gate_spin(void)
{
	struct pollfd in = {.fd = 0, .events = POLLIN};
	char line[64];
	for (;;) {
		double until = gate_now() + 0.002;  /* 2 ms of spinning, then 18 ms waiting for the line */
		while (gate_now() < until)
			for (unsigned long i = 0; i < 20000; i++)
				gate_sink += i * i ^ (gate_sink >> 3);
		if (poll(&in, 1, 18) != 0)
			break;
	}
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
