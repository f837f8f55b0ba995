"""The durable store (WAL + hot tier + DuckDB): same answers as the in-memory store, across restarts,
rollups and retention."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.validate import UNREPLAYABLE_STACK
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.profile import FrameKey, SyscallAgg
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.cold.maintenance import RollupPolicy
from fleetprof.collector.store.durable import DurableStore
from fleetprof.collector.store.memory import MemoryStore
from fleetprof.collector.store.wal import WriteAheadLog
from tests.support.stores import EVERYTHING, Clock, crash, open_durable, rows_of, stored_samples
from tests.support.wire import BatchBuilder, make_batch, packed_ints, unpack

MAIN, HOT, COLD = FrameKey("main", "app"), FrameKey("hot", "app"), FrameKey("cold", "app")
KERNEL = FrameKey("do_syscall_64", "", True)
IDS = ContentIds()  # the rows' own: a store keeps rows by the ids they come with, under any key


def labels(pid: int, comm: str = "app", node: str = "n1", pod: str = "") -> tuple:
    lb = {"comm": comm, "node": node, "pid": str(pid)}
    if pod:
        lb["pod"] = pod
    return tuple(sorted(lb.items()))


def window(t: float, rows: list, syscalls: list = (), freq: int = 19) -> ProfileRows:
    return ProfileRows.from_rows(t - 10, t, freq, rows, list(syscalls), ids=IDS)


def open_store(path: Path, clock: Clock, **kw) -> DurableStore:
    return open_durable(path, clock=clock, background=False, **kw)


def fill(store, t0: float) -> None:
    store.write(
        window(
            t0,
            [(labels(1, pod="web-1"), (MAIN, HOT), 5), (labels(2, "db"), (MAIN, COLD, KERNEL), 7)],
            [(labels(1, pod="web-1"), "read", SyscallAgg(10, 2, 3000, [0, 0, 1, 1]))],
        )
    )
    store.write(
        window(
            t0 + 10,
            [(labels(1, pod="web-1"), (MAIN, HOT), 3), (labels(1, pod="web-1"), (), 2)],
            [(labels(1, pod="web-1"), "read", SyscallAgg(5, 1, 100, [1]))],
        )
    )


QUERIES = ["{}", '{comm="app"}', '{comm!="app"}', '{pod=~"web-.*"}', '{comm="nothing"}']


def answers(store, t0: float) -> list:
    out = []
    for q in QUERIES:
        sel = parse_selector(q)
        for lo, hi in ((t0 - 100, t0 + 20), (t0 + 5, t0 + 20)):
            s = store.select(sel, lo, hi)
            g = store.group(sel, lo, hi, ["comm", "pod"])
            sc = store.syscalls(sel, lo, hi, ["pod", "syscall"])
            ts = [store.series(sel, lo, hi, step, ["comm"]) for step in (10, 20, 3600)]
            out.append((s.stacks, s.frequency_hz, g.totals, {k: vars(v) for k, v in sc.items()}))
            out.append([(t.points, t.frequency_hz) for t in ts])
            # Every step's points add up to the group's totals.
            by_comm = {k: sum(v.values()) for k, v in ts[0].points.items()}
            assert by_comm == store.group(sel, lo, hi, ["comm"]).totals
    out.append((store.label_names(t0 - 100, t0 + 20), store.label_values("comm", t0 - 100, t0 + 20)))
    return out


def test_cold_answers_equal_the_in_memory_store_before_and_after_a_flush(tmp_path: Path) -> None:
    t0 = 1_000_000.0
    clock = Clock(t0 + 30)
    mem = MemoryStore(clock=clock)
    fill(mem, t0)
    expected = answers(mem, t0)
    assert expected[0][0] == {(MAIN, HOT): 8, (MAIN, COLD, KERNEL): 7, (): 2}
    store = open_store(tmp_path, clock)
    fill(store, t0)
    assert answers(store, t0) == expected  # from the pending chunk
    store.flush()
    assert store.stats()["rows_samples"] > 0 and store.stats()["pending_rows"] == 0
    assert answers(store, t0) == expected  # from DuckDB
    assert store.counters["cold_queries"] > 0
    store.close()
    again = open_store(tmp_path, clock)
    assert answers(again, t0) == expected  # after a clean restart
    again.close()


def test_recent_queries_are_answered_by_the_hot_tier_with_the_same_result(tmp_path: Path) -> None:
    clock = Clock(2_000_000.0)
    store = open_store(tmp_path, clock)
    t0 = clock.t + 15
    clock.t = t0 + 40
    fill(store, t0)
    store.flush()
    before = store.counters["hot_queries"]
    got = store.select(EVERYTHING, t0 - 5, clock.t)
    assert store.counters["hot_queries"] == before + 1
    assert got.stacks == {(MAIN, HOT): 8, (MAIN, COLD, KERNEL): 7, (): 2}
    store.close()


def test_logged_batches_survive_a_crash_and_resends_after_it_count_once(tmp_path: Path) -> None:
    clock = Clock(3_000_000.0)
    store = open_store(tmp_path, clock)
    batches = [make_batch(seq, "agent-x", count=seq) for seq in range(1, 7)]
    for b in batches[:3]:
        assert store.write_logged(
            "agent-x", b.sequence, b.SerializeToString(), rows_of(store, b.SerializeToString())
        )
    store.flush()  # 1..3 in the database
    for b in batches[3:]:
        assert store.write_logged(
            "agent-x", b.sequence, b.SerializeToString(), rows_of(store, b.SerializeToString())
        )
    assert not store.write_logged(
        "agent-x", 2, batches[1].SerializeToString(), rows_of(store, batches[1].SerializeToString())
    )
    crash(store)  # 4..6 only in the WAL
    clock.t += 5
    store = open_store(tmp_path, clock)
    assert store.replayed == 3
    for b in batches:  # the agent resends everything it may not have seen acknowledged
        assert store.seen("agent-x", b.sequence)
    total = stored_samples(store)
    assert total == sum(range(1, 7))
    crash(store)  # the replayed batches were committed at start: a second crash replays nothing
    store = open_store(tmp_path, clock)
    assert store.replayed == 0
    assert stored_samples(store) == 21
    store.close()


def test_rollup_keeps_totals_and_retention_deletes_old_buckets(tmp_path: Path) -> None:
    day = 86400.0
    clock = Clock(10 * day)
    store = open_store(tmp_path, clock, retention_s=4 * day, rollup=RollupPolicy(raw_s=3600.0, minute_s=day))
    # One 10 s window every 10 min for 5 days: each window has its own pid and stack.
    start = clock.t - 5 * day
    n = 0
    for i in range(int(5 * day // 600)):
        t = start + 600 * i + 10
        store.write(
            window(
                t,
                [(labels(100 + i % 7), (MAIN, FrameKey(f"f{i % 11}")), 2)],
                [(labels(100 + i % 7), "write", SyscallAgg(3, 1, 50, [0, 1]))],
            )
        )
        n += 1
    store.flush()
    full = store.select(EVERYTHING, 0, clock.t + 10).stacks
    store.maintain()
    rows = store.stats()
    horizon = clock.t - 4 * day
    kept = sum(
        2 for i in range(n) if (start + 600 * i + 10 - 5) // 600 * 600 + 600 > horizon
    )  # rough bound below: rows expire by whole 10 min buckets
    total = sum(store.select(EVERYTHING, 0, clock.t + 10).stacks.values())
    assert 0 < total < sum(full.values())
    assert abs(total - kept) <= 2
    # Tier by tier: the last hour is still at 10 s, the rest of the last day at 1 min, older at 10 min.
    res = dict(store._db.cursor().execute("SELECT res, count(*) FROM samples GROUP BY res").fetchall())
    assert set(res) == {10, 60, 600}
    oldest = store._db.cursor().execute("SELECT min(bucket) FROM samples").fetchone()[0]
    assert oldest + 600 > horizon
    # Totals over a day-old range are the same from rolled-up rows as the written windows.
    lo, hi = clock.t - 2 * day, clock.t - day
    expected = sum(2 for i in range(n) if lo <= (start + 600 * i + 5) // 600 * 600 <= hi)
    assert abs(sum(store.select(EVERYTHING, lo, hi).stacks.values()) - expected) <= 2
    sc = store.syscalls(EVERYTHING, 0, clock.t + 10, ["syscall"])
    assert sc[("write",)].count * 2 == 3 * total and sc[("write",)].hist[1] * 2 == total
    assert rows["rows_label_sets"] <= 7 and rows["rows_stacks"] <= 11
    store.close()


def test_a_torn_record_at_the_end_of_the_wal_is_ignored(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.append("a", 1, b"one")
    wal.append("a", 2, b"two")
    wal.close()
    seg = sorted(tmp_path.glob("wal-*.log"))[-1]
    seg.write_bytes(seg.read_bytes()[:-2])  # killed in the middle of the second write
    again = WriteAheadLog(tmp_path)
    assert [(r.source, r.sequence, r.payload) for r in again.replay()] == [("a", 1, b"one")]


@pytest.mark.parametrize("fsync", [False, True])
def test_wal_rotation_and_drop(tmp_path: Path, fsync: bool) -> None:
    wal = WriteAheadLog(tmp_path, fsync=fsync)
    wal.append("a", 1, b"x")
    closed = wal.rotate()
    wal.append("a", 2, b"y")
    wal.drop_through(closed)
    wal.close()
    assert [r.sequence for r in WriteAheadLog(tmp_path).replay()] == [2]


def test_a_frame_shared_by_stacks_is_stored_once_and_stacks_read_back_in_order(tmp_path: Path) -> None:
    clock = Clock(1_700_000_000.0)
    store = open_store(tmp_path, clock)
    # Equal frames as distinct objects (as after a restart or from two decoders), in two windows.
    a = (FrameKey("main", "app"), FrameKey("leaf", "app"), FrameKey("main", "app"))
    b = (FrameKey("main", "app"), FrameKey("leaf", "app", True))
    store.write(window(clock.t, [(labels(1), a, 3), (labels(1), (), 1)]))
    store.write(window(clock.t, [(labels(2), b, 4), (labels(1), a, 2)]))
    store.flush()
    con = store._db.con
    assert con.execute("SELECT count(*), count(DISTINCT id) FROM frames").fetchone() == (3, 3)
    assert con.execute("SELECT count(*), count(DISTINCT id) FROM stacks").fetchone() == (3, 3)
    store.close()
    store = open_store(tmp_path, clock)
    got = store._queries.stacks_of(store._db.con.execute("SELECT id FROM stacks").fetchnumpy()["id"].tolist())
    assert sorted(got.values(), key=len) == [(), b, a]
    store.close()


def test_stacks_decoded_by_ingest_and_stacks_it_knew_are_stored_alike(tmp_path: Path) -> None:
    """The flush takes the definitions of stacks ingest decoded from the columns it computed them with,
    and reads the others' frames: a stack the decoder learned from a batch dropped as a duplicate comes
    back only as known, and must be stored all the same, each frame once."""
    clock = Clock(1_700_000_000.0)
    store = open_store(tmp_path, clock)
    decoder = Decoder(store.ids)
    main, work, leaf, sys = ("main", "app"), ("work", "app"), ("leaf", "lib"), ("do_syscall_64", "")
    shapes = {
        "s1": ([main, work], None),
        "s2": ([main, leaf, sys], 2),
        "s3": ([main, work, leaf, sys, sys], 3),
        "s4": ([leaf, main], None),
        "s5": ([work], None),
    }

    def push(agent: str, seq: int, names: list[str]) -> bool:
        b = BatchBuilder("node-a", agent, seq, end_ns=int(clock.t * 1e9))
        proc = b.process(42, "worker")
        for n, name in enumerate(names):
            b.sample(proc, b.stack(*shapes[name]), n + 1)
        payload = b.build().SerializeToString()
        return store.write_logged(agent, seq, payload, decoder.decode_payload(payload))

    assert push("a", 1, ["s1", "s2"])  # decoded
    assert not push("a", 1, ["s3"])  # decoded, then dropped as a duplicate: its rows never stored
    assert push("a", 2, ["s3", "s1"])  # both known to the decoder now: no columns for s3
    assert push("b", 1, ["s1", "s4", "s5"])  # s1 new to agent b: decoded again, with s4 and s5
    store.flush()
    store.close()

    def frames(name: str) -> tuple:
        fs, ks = shapes[name]
        ks = len(fs) if ks is None else ks
        return tuple(FrameKey(f, m, i >= ks) for i, (f, m) in enumerate(fs))

    store = open_store(tmp_path, clock)
    con = store._db.con
    sids = con.execute("SELECT id FROM stacks").fetchnumpy()["id"].tolist()
    assert sorted(store._queries.stacks_of(sids).values()) == sorted(frames(n) for n in shapes)
    # main, work, leaf, and do_syscall_64 as a kernel frame: each once
    assert con.execute("SELECT count(*), count(DISTINCT id) FROM frames").fetchone() == (4, 4)
    store.close()


@pytest.mark.parametrize("form", ["packed", "messages"])
def test_a_batch_that_reused_known_ids_for_other_content_replays_with_its_samples(
    form: str, tmp_path: Path
) -> None:
    """Ingest finds stacks and processes an agent sent before by their wire ids and decodes nothing of them;
    a restart replays the log on an empty cache, which decodes them all. A batch that sent, under known ids,
    a stack past the depth limit and a process whose comm is out of the string table was accepted with the
    content known under those ids; its replay keeps every sample, under a stand-in where its own content
    does not decode (once: a restarting collector exited on such a batch). A logged batch that does not
    decode at all is left out, logged and counted, and the batches after it are replayed."""
    clock = Clock(1_700_000_000.0)
    store = open_store(tmp_path, clock)
    decoder = Decoder(store.ids)

    def batch(seq: int, count: int) -> pb.Batch:
        b = BatchBuilder("node-a", "a", seq, end_ns=int(clock.t * 1e9))
        b.sample(b.process(42, "worker"), b.stack([("main", "app"), ("work", "app")]), count)
        return b.build()

    def push(b: pb.Batch) -> None:
        payload = b.SerializeToString()
        assert store.write_logged("a", b.sequence, payload, decoder.decode_payload(payload))

    push(batch(1, 3))
    store.flush()  # committed: the replay skips it, so its ids are unknown there
    hostile = batch(2, 5)
    if form == "packed":  # past the depth limit, under the known wire id
        hostile.stack_columns.frames += packed_ints([0] * 5000)
        hostile.stack_columns.lengths = packed_ints([5002])
    else:
        unpack(hostile).stacks[0].functions.extend([1] * 5000)
        hostile.stacks[0].modules.extend([2] * 5000)
    hostile.processes[0].comm = 1000  # out of the string table, under the known wire id
    push(hostile)  # accepted: both found by wire id
    broken = batch(3, 7)
    broken.sample_columns.stack[0] = 9  # no such stack: no cache makes it decode
    store.write_logged("a", 3, broken.SerializeToString(), rows_of(store, batch(3, 7).SerializeToString()))
    push(batch(4, 11))
    crash(store)
    store = open_store(tmp_path, clock)
    assert (store.replayed, store.replay_refused) == (2, 1)
    got = store.select(EVERYTHING, 0, 4e9).stacks
    stand_in = (FrameKey(UNREPLAYABLE_STACK, ""),)
    assert got == {(MAIN, FrameKey("work", "app")): 3 + 11, stand_in: 5}, got
    assert stored_samples(store) == 3 + 5 + 11
    store.close()


def test_a_cold_query_during_a_commit_counts_the_chunk_once(tmp_path: Path) -> None:
    """A query that lands between a chunk's commit and its removal from the flush queue must not read it
    from both (it once counted 268 samples of 134). The commit is held open here until the query ran or
    waited a while: either way its answer counts every sample once."""
    t0 = 1_000_000.0
    store = open_store(tmp_path, Clock(t0 + 30))
    fill(store, t0)
    committed, release = threading.Event(), threading.Event()
    insert = store._writer.insert

    def slow_insert(chunk):
        insert(chunk)
        committed.set()
        release.wait(30)

    store._writer.insert = slow_insert
    flusher = threading.Thread(target=store.flush)
    flusher.start()
    assert committed.wait(30)
    seen: list[int] = []
    query = threading.Thread(target=lambda: seen.append(stored_samples(store)))
    query.start()
    query.join(0.5)  # long enough for an unsynchronised query to have read both copies
    release.set()
    query.join()
    flusher.join()
    assert seen == [17]
    assert stored_samples(store) == 17
    store.close()


def test_a_slow_cold_query_never_stalls_ingest_or_deadlocks_a_flush(tmp_path: Path) -> None:
    """A flush once took the write lock, then waited for the commit lock a cold query held, while the query
    waited for the write lock: ingest and both stopped for good. Now a flush waits without the write lock."""
    t0 = 1_000_000.0
    store = open_store(tmp_path, Clock(t0 + 30))
    fill(store, t0)
    in_query, release = threading.Event(), threading.Event()
    per_key = store._queries.per_key

    def slow_per_key(*args, **kw):
        in_query.set()
        release.wait(120)  # past the writer's wait below: the query must still hold its lock then
        return per_key(*args, **kw)

    store._queries.per_key = slow_per_key
    seen: list[int] = []
    query = threading.Thread(target=lambda: seen.append(stored_samples(store)))
    query.start()
    assert in_query.wait(30)
    flusher = threading.Thread(target=store.flush)
    flusher.start()
    flusher.join(0.2)  # the flush now waits for the query
    writer = threading.Thread(target=store.write, args=(window(t0 + 20, [(labels(3), (MAIN,), 4)]),))
    writer.start()
    writer.join(20)
    ingest_ran = not writer.is_alive()
    release.set()
    query.join(30)
    flusher.join(30)
    assert ingest_ran, "a write waited for a cold query"
    assert not query.is_alive() and not flusher.is_alive(), "the query and the flush deadlocked"
    assert seen == [17]
    store._queries.per_key = per_key
    assert stored_samples(store) == 21
    store.close()
