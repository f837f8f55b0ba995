"""Has the kernel's module list changed since the last look? /proc/modules, read once a drain.

Kernel symbols (/proc/kallsyms) are parsed once, which takes ~0.5 s; a module loaded later (on a GPU node
often nvidia.ko, loaded by the driver container after the agent started) has no symbols there until they
are read again. The module list says when: each line is `name size refcount deps state address [taint]`.
Only the live modules' names, sizes and load addresses are compared, not their reference counts, which move
whenever a module is used; a module still loading counts once it is live. Reading and splitting the file
costs tens of microseconds for a hundred modules. Without /proc/modules (a kernel built without loadable
modules) there is nothing to follow, and nothing changes.
"""

from __future__ import annotations

MODULES_PATH = "/proc/modules"

ModuleSet = frozenset[tuple[bytes, bytes, bytes]]  # (name, size, load address) of each live module


def read_modules(path: str = MODULES_PATH) -> ModuleSet | None:
    """The live modules, or None where the file cannot be read (no loadable modules)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    live = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[4] == b"Live":
            live.add((fields[0], fields[1], fields[5]))
    return frozenset(live)


class ModuleWatch:
    """`changed()` says whether the live modules differ from the last call's (the first call: from when the
    watch was made). Not thread-safe: one caller (the drain)."""

    def __init__(self, path: str = MODULES_PATH) -> None:
        self._path = path
        self._last = read_modules(path)
        self.changes = 0

    def changed(self) -> bool:
        now = read_modules(self._path)
        if now == self._last:
            return False
        self._last = now
        self.changes += 1
        return True
