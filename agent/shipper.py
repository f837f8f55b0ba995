"""Ships batches to the collector over a gRPC stream; keeps unacknowledged ones and resends them."""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.auth import TokenFile
from fleetprof.tls import ClientTls

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_BATCH_IN_ERROR = re.compile(r"\bbatch (\d+)\b")


@dataclass
class ShipperStats:
    batches_sent: int = 0
    batches_acked: int = 0
    batches_rejected: int = 0  # the collector refused them as invalid: dropped, never resent
    batches_dropped: int = 0  # the queue was full while the collector was unreachable
    send_errors: int = 0
    queued: int = 0
    queued_bytes: int = 0


class Shipper:
    """A bounded queue of batches in flight, drained by one thread that keeps a Push stream open.

    Every batch stays queued until the collector acknowledges its sequence number. After a broken
    stream the thread reconnects (exponential backoff) and resends everything unacknowledged, in
    order; the collector drops duplicates. When the queue exceeds its bounds the oldest batches are
    dropped and counted: the agent never grows without limit while the collector is down.
    """

    def __init__(
        self,
        target: str,
        max_batches: int = 64,
        max_bytes: int = 64 * 1024 * 1024,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        tls: ClientTls | None = None,
        tokens: TokenFile | None = None,
    ):
        self.target = target
        self._tls = tls
        self._tokens = tokens
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._backoff = backoff_s
        self._pending: OrderedDict[int, pb.Batch] = OrderedDict()
        self._sizes: dict[int, int] = {}
        self._lock = threading.Condition()
        self._seq = 0
        self._stop = threading.Event()
        self.stats = ShipperStats()
        self.connected = False
        self._thread = threading.Thread(target=self._run, name="shipper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, batch: pb.Batch) -> int:
        """Queue a batch (assigning its sequence number) and return the number."""
        with self._lock:
            self._seq += 1
            batch.sequence = self._seq
            self._pending[self._seq] = batch
            self._sizes[self._seq] = batch.ByteSize()
            while len(self._pending) > 1 and (
                len(self._pending) > self._max_batches or sum(self._sizes.values()) > self._max_bytes
            ):
                old, _ = self._pending.popitem(last=False)
                self._sizes.pop(old, None)
                self.stats.batches_dropped += 1
                log.warning("collector unreachable: dropped batch %d (queue bound reached)", old)
            self._update_gauges()
            self._lock.notify_all()
            return self._seq

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued batch is acknowledged (or the timeout passes)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout=timeout_s)

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        self.flush(flush_timeout_s)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=5)

    def _update_gauges(self) -> None:
        self.stats.queued = len(self._pending)
        self.stats.queued_bytes = sum(self._sizes.values())

    def _settle(self, seq: int, acked: bool) -> None:
        """Remove a batch from the queue: acknowledged by the collector, or refused and never resent."""
        with self._lock:
            if self._pending.pop(seq, None) is not None:
                self._sizes.pop(seq, None)
                if acked:
                    self.stats.batches_acked += 1
                else:
                    self.stats.batches_rejected += 1
            self._update_gauges()
            self._lock.notify_all()

    def _largest_pending(self) -> int:
        with self._lock:
            return max(self._sizes, key=self._sizes.get, default=0)

    # -- the sending thread ------------------------------------------------------------------------
    def _first_unacked(self, sent: list[int]) -> int | None:
        """The oldest batch sent on this stream and not acknowledged: the one the collector refused (it
        takes a stream's batches in order and ends the stream at the first it refuses)."""
        with self._lock:
            return next((seq for seq in sent if seq in self._pending), None)

    def _requests(self, broken: threading.Event, sent: list[int]) -> Iterator[pb.Batch]:
        """Everything pending (a resend after a reconnect), then what is submitted meanwhile; ends the
        stream once every batch is acknowledged. A stream per flush, not one held open: an open stream
        keeps gRPC's channel thread polling, a fixed CPU cost the agent pays even when idle."""
        sent_upto = 0
        while not broken.is_set() and not self._stop.is_set():
            with self._lock:
                nxt = next((s for s in self._pending if s > sent_upto), None)
                if nxt is None:
                    if not self._pending:
                        return
                    self._lock.wait(timeout=5.0)  # woken by acks and submits
                    continue
                batch = self._pending[nxt]
            sent_upto = nxt
            sent.append(nxt)
            self.stats.batches_sent += 1
            yield batch

    def _channel(self) -> grpc.Channel:
        """A channel to the collector (it reconnects by itself); over TLS with the files as they are now."""
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30000),
        ]
        if self._tls is not None:
            return self._tls.channel(self.target, options)
        return grpc.insecure_channel(self.target, options=options)

    def _run(self) -> None:
        self._chan = self._channel()
        try:
            self._send_loop()
        finally:
            self._chan.close()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._tokens.current()}"),) if self._tokens else ()

    def _send_loop(self) -> None:
        delay = self._backoff[0]
        stub = pb_grpc.IngestStub(self._chan)
        refused_credentials = False
        while not self._stop.is_set():
            if not self._wait_for_work():
                return
            if self._tls is not None and self._tls.changed():
                # A renewed client certificate or CA: the open channel keeps the old one, so make a new one.
                log.info("TLS files changed: reconnecting to %s with them", self.target)
                self._chan.close()
                self._chan = self._channel()
                stub = pb_grpc.IngestStub(self._chan)
            broken = threading.Event()
            sent: list[int] = []
            try:
                call = stub.Push(
                    self._requests(broken, sent), metadata=self._metadata(), wait_for_ready=False
                )
                for ack in call:
                    if not self.connected:
                        log.info("connected to collector %s", self.target)
                    self.connected = True
                    refused_credentials = False
                    delay = self._backoff[0]
                    self._settle(ack.sequence, acked=True)
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                detail = err.details() if hasattr(err, "details") else str(err)
                self.stats.send_errors += 1
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    # The message names the batch ("batch 7: ..."), except when its bytes were unreadable
                    # ("batch (unreadable): ..."); either way it is the first unacknowledged one sent.
                    m = _BATCH_IN_ERROR.search(detail or "")
                    refused = int(m.group(1)) if m else self._first_unacked(sent)
                    if refused is not None:
                        self._settle(refused, acked=False)
                    log.error("collector rejected a batch: %s", detail)
                    delay = self._backoff[0]
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Over the collector's transport limit: the message does not say which batch, and
                    # resending it would fail forever. The largest pending one is the culprit.
                    self._settle(self._largest_pending(), acked=False)
                    log.error("collector refused an oversized batch: %s", detail)
                elif code == grpc.StatusCode.CANCELLED and self._stop.is_set():
                    return
                elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # Our token (or certificate) is refused: keep every batch and retry with backoff, reading
                    # the token file again each time, so a rotated token gets through without a restart.
                    if not refused_credentials:
                        log.error("collector %s refused our credentials (%s): %s", self.target, code, detail)
                    refused_credentials = True
                    self.connected = False
                    self._stop.wait(delay)
                    delay = min(delay * 2, self._backoff[1])
                else:
                    if self.connected or self.stats.send_errors == 1:
                        log.warning("collector %s unreachable (%s): %s; retrying", self.target, code, detail)
                    self.connected = False
                    self._stop.wait(delay)
                    delay = min(delay * 2, self._backoff[1])
            finally:
                broken.set()
                with self._lock:
                    self._lock.notify_all()

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._pending and not self._stop.is_set():
                self._lock.wait(timeout=5.0)  # submit() and stop() notify
            return not self._stop.is_set()
