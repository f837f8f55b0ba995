/* Thousands of short-lived threads that block and die (tests/agent/test_offcpu_bpf.py: no per-task state left).
 *
 *   offcpu_thread_kill ROUNDS THREADS
 *       Per round, forks a child that starts THREADS threads: every fourth blocks 1 ms and exits by itself;
 *       the rest block for good (half in read() on a pipe nobody writes, half in a 10 s clock_nanosleep).
 *       Once all have started (and the short ones have exited), the parent SIGKILLs the child while the
 *       others are blocked, and reaps it. Prints the children's pids, one a line.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int ready[2], never[2];

static void *blocker(void *arg)
{
	long i = (long)arg;
	char byte = 'r';
	if (i % 4 == 3) {
		struct timespec ms = {0, 1000000};
		nanosleep(&ms, NULL);
		if (write(ready[1], &byte, 1) != 1)
			_exit(1);
		return NULL; /* a thread that blocked, then exited on its own */
	}
	if (write(ready[1], &byte, 1) != 1)
		_exit(1);
	if (i % 2 == 0) {
		(void)!read(never[0], &byte, 1);
	} else {
		struct timespec ten = {10, 0};
		nanosleep(&ten, NULL);
	}
	return NULL;
}

static void child(long threads)
{
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, 64 * 1024);
	for (long i = 0; i < threads; i++) {
		pthread_t t;
		if (pthread_create(&t, &attr, blocker, (void *)i) != 0)
			_exit(1);
		pthread_detach(t);
	}
	for (;;)
		pause();
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	long rounds = atol(argv[1]), threads = atol(argv[2]);
	pid_t *pids = calloc(rounds, sizeof(pid_t));
	if (!pids)
		return 1;
	for (long r = 0; r < rounds; r++) {
		char byte;
		if (pipe(ready) != 0 || pipe(never) != 0)
			return 1;
		pid_t pid = fork();
		if (pid < 0)
			return 1;
		if (pid == 0)
			child(threads);
		pids[r] = pid;
		for (long i = 0; i < threads; i++) /* every thread is about to block, or has blocked and exited */
			if (read(ready[0], &byte, 1) != 1)
				return 1;
		struct timespec ms = {0, 3000000};
		nanosleep(&ms, NULL); /* the short ones exit, the others reach their blocking call */
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		close(ready[0]), close(ready[1]), close(never[0]), close(never[1]);
	}
	for (long r = 0; r < rounds; r++)
		printf("%d\n", pids[r]);
	return 0;
}
