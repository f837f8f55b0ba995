"""Symbol preloading off the process-event thread."""

from __future__ import annotations

import threading

from fleetprof.agent.symbols.maps import parse_maps
from fleetprof.agent.symbols.preloader import Preloader

MAPS = parse_maps("55d0c0000000-55d0c0001000 r-xp 00001000 08:01 1234 /usr/bin/worker\n")


class RecordingSymbolizer:
    def __init__(self, fail_pid: int) -> None:
        self.pids: list[int] = []
        self.fail_pid = fail_pid
        self.done = threading.Event()

    def preload(self, pid: int, mappings) -> None:
        self.pids.append(pid)
        if pid == self.fail_pid:
            raise OSError("unreadable")
        if pid == 99:
            self.done.set()


def test_preloads_run_in_order_a_failure_stops_none_and_stop_ends_the_thread() -> None:
    symbols = RecordingSymbolizer(fail_pid=1)
    pre = Preloader(symbols)  # type: ignore[arg-type]
    for pid in (3, 1, 2):
        pre.submit(pid, MAPS)
    assert pre.pending() == 3
    pre.start()
    pre.submit(99, MAPS)
    assert symbols.done.wait(5)
    pre.stop()
    assert symbols.pids == [3, 1, 2, 99]
    assert pre.pending() == 0
    assert not any(t.name == "symbol-preload" for t in threading.enumerate())
