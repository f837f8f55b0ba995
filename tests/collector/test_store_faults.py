"""The durable store under disk faults, injected at its two narrow seams (the WAL's write call and named
steps of a DuckDB flush): nothing acknowledged is lost, nothing is counted twice, the log never holds a
torn record in front of good ones, and a failed flush is retried with its chunk queryable meanwhile."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fleetprof.collector.store.base import StoreUnavailable
from fleetprof.collector.store.durable import DurableStore
from fleetprof.collector.store.wal import WriteAheadLog
from tests.support.stores import Clock, Faults, crash, open_durable, rows_of, stored_samples
from tests.support.wire import make_batch

AGENT = "agent-f"


def open_store(path: Path, clock: Clock, faults: Faults, **kw) -> DurableStore:
    return open_durable(
        path,
        clock=clock,
        background=False,
        wal_write=faults.write,
        db_fault=faults.db,
        **kw,
    )


def push(store: DurableStore, seq: int) -> bool:
    """One batch of `seq` samples, as ingest hands it over; raises StoreUnavailable like ingest sees."""
    b = make_batch(seq, AGENT, count=seq)
    payload = b.SerializeToString()
    return store.write_logged(AGENT, seq, payload, rows_of(store, payload))


def cold_total(store: DurableStore) -> int:
    """Through DuckDB plus the uncommitted chunks (the hot tier is skipped for a range this wide)."""
    got = stored_samples(store)
    assert store.counters["cold_queries"] > 0
    return got


def wal_bytes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted((path / "wal").glob("wal-*.log"))}


@pytest.mark.parametrize(
    "err,partial",
    [(errno.EIO, 0), (errno.EIO, 7), (errno.ENOSPC, 0), (errno.ENOSPC, 100)],
    ids=["eio", "eio-after-7-bytes", "enospc", "enospc-after-100-bytes"],
)
def test_a_failed_wal_append_leaves_no_torn_record_and_its_resend_counts_once(
    tmp_path: Path, err: int, partial: int
) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    assert push(store, 1) and push(store, 2)
    before = wal_bytes(tmp_path)
    faults.wal, faults.wal_partial = err, partial
    with pytest.raises(StoreUnavailable, match=os.strerror(err)):
        push(store, 3)
    assert wal_bytes(tmp_path) == before  # the partial bytes were cut off again
    assert not store.seen(AGENT, 3)  # not stored, so not acknowledged: the agent resends it
    assert store.stats()["wal_append_errors"] == 1
    faults.wal = None
    assert push(store, 4)
    assert push(store, 3)  # the resend
    assert not push(store, 3)  # and a second resend is a duplicate
    crash(store)
    store = open_store(tmp_path, clock, faults)
    assert store.replayed == 4  # every record after the failed append is read back too
    assert stored_samples(store) == 1 + 2 + 3 + 4
    store.close()


def test_a_segment_that_cannot_be_truncated_is_closed_and_later_records_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    assert push(store, 1)
    faults.wal, faults.wal_partial = errno.EIO, 30

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "injected: truncate failed")

    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(StoreUnavailable):
        push(store, 2)
    monkeypatch.undo()
    faults.wal = None
    assert push(store, 3) and push(store, 2)
    assert len(wal_bytes(tmp_path)) == 2  # the torn tail stays in the first segment, alone
    crash(store)
    store = open_store(tmp_path, clock, faults)
    assert store.replayed == 3
    assert stored_samples(store) == 1 + 2 + 3
    store.close()


@pytest.mark.parametrize("step", ["definitions", "rows", "commit"])
def test_a_failed_flush_keeps_its_chunk_queryable_and_its_wal_until_a_retry_commits_it(
    tmp_path: Path, step: str
) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    for seq in (1, 2):
        assert push(store, seq)
    faults.db_step = step
    with pytest.raises(OSError, match="injected"):
        store.flush()
    assert store.counters["flush_errors"] == 1
    assert cold_total(store) == 3  # the failed chunk still answers queries
    for seq in (3, 4):
        assert push(store, seq)  # the WAL still takes batches
    with pytest.raises(OSError, match="injected"):
        store.flush()  # the newer chunk waits behind the failed one
    assert store.stats()["backlog_rows"] == 4  # one sample row a batch
    segments = wal_bytes(tmp_path)
    assert len(segments) == 2  # a successful flush would have deleted them: nothing is committed
    faults.db_step = None
    store.flush()
    assert wal_bytes(tmp_path) == {}
    assert cold_total(store) == 1 + 2 + 3 + 4
    crash(store)
    store = open_store(tmp_path, clock, faults)
    assert store.replayed == 0
    assert stored_samples(store) == 10
    store.close()


def test_a_crash_while_a_flush_is_failing_loses_nothing(tmp_path: Path) -> None:
    """The loss the issue measured: a later successful flush used to delete the failed chunk's segments."""
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    assert push(store, 1)
    faults.db_step = "rows"
    with pytest.raises(OSError):
        store.flush()
    faults.db_step = None
    assert push(store, 2)
    crash(store)  # before any retry
    store = open_store(tmp_path, clock, faults)
    assert store.replayed == 2
    assert stored_samples(store) == 3
    store.close()


def test_a_commit_that_went_through_but_reported_an_error_is_not_inserted_twice(tmp_path: Path) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    for seq in (1, 2, 3):
        assert push(store, seq)
    faults.db_step = "committed"
    with pytest.raises(OSError):
        store.flush()
    faults.db_step = None
    store.flush()
    assert cold_total(store) == 6
    store.close()
    store = open_store(tmp_path, clock, faults)
    assert stored_samples(store) == 6
    store.close()


def test_batches_are_refused_while_the_flush_backlog_is_at_its_bound(tmp_path: Path) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults, max_backlog_rows=2)
    faults.db_step = "rows"
    for seq in (1, 2):
        assert push(store, seq)
        with pytest.raises(OSError):
            store.flush()
    with pytest.raises(StoreUnavailable, match="wait for the database"):
        push(store, 3)
    faults.db_step = None
    store.flush()
    assert push(store, 3)
    store.flush()
    assert cold_total(store) == 6
    store.close()


def test_close_with_a_failing_database_leaves_the_batches_to_the_wal(tmp_path: Path) -> None:
    clock, faults = Clock(3_000_000.0), Faults()
    store = open_store(tmp_path, clock, faults)
    assert push(store, 5)
    faults.db_step = "rows"
    store.close()  # logs, does not raise
    faults.db_step = None
    store = open_store(tmp_path, clock, faults)
    assert store.replayed == 1
    assert stored_samples(store) == 5
    store.close()


def test_dedupe_entries_older_than_the_resend_horizon_are_forgotten(tmp_path: Path) -> None:
    faults = Faults()
    clock = Clock(make_batch(1).start_unix_ns / 1e9)
    store = open_store(tmp_path, clock, faults, resend_horizon_s=600.0)
    for seq in (1, 2):
        assert push(store, seq)
    store.flush()
    clock.t += 300
    store.maintain()
    assert store.seen(AGENT, 1)
    assert store.stats()["dedupe_entries"] == 2
    clock.t += 400  # the batches' windows are now older than the horizon: a resend would be stale
    store.maintain()
    assert not store.seen(AGENT, 1)
    assert store.stats()["dedupe_entries"] == 0
    store.close()
    store = open_store(tmp_path, clock, faults, resend_horizon_s=600.0)
    assert store.stats()["dedupe_entries"] == 0  # gone from the database too
    store.close()


def test_the_wal_replays_records_across_segments_in_order(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.append("a", 1, b"one")
    wal.rotate()
    wal.rotate()  # an empty segment is never created
    wal.append("a", 2, b"two")
    wal.close()
    assert len(list(tmp_path.glob("wal-*.log"))) == 2
    again = WriteAheadLog(tmp_path)
    assert [(r.sequence, r.payload) for r in again.replay()] == [(1, b"one"), (2, b"two")]
