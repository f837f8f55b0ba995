"""Python that keeps making code objects while it runs, for bench/mixed_node.py: every round it writes a
new module, imports it (and reloads an older one), and spends its CPU in the new module's functions, so
most of its samples run code objects created after the agent first described the process.

usage: python py_importer.py SECONDS DIR
"""

import importlib
import sys
import time

MODULE = """
def churn_{n}(k):
    total = 0
    for i in range(k):
        total += (i * {n}) % 13
    return total


def step_{n}(rounds):
    return sum(churn_{n}(2000) for _ in range(rounds))
"""


def main():
    seconds, where = float(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, where)
    end = time.monotonic() + seconds
    loaded = []
    n = 0
    while time.monotonic() < end:
        n += 1
        with open(f"{where}/gen_{n}.py", "w") as f:
            f.write(MODULE.format(n=n))
        importlib.invalidate_caches()
        mod = importlib.import_module(f"gen_{n}")
        loaded.append(mod)
        if len(loaded) > 3:
            importlib.reload(loaded[-4])  # new code objects for an old module; the old ones freed
        stop = time.monotonic() + 0.2
        while time.monotonic() < stop:
            getattr(mod, f"step_{n}")(5)


if __name__ == "__main__":
    main()
