/* Starts N short-lived processes in batches of BATCH and SIGKILLs each while it is blocked in a syscall:
 * even children in read() on a pipe nobody writes, odd ones in a 10 s clock_nanosleep. Prints the pids
 * of the children, one a line, once all are reaped.
 * usage: fork_kill N BATCH */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The process's state in /proc/PID/stat is S: it sleeps in the only call it can sleep in here. */
static int asleep(pid_t pid)
{
	char path[64], buf[512];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	char *end = strrchr(buf, ')'); /* after the comm, which may hold anything */
	return end && end[1] == ' ' && end[2] == 'S';
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	long n = atol(argv[1]), batch = atol(argv[2]);
	pid_t *pids = calloc(n, sizeof(pid_t));
	if (!pids || batch < 1)
		return 2;
	for (long done = 0; done < n; done += batch) {
		long size = done + batch > n ? n - done : batch;
		int ready[2], block[2];
		char byte = 'r';
		if (pipe(ready) != 0 || pipe(block) != 0)
			return 1;
		for (long i = 0; i < size; i++) {
			pid_t pid = fork();
			if (pid < 0)
				return 1;
			if (pid == 0) {
				struct timespec ten = {10, 0};
				if (write(ready[1], &byte, 1) != 1)
					_exit(1);
				if ((done + i) % 2 == 0)
					(void)!read(block[0], &byte, 1);
				else
					syscall(SYS_clock_nanosleep, CLOCK_MONOTONIC, 0, &ten, NULL);
				_exit(0);
			}
			pids[done + i] = pid;
		}
		for (long i = 0; i < size; i++) /* every child is about to block (or already is) */
			if (read(ready[0], &byte, 1) != 1)
				return 1;
		/* ... and now blocks: asleep in its call (a fixed 2 ms let one of 3,000 be killed before it
		 * got there, in a fresh-clone run on a loaded machine) */
		for (long i = 0; i < size; i++)
			while (!asleep(pids[done + i]))
				usleep(100);
		for (long i = 0; i < size; i++)
			kill(pids[done + i], SIGKILL);
		for (long i = 0; i < size; i++)
			waitpid(pids[done + i], NULL, 0);
		close(ready[0]), close(ready[1]), close(block[0]), close(block[1]);
	}
	for (long i = 0; i < n; i++)
		printf("%d\n", pids[i]);
	return 0;
}
