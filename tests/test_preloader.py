"""Symbol preloading off the process-event thread: processes started since the agent go first."""

from __future__ import annotations

import threading

from agent.symbols.maps import parse_maps
from agent.symbols.preloader import Preloader

MAPS = parse_maps("55d0c0000000-55d0c0001000 r-xp 00001000 08:01 1234 /usr/bin/worker\n")


class RecordingSymbolizer:
    def __init__(self, fail_pid: int | None = None) -> None:
        self.pids: list[int] = []
        self.fail_pid = fail_pid
        self.done = threading.Event()

    def preload(self, pid: int, mappings) -> None:  # noqa: ANN001
        self.pids.append(pid)
        if pid == self.fail_pid:
            raise OSError("unreadable")
        if pid == 99:
            self.done.set()


def test_processes_started_since_the_agent_are_preloaded_before_the_backlog() -> None:
    symbols = RecordingSymbolizer()
    pre = Preloader(symbols, started_ticks=1000)  # type: ignore[arg-type]
    for pid, ticks in [(1, 10), (2, 999), (3, 1000), (4, 20), (5, 5000), (99, 1)]:
        pre.submit(pid, ticks, MAPS)
    assert pre.pending() == 6
    pre.start()
    assert symbols.done.wait(5)
    pre.stop()
    assert symbols.pids == [3, 5, 1, 2, 4, 99]  # new ones first, each group in arrival order
    assert pre.pending() == 0


def test_a_failed_preload_does_not_stop_the_others_and_stop_ends_the_thread() -> None:
    symbols = RecordingSymbolizer(fail_pid=1)
    pre = Preloader(symbols, started_ticks=0)  # type: ignore[arg-type]
    pre.start()
    pre.submit(1, 5, MAPS)
    pre.submit(99, 5, MAPS)
    assert symbols.done.wait(5)
    pre.stop()
    assert symbols.pids == [1, 99]
    assert not any(t.name == "symbol-preload" for t in threading.enumerate())
