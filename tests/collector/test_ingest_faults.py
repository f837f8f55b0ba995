"""Ingest under faults and races, over real gRPC with the agent's real Shipper: a batch the store cannot log
is not acknowledged and comes back, a resend racing its original counts once, and windows outside the
collector's clock bounds are refused with a counted reason."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import grpc
import pytest

from fleetprof.agent.shipper import Shipper
from fleetprof.collector.ingest.service import IngestService
from fleetprof.collector.ingest.validate import IngestLimits
from fleetprof.collector.main import Collector, CollectorConfig
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.store.memory import MemoryStore
from tests.conftest import free_port, wait_until
from tests.support.stores import Faults, open_durable, stored_samples
from tests.support.wire import make_batch, push


def test_batches_the_store_cannot_log_are_resent_by_the_agent_and_count_once(tmp_path: Path) -> None:
    faults = Faults()
    store = open_durable(tmp_path, flush_s=0.2, wal_write=faults.write)
    config = CollectorConfig(grpc="127.0.0.1:0", http=f"127.0.0.1:{free_port()}")
    col = Collector(config, store=store, ids=store.ids)
    col.start()
    shipper = Shipper(f"127.0.0.1:{col.grpc_port}", backoff_s=(0.05, 0.2))
    shipper.start()
    try:
        expected = 0
        for i in range(1, 11):
            shipper.submit(make_batch(0, "agent-disk", count=i))
            expected += i
        assert shipper.flush(30)
        faults.wal = errno.ENOSPC  # the disk is full: nothing more can be logged
        for i in range(11, 21):
            shipper.submit(make_batch(0, "agent-disk", count=i))
            expected += i
        wait_until(lambda: col.ingest.stats.deferred >= 3, 30, "the collector to refuse batches")
        assert shipper.pending() == 10  # none of them was acknowledged
        faults.wal = None  # space is back
        assert shipper.flush(30), "the agent's queue did not drain after the disk was freed"
        assert shipper.stats.batches_dropped == 0 and shipper.stats.batches_rejected == 0
        assert col.ingest.stats.batches == 20
        assert stored_samples(store) == expected
    finally:
        shipper.stop(flush_timeout_s=0)
        col.stop()
    again = open_durable(tmp_path, background=False)
    assert stored_samples(again) == expected
    again.close()


class SlowStore(MemoryStore):
    """The real in-memory store, with each write held until the test lets it go: the window in which a
    resend on a new stream races the original's handler."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, profile: ProfileRows) -> None:
        self.entered.set()
        assert self.release.wait(10)
        super().write(profile)


def test_a_resend_racing_its_original_is_stored_once() -> None:
    store = SlowStore()
    service = IngestService(store, ids=ContentIds())
    batch = make_batch(7, "agent-race", count=100)
    results: list[bool] = []
    first = threading.Thread(target=lambda: results.append(service.ingest(batch)))
    first.start()
    assert store.entered.wait(10)
    second = threading.Thread(target=lambda: results.append(service.ingest(batch)))
    second.start()
    time.sleep(0.2)  # give the resend time to get past a check it should not pass (old code did)
    store.release.set()
    first.join(10)
    second.join(10)
    assert sorted(results) == [False, True]
    assert service.stats.duplicates == 1
    assert stored_samples(store) == 100


@pytest.mark.parametrize(
    "shift_s,reason",
    [(+3600.0, "clock_skew"), (-3 * 3600.0, "stale"), (-40 * 365 * 86400.0, "stale")],
    ids=["an-hour-ahead", "three-hours-old", "epoch"],
)
def test_windows_outside_the_clock_bounds_are_rejected_with_a_counted_reason(
    collector, shift_s: float, reason: str
) -> None:
    b = make_batch(1, "agent-clock")
    b.start_unix_ns += int(shift_s * 1e9)
    b.end_unix_ns += int(shift_s * 1e9)
    with pytest.raises(grpc.RpcError) as err:
        push(collector.grpc_target, [b])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch 1:" in err.value.details() and "clock" in err.value.details()
    assert collector.collector.ingest.stats.rejected == {reason: 1}
    ok = make_batch(2, "agent-clock")
    assert push(collector.grpc_target, [ok]) == [2]  # a window within bounds still goes through


def test_the_in_memory_dedupe_state_forgets_batches_older_than_the_resend_horizon() -> None:
    now = [time.time()]
    service = IngestService(
        MemoryStore(), IngestLimits(max_batch_age_s=600.0), clock=lambda: now[0], ids=ContentIds()
    )
    for seq in range(1, 5000):
        assert service.ingest(make_batch(seq, f"agent-{seq % 50}"))
    assert service._seen.agents == 50
    now[0] += 700  # every window so far is now past the horizon; one more agent sends
    for seq in range(1, 4200):
        b = make_batch(seq, "agent-new")
        b.start_unix_ns += 700 * 10**9
        b.end_unix_ns += 700 * 10**9
        assert service.ingest(b)
    assert service._seen.agents == 1  # the 50 silent agents are gone
