"""Python workload with known hot functions for the Python-stack tests; measures its own split.

usage: python py_story.py SECONDS SHARE_PERCENT [threads [gated]]

Single-threaded: outer() -> middle() -> a list comprehension takes SHARE_PERCENT of the CPU time and
decoy() the rest. With "threads": two threads, alpha_worker() (pure Python) and beta_worker()
(hashing, GIL released), each for SECONDS of its own CPU time. Prints the measured thread CPU time
of each part as JSON on exit. "gated": the threads start once a line comes on stdin, and the process
exits once stdin closes (a test describes it first and looks at it last while it lives).
"""

import hashlib
import json
import signal
import sys
import threading
import time


def spin(n):
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


COMPREHENSION_NS = [0]


def middle(n):
    t0 = time.thread_time_ns()
    squares = [i * i % 7 for i in range(n)]  # the hot line: tests look for this line number
    COMPREHENSION_NS[0] += time.thread_time_ns() - t0
    total = sum(squares)
    # Freed here, in middle()'s frame: freed by the return, it would be freed after the interpreter
    # switched to outer()'s frame, and middle()'s share would fall short of outer()'s truth by ~1.5 points.
    del squares
    return total


def outer(n):
    return middle(n)


def decoy(n):
    return spin(n)


STOP = [False]  # SIGUSR1: end the story before its SECONDS (a driver sizing the run by its samples)


def story(seconds, share):
    signal.signal(signal.SIGUSR1, lambda *_: STOP.__setitem__(0, True))
    outer_ns = decoy_ns = 0
    seed = 12345
    start = time.thread_time_ns()
    while not STOP[0] and time.thread_time_ns() - start < seconds * 1e9:
        # Chunks of 1-4 ms of varying size, so the split does not beat in step with the sampling clock.
        seed = (seed * 1103515245 + 12345) % 2**31
        chunk = 3000 + seed % 9000
        t0 = time.thread_time_ns()
        outer(chunk * share // 10)
        t1 = time.thread_time_ns()
        decoy(chunk * (100 - share) // 10)
        t2 = time.thread_time_ns()
        outer_ns += t1 - t0
        decoy_ns += t2 - t1
    return {
        "outer_ns": outer_ns,
        "comprehension_ns": COMPREHENSION_NS[0],
        "decoy_ns": decoy_ns,
        "total_ns": time.thread_time_ns() - start,
    }


def alpha_worker(seconds, out):
    start = time.thread_time_ns()
    while time.thread_time_ns() - start < seconds * 1e9:
        spin(20000)
    out["alpha_tid"] = threading.get_native_id()
    out["alpha_ns"] = time.thread_time_ns() - start


def beta_worker(seconds, out):
    # hashlib releases the GIL on large buffers: both threads burn CPU at the same time, so a walker that
    # followed the GIL holder instead of the sampled thread would credit these samples to alpha_worker.
    data = b"x" * (1 << 20)
    start = time.thread_time_ns()
    while time.thread_time_ns() - start < seconds * 1e9:
        hashlib.sha256(data).digest()
    out["beta_tid"] = threading.get_native_id()
    out["beta_ns"] = time.thread_time_ns() - start


def main():
    seconds, share = float(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "threads":
        gated = len(sys.argv) > 4 and sys.argv[4] == "gated"
        if gated:  # the threads start on "go"; the process exits once stdin closes, after the last look
            sys.stdin.readline()
        out = {}
        threads = [threading.Thread(target=f, args=(seconds, out)) for f in (alpha_worker, beta_worker)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(json.dumps(out), flush=True)
        if gated:
            sys.stdin.read()
    else:
        print(json.dumps(story(seconds, share)))


if __name__ == "__main__":
    main()
