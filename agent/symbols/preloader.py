"""Loads the symbol tables of newly seen processes on a thread of its own, newest processes first.

Loading one large library's symbols takes up to ~0.5 s (the agent's own libLLVM), so the thread that
reads new processes' descriptions must not do it: a process that starts and ends within that time would
otherwise be described only after it is gone (no labels, no maps). And a backlog of the node's long-running
processes (the agent's start) must not delay a process that started since: it is the one likely to exit,
taking its mount namespace, and so its files, with it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Sequence

from agent.symbols.maps import Mapping
from agent.symbols.symbolizer import Symbolizer

log = logging.getLogger(__name__)

_STOP, _NEW, _OLD = 0, 1, 2  # priorities: lower first


class Preloader:
    """`submit()` from any thread; `start()` and `stop()` own the worker thread."""

    def __init__(self, symbolizer: Symbolizer, started_ticks: int) -> None:
        """`started_ticks`: the agent's own start time (/proc/PID/stat field 22): processes started since
        are preloaded before older ones."""
        self._symbolizer = symbolizer
        self._started_ticks = started_ticks
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO within a priority; never compares mappings
        self._thread: threading.Thread | None = None

    def submit(self, pid: int, start_ticks: int, mappings: Sequence[Mapping]) -> None:
        priority = _NEW if start_ticks >= self._started_ticks else _OLD
        self._queue.put((priority, next(self._order), pid, mappings))

    def pending(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="symbol-preload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put((_STOP, -1, 0, ()))
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            priority, _, pid, mappings = self._queue.get()  # sleeps until work comes: no timer wakes it
            if priority == _STOP:
                return
            self._preload(pid, mappings)

    def _preload(self, pid: int, mappings: Sequence[Mapping]) -> None:
        try:
            self._symbolizer.preload(pid, mappings)
        except Exception:  # one unreadable file must not stop the others' preloading
            log.exception("preloading the symbols of process %d failed", pid)
