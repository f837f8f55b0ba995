"""Python whose frames come and go in every shape, for bench/mixed_node.py: asyncio tasks (coroutine frames
live in their coroutine objects), generator pipelines, worker threads started and ended, and clock reads
through the vDSO (time.thread_time issues its syscall from there).

usage: python py_async.py SECONDS
"""

import asyncio
import sys
import threading
import time


def numbers(n):
    for i in range(n):
        yield i * 7 % 11


def squares(source):
    for x in source:
        yield x * x


def pipeline(n):
    return sum(squares(numbers(n)))


def clocked(n):
    spent = 0.0
    for _ in range(n):
        t0 = time.thread_time()
        spent += time.thread_time() - t0
    return spent


async def task(k):
    total = 0
    for _ in range(20):
        total += pipeline(3000 + k)
        await asyncio.sleep(0)
    return total


async def rounds(end):
    while time.monotonic() < end:
        await asyncio.gather(*(task(k) for k in range(8)))
        clocked(2000)


def worker(end):
    while time.monotonic() < end:
        pipeline(20000)
        clocked(500)
        time.sleep(0.01)


def main():
    seconds = float(sys.argv[1])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        # Threads that live a few seconds each: thread states are created and freed as the run goes on.
        part = min(end, time.monotonic() + 3)
        threads = [threading.Thread(target=worker, args=(part,)) for _ in range(2)]
        for t in threads:
            t.start()
        asyncio.run(rounds(part))
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()
