/* A thread blocked on a pipe that another process fills slowly (tests/agent/test_offcpu_bpf.py).
 *
 *   offcpu_pipe BYTES INTERVAL_MS
 *       Forks a writer that writes one byte every INTERVAL_MS, BYTES times, then exits. A reader thread
 *       (fp_pipe_reader) reads them one at a time until end of file. Prints JSON with the reader's tid,
 *       the writer's pid and the bytes read.
 *
 * fp_pipe_reader reads through fp_read_byte, which calls glibc's read(): glibc keeps no frame pointer, so
 * a frame walk from inside read() skips read's caller (fp_read_byte) and goes on from fp_pipe_reader.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int fds[2];
static long reader_tid, got;

__attribute__((noinline)) long fp_read_byte(int fd, char *byte)
{
	return read(fd, byte, 1);
}

__attribute__((noinline)) void *fp_pipe_reader(void *arg)
{
	char byte;
	(void)arg;
	reader_tid = syscall(SYS_gettid);
	while (fp_read_byte(fds[0], &byte) == 1)
		got++;
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	long bytes = atol(argv[1]), interval_ms = atol(argv[2]);
	if (pipe(fds) != 0)
		return 1;
	pid_t writer = fork();
	if (writer < 0)
		return 1;
	if (writer == 0) {
		struct timespec pause = {interval_ms / 1000, (interval_ms % 1000) * 1000000L};
		char byte = 'x';
		close(fds[0]);
		for (long i = 0; i < bytes; i++) {
			nanosleep(&pause, NULL);
			if (write(fds[1], &byte, 1) != 1)
				_exit(1);
		}
		_exit(0);
	}
	close(fds[1]);
	pthread_t thread;
	if (pthread_create(&thread, NULL, fp_pipe_reader, NULL) != 0)
		return 1;
	pthread_join(thread, NULL);
	int status;
	waitpid(writer, &status, 0);
	printf("{\"reader_tid\": %ld, \"writer_pid\": %d, \"bytes\": %ld}\n", reader_tid, (int)writer, got);
	return got == bytes && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
