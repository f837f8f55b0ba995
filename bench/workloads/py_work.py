"""CPU-bound Python for bench/python.py: outer() -> middle() -> a list comprehension, and decoy().

usage: python py_work.py SECONDS  -> prints "ITERATIONS WALL_NS CPU_NS"
"""

import sys
import time


def spin(n):
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def middle(n):
    return sum([i * i % 7 for i in range(n)])


def outer(n):
    return middle(n)


def decoy(n):
    return spin(n)


def main():
    seconds = float(sys.argv[1])
    n = 0
    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
    while time.monotonic_ns() - start < seconds * 1e9:
        outer(7000)
        decoy(3000)
        n += 1
    print(n, time.monotonic_ns() - start, time.thread_time_ns() - cpu0)


if __name__ == "__main__":
    main()
