"""The agent's shipper against a real collector: queue while it is down, resend, never duplicate."""

from __future__ import annotations

import uuid
from concurrent import futures

import grpc

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.agent.shipper import Shipper
from fleetprof.collector.main import Collector, CollectorConfig
from tests.conftest import RunningCollector, free_port, samples_of, wait_until
from tests.support.wire import make_batch


def test_batches_queued_while_the_collector_is_down_arrive_exactly_once_after_it_starts() -> None:
    grpc_port, http_port = free_port(), free_port()
    shipper = Shipper(f"127.0.0.1:{grpc_port}", backoff_s=(0.05, 0.2))
    shipper.start()
    agent_id = uuid.uuid4().hex
    try:
        for i in range(5):
            shipper.submit(make_batch(agent_id=agent_id, count=i + 1))  # shipper assigns 1..5
        wait_until(lambda: shipper.stats.send_errors >= 2, 10, "the shipper to notice the collector is down")
        assert shipper.pending() == 5

        col = Collector(CollectorConfig(grpc=f"127.0.0.1:{grpc_port}", http=f"127.0.0.1:{http_port}"))
        col.start()
        try:
            assert shipper.flush(15), "queued batches were not acknowledged after the collector started"
            running = RunningCollector(col)
            assert samples_of(running.folded('{comm="worker"}')) == 1 + 2 + 3 + 4 + 5
            # New batches flow on the same stream.
            shipper.submit(make_batch(agent_id=agent_id, count=100))
            assert shipper.flush(10)
            assert samples_of(running.folded('{comm="worker"}')) == 115
            assert shipper.stats.batches_acked == 6
        finally:
            col.stop()
    finally:
        shipper.stop(flush_timeout_s=0)


def test_collector_restart_mid_stream_loses_nothing_and_counts_nothing_twice() -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = CollectorConfig(grpc=f"127.0.0.1:{grpc_port}", http=f"127.0.0.1:{http_port}")
    col = Collector(cfg)
    col.start()
    shipper = Shipper(f"127.0.0.1:{grpc_port}", backoff_s=(0.05, 0.2))
    shipper.start()
    agent_id = uuid.uuid4().hex
    try:
        shipper.submit(make_batch(agent_id=agent_id, count=10))
        assert shipper.flush(10)
        col.stop()
        for _ in range(3):
            shipper.submit(make_batch(agent_id=agent_id, count=1))
        # A new collector (empty memory store) receives the three that were never acknowledged.
        col = Collector(cfg)
        col.start()
        assert shipper.flush(15)
        assert samples_of(RunningCollector(col).folded('{comm="worker"}')) == 3
    finally:
        shipper.stop(flush_timeout_s=0)
        col.stop()


def test_a_batch_the_collector_rejects_is_dropped_and_the_rest_still_arrive(
    collector: RunningCollector,
) -> None:
    shipper = Shipper(collector.grpc_target, backoff_s=(0.05, 0.2))
    shipper.start()
    agent_id = uuid.uuid4().hex
    try:
        shipper.submit(make_batch(agent_id=agent_id, count=2))
        bad = make_batch(agent_id=agent_id, count=3)
        bad.sample_columns.stack[0] = 9  # refers to a stack that does not exist
        shipper.submit(bad)
        shipper.submit(make_batch(agent_id=agent_id, count=4))
        assert shipper.flush(15)
        assert shipper.stats.batches_rejected == 1
        assert samples_of(collector.folded('{comm="worker"}')) == 6
    finally:
        shipper.stop(flush_timeout_s=0)


def test_queue_is_bounded_while_the_collector_stays_down() -> None:
    shipper = Shipper(f"127.0.0.1:{free_port()}", max_batches=3, backoff_s=(0.05, 0.1))
    shipper.start()
    try:
        for _ in range(10):
            shipper.submit(make_batch())
        assert shipper.pending() == 3
        assert shipper.stats.batches_dropped == 7
    finally:
        shipper.stop(flush_timeout_s=0)


def test_a_batch_over_the_transport_limit_is_dropped_not_resent_forever() -> None:
    from tests.conftest import start_collector

    col = start_collector(max_batch_bytes=1024)  # gRPC's own limit is 4x: 4 KiB
    shipper = Shipper(f"127.0.0.1:{col.grpc_port}", backoff_s=(0.05, 0.2))
    shipper.start()
    try:
        huge = make_batch(count=1)
        huge.strings.extend(f"f{i:08d}" for i in range(1000))
        shipper.submit(huge)
        shipper.submit(make_batch(count=2))
        assert shipper.flush(15)
        assert shipper.stats.batches_rejected == 1
        assert samples_of(RunningCollector(col).folded('{comm="worker"}')) == 2
    finally:
        shipper.stop(flush_timeout_s=0)
        col.stop()


class UnreadableSecond(pb_grpc.IngestServicer):
    """A collector's Push at the gRPC boundary, in the real shape: acks every batch but refuses the second
    one it ever receives as unreadable, with the message ingest gives bytes it cannot parse (it names no
    batch number)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def Push(self, request_iterator, context):
        for batch in request_iterator:
            self.received.append(batch.sequence)
            if len(self.received) == 2:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "batch (unreadable): 16 bytes are not a fleetprof.v1.Batch message (Error parsing)",
                )
            yield pb.Ack(sequence=batch.sequence)


def test_a_batch_refused_as_unreadable_is_dropped_once_not_resent_forever() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    collector = UnreadableSecond()
    pb_grpc.add_IngestServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    shipper = Shipper(f"127.0.0.1:{port}", backoff_s=(0.05, 0.2))
    shipper.start()
    try:
        for i in range(4):
            shipper.submit(make_batch(count=i + 1))
        assert shipper.flush(15), f"{shipper.pending()} batches never settled"
        assert shipper.stats.batches_rejected == 1 and shipper.stats.batches_acked == 3
        assert collector.received.count(2) == 1  # refused once, dropped: never sent again
        assert sorted(set(collector.received)) == [1, 2, 3, 4]
    finally:
        shipper.stop(flush_timeout_s=0)
        server.stop(0)
