"""Loads the symbol tables of processes that started (or exec'd) since the agent did, on a thread of its own.

Why preload: such a process may exit before the next drain, and with it its mount namespace, so the files
its samples point into. Why its own thread: loading one large library's symbols takes up to ~0.5 s (the
agent's own libLLVM), and the thread that reads new processes' descriptions must not wait on it: a
process that starts and ends within that time would be described only after it is gone (no labels, no
maps). Processes that were running when the agent started are not preloaded: their files load on demand
when a drain symbolizes their samples, and then only the files their samples hit (a Python service maps
~100 shared objects; its stacks touch a handful).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from fleetprof.agent.model import Mapping
from fleetprof.agent.symbols.symbolizer import Symbolizer

log = logging.getLogger(__name__)


class Preloader:
    """`submit()` from any thread; `start()` and `stop()` own the worker thread."""

    def __init__(self, symbolizer: Symbolizer) -> None:
        self._symbolizer = symbolizer
        self._queue: queue.SimpleQueue[tuple[int, Sequence[Mapping]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, pid: int, mappings: Sequence[Mapping]) -> None:
        self._queue.put((pid, mappings))

    def pending(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="symbol-preload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:  # sleeps until work comes: no timer wakes it
            pid, mappings = item
            try:
                self._symbolizer.preload(pid, mappings)
            except Exception:  # one unreadable file must not stop the others' preloading
                log.exception("preloading the symbols of process %d failed", pid)
