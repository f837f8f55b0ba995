"""The in-memory recent-window store: bucketing, selection, label index, retention and compaction."""

from __future__ import annotations

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.memory import MemoryStore
from tests.stores import Clock

MAIN, HOT, COLD = FrameKey("main", "app"), FrameKey("hot", "app"), FrameKey("cold", "app")


def labels(pid: int, comm: str = "app", node: str = "n1") -> tuple:
    return (("comm", comm), ("node", node), ("pid", str(pid)))


def window(t: float, rows: list, freq: int = 19) -> ProfileRows:
    return ProfileRows.from_rows(t - 10, t, freq, rows)


def test_select_merges_matching_label_sets_within_the_range() -> None:
    clock = Clock(10_000.0)
    st = MemoryStore(clock=clock)
    st.write(window(9_990, [(labels(1), (MAIN, HOT), 5), (labels(2, "db"), (MAIN, COLD), 7)]))
    st.write(window(10_000, [(labels(1), (MAIN, HOT), 3), (labels(1), (MAIN, COLD), 1)]))
    every = st.select(parse_selector("{}"), 9_900, 10_000)
    assert every.stacks == {(MAIN, HOT): 8, (MAIN, COLD): 8}
    assert every.frequency_hz == 19
    app = st.select(parse_selector('{comm="app"}'), 9_900, 10_000)
    assert app.stacks == {(MAIN, HOT): 8, (MAIN, COLD): 1}
    only_last = st.select(parse_selector("{}"), 9_995, 10_000)
    assert only_last.stacks == {(MAIN, HOT): 3, (MAIN, COLD): 1}
    assert st.label_values("comm") == ["app", "db"]
    assert st.label_names() == ["comm", "node", "pid"]


def test_retention_drops_old_buckets_and_compaction_forgets_their_stacks_and_labels() -> None:
    clock = Clock(0.0)
    st = MemoryStore(retention_s=900, clock=clock)
    # Every window a new process with its own stack: what a fork-heavy node looks like.
    for i in range(200):
        clock.t = 10.0 * (i + 1)
        st.write(window(clock.t, [(labels(1000 + i), (MAIN, FrameKey(f"f{i}")), 1)]))
    kept = st.stats()
    assert kept["buckets"] <= 900 / 10 + 2
    # Compaction runs every 30 expired buckets, so what is interned stays near what is retained.
    assert kept["stacks"] <= kept["buckets"] + MemoryStore.COMPACT_EVERY
    assert kept["label_sets"] <= kept["buckets"] + MemoryStore.COMPACT_EVERY
    recent = st.select(parse_selector("{}"), clock.t - 100, clock.t)
    assert sum(recent.stacks.values()) == 10  # windows whose midpoint falls in the last 100 s
    assert (MAIN, FrameKey("f199")) in recent.stacks
    assert st.select(parse_selector('{pid="1000"}'), 0, clock.t).stacks == {}


def test_the_recent_window_is_at_least_15_minutes() -> None:
    with pytest.raises(ValueError, match="15 minutes"):
        MemoryStore(retention_s=60)
