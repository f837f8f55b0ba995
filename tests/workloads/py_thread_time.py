"""Python that spends its CPU in time.thread_time(), for tests/e2e/test_vdso_e2e.py.

usage: python py_thread_time.py WARM_S CPU_S

warm_up: plain Python for WARM_S seconds of wall time (the agent describes the process meanwhile). Then
poll_cpu_clock: time.thread_time() until CPU_S seconds of this thread's CPU time went by. CPython reads
clock_gettime(CLOCK_THREAD_CPUTIME_ID), which has no vDSO fast path: the vDSO makes the syscall, so most
samples of poll_cpu_clock have their user IP in [vdso].
"""

import sys
import time


def warm_up(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(2000))


def poll_cpu_clock(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def main():
    warm_up(float(sys.argv[1]))
    poll_cpu_clock(float(sys.argv[2]))


if __name__ == "__main__":
    main()
