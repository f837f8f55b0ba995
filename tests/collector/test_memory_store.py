"""The in-memory recent-window store: bucketing, selection, label index, retention and compaction."""

from __future__ import annotations

import threading

import pytest

from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey, SyscallAgg
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.memory import MemoryStore
from tests.support.stores import Clock

MAIN, HOT, COLD = FrameKey("main", "app"), FrameKey("hot", "app"), FrameKey("cold", "app")
IDS = ContentIds()


def labels(pid: int, comm: str = "app", node: str = "n1") -> tuple:
    return (("comm", comm), ("node", node), ("pid", str(pid)))


def window(t: float, rows: list, freq: int = 19) -> ProfileRows:
    return ProfileRows.from_rows(t - 10, t, freq, rows, ids=IDS)


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


class _SlowSelector(Selector):
    """A selector whose matching waits for `release`, as a costly regex over many label sets does."""

    def matches(self, labels) -> bool:
        _entered.set()
        assert _release.wait(60)
        return super().matches(labels)


_entered, _release = threading.Event(), threading.Event()


@pytest.mark.parametrize("query", ["select", "group", "syscalls"])
def test_a_slow_query_holds_up_no_write_and_answers_from_its_view(query: str) -> None:
    """A query's matching once ran under the store's lock: one costly regex stopped ingest for as long as
    it ran. Writes, and a compaction that renumbers every stack and label set, now go on meanwhile, and
    the query answers for what was stored when it began."""
    _entered.clear()
    _release.clear()
    clock = Clock(1_000.0)
    st = MemoryStore(retention_s=900, clock=clock)
    agg = SyscallAgg(4, 1, 1_000, [0, 1])
    st.write(
        ProfileRows.from_rows(
            990, 1_000, 19, [(labels(1), (MAIN, HOT), 5)], [(labels(1), "read", agg)], ids=IDS
        )
    )
    slow = _SlowSelector(parse_selector('{comm=~"a.p"}').matchers)
    answers: list = []
    run = {
        "select": lambda: st.select(slow, 0, 1_000).stacks,
        "group": lambda: st.group(slow, 0, 1_000, ["pid"]).totals,
        "syscalls": lambda: {k: v.count for k, v in st.syscalls(slow, 0, 1_000, ["syscall"]).items()},
    }[query]
    reader = threading.Thread(target=lambda: answers.append(run()))
    reader.start()
    assert _entered.wait(60)
    try:
        # Windows of new processes and stacks until the first one's bucket expired and compaction ran.
        for i in range(1, 91 + MemoryStore.COMPACT_EVERY):
            clock.t = 1_000.0 + 10 * i
            st.write(window(clock.t, [(labels(100 + i), (MAIN, FrameKey(f"f{i}")), 1)]))
        assert "1" not in st.label_values("pid")  # expired and compacted away while the query waited
        assert st.stats()["stacks"] <= st.stats()["buckets"] + MemoryStore.COMPACT_EVERY
    finally:
        _release.set()
    reader.join(60)
    expected = {"select": {(MAIN, HOT): 5}, "group": {("1",): 5}, "syscalls": {("read",): 4}}[query]
    assert answers == [expected]


def test_series_puts_each_bucket_in_the_step_it_starts_in() -> None:
    clock = Clock(10_000.0)
    st = MemoryStore(clock=clock)
    st.write(window(9_960, [(labels(1), (MAIN, HOT), 5), (labels(2, "db"), (MAIN, COLD), 7)]))  # bucket 9950
    st.write(window(9_970, [(labels(1), (MAIN, HOT), 3)]))  # bucket 9960
    st.write(window(9_990, [(labels(1), (MAIN, COLD), 2)]))  # bucket 9980
    by_comm = st.series(parse_selector("{}"), 9_900, 10_000, 20, ["comm"])
    assert by_comm.points == {("app",): {9_940.0: 5, 9_960.0: 3, 9_980.0: 2}, ("db",): {9_940.0: 7}}
    assert by_comm.frequency_hz == 19
    only_app = st.series(parse_selector('{comm="app"}'), 9_955, 10_000, 10, [])
    assert only_app.points == {(): {9_950.0: 5, 9_960.0: 3, 9_980.0: 2}}
    assert st.series(parse_selector('{comm="x"}'), 9_900, 10_000, 10, []).points == {}


def test_until_is_exclusive_the_bucket_starting_at_it_is_out() -> None:
    """A range [from, until) takes the buckets that overlap it: from=t, until=t+10 is one 10 s bucket,
    not the one starting at t+10 as well (the UI's chart picks whole steps that way)."""
    clock = Clock(10_000.0)
    st = MemoryStore(clock=clock)
    st.write(window(9_960, [(labels(1), (MAIN, HOT), 5)]))  # bucket 9950
    st.write(window(9_970, [(labels(1), (MAIN, COLD), 3)]))  # bucket 9960
    assert st.select(parse_selector("{}"), 9_950, 9_960).stacks == {(MAIN, HOT): 5}
    assert st.select(parse_selector("{}"), 9_955, 9_970).stacks == {(MAIN, HOT): 5, (MAIN, COLD): 3}
    assert st.select(parse_selector("{}"), 9_960, 9_960).stacks == {}
