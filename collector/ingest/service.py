"""gRPC ingest: each Batch is checked and decoded (decode.py), deduplicated, stored, acknowledged.

A batch is acknowledged only once the store holds it. Rejected batches (invalid) get INVALID_ARGUMENT
naming the batch, and the agent drops them; batches the store cannot take now (StoreUnavailable: disk
full) get UNAVAILABLE, and the agent keeps them and resends them later. Each stream's peer (ingest/peer.py)
says which nodes its batches may name and keys their dedupe state: (peer identity, agent id, sequence).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.collector.ingest.decode import Decoder, source_key
from fleetprof.collector.ingest.gpu import gpu_window
from fleetprof.collector.ingest.peer import ANONYMOUS, Peer, peer_of
from fleetprof.collector.ingest.validate import BatchError, IngestLimits, fail
from fleetprof.collector.model.counters import IngestStats
from fleetprof.collector.model.gpu import GpuWindow
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.store.base import DurableBatches, ProfileStore, StoreUnavailable
from fleetprof.collector.store.sequences import SeenSequences

log = logging.getLogger(__name__)


INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["Ingest"].full_name
_AGENT_LOCKS = 64  # striped: one agent's batches dedupe under one lock, without a lock per agent id
_SAY_EVERY_S = 10.0  # duplicates are logged at most this often, with how many since


class _HeapTrimmer:
    """malloc_trim after a large refused batch, at most every TRIM_EVERY_S. A refused batch keeps nothing
    (decode.py), but its transient memory (the message, tens of thousands of label strings decoded before
    the quota refused them) stays mapped behind other threads' allocations, for good: the trim gives part of
    it back (bench/README.md, attacks). A second of decoding per such batch dwarfs the trim's cost."""

    TRIM_ABOVE = 4 << 20  # batch bytes
    TRIM_EVERY_S = 1.0

    def __init__(self) -> None:
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            self._trim = None
        self._lock = threading.Lock()
        self._last = -self.TRIM_EVERY_S

    def after(self, size: int) -> None:
        if self._trim is None or size < self.TRIM_ABOVE:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.TRIM_EVERY_S:
                return
            self._last = now
        self._trim(0)


class _Duplicates:
    """Logs dropped duplicates: the first at once, later ones summed, at most once per _SAY_EVERY_S. A
    resend after a lost acknowledgement makes one now and then; a stream of them is another agent
    pre-sending this one's sequence numbers, or a replay."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._said_at = -_SAY_EVERY_S
        self._since = 0

    def dropped(self, batch: pb.Batch, peer: Peer) -> None:
        now = self._clock()
        with self._lock:
            self._since += 1
            if now - self._said_at < _SAY_EVERY_S:
                return
            count, self._since, self._said_at = self._since, 0, now
        who = f", authenticated as {peer.identity}" if peer.identity else ""
        log.warning(
            "dropped batch %d of agent %s (node %r%s) as a duplicate of one stored before (acknowledged; %d "
            "duplicate(s) since last said)",
            batch.sequence,
            batch.agent.agent_id,
            batch.agent.node,
            who,
            count,
        )


class IngestService(pb_grpc.IngestServicer):
    def __init__(
        self,
        store: ProfileStore,
        limits: IngestLimits | None = None,
        on_rows: Callable[[ProfileRows], None] | None = None,
        on_gpu: Callable[[GpuWindow], None] | None = None,
        clock: Callable[[], float] = time.time,
        node_binding: str = "certificate",
        *,
        ids: ContentIds,
    ):
        self._store = store
        self._on_rows = on_rows
        self._on_gpu = on_gpu
        self._limits = limits or IngestLimits()
        self._clock = clock
        self._node_binding = node_binding  # "certificate": a client certificate's names bound its nodes
        self._lock = threading.Lock()
        self._agent_locks = [threading.Lock() for _ in range(_AGENT_LOCKS)]
        # The in-memory store's dedupe state (a durable store keeps its own); a resend older than the batch
        # age limit is refused, so entries past it are swept.
        self._seen = SeenSequences(horizon_s=self._limits.max_batch_age_s, clock=clock)
        self._decoder = Decoder(ids, clock)  # ids: the store's (collector/main.py makes them)
        self._duplicates = _Duplicates()
        self._trimmer = _HeapTrimmer()
        self.stats = IngestStats()

    @property
    def stack_counts(self) -> dict[str, int]:
        """Stacks received: "known" (found by wire id) and "decoded" (checked and decoded)."""
        return dict(self._decoder.stacks.counts)

    def cache_sizes(self) -> dict[str, int]:
        """Entries of every table ingest keeps across batches (fleetprof_ingest_cache_entries)."""
        return self._decoder.sizes()

    def _rejected(self, err: BatchError) -> None:
        self.count_rejected(err.reason)

    def count_rejected(self, reason: str) -> None:
        """One more refusal for `reason`: a bad batch's, or "unauthenticated" (a call without the token)."""
        with self._lock:
            self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1

    def ingest(self, batch: pb.Batch, payload: bytes | None = None, peer: Peer = ANONYMOUS) -> bool:
        """Validate and store one batch (`payload`: its wire bytes, when it arrived as bytes; `peer`: who
        sent it); False if it was a duplicate. Raises BatchError (invalid) or StoreUnavailable (valid, but
        not stored now)."""
        durable = self._store if isinstance(self._store, DurableBatches) else None
        if payload is None and durable is not None:
            payload = batch.SerializeToString()  # the durable store logs the wire bytes
        try:
            if not peer.allows(batch.agent.node):
                fail(
                    batch.sequence,
                    "wrong_node",
                    f"agent.node {batch.agent.node[:80]!r} is not a node its client certificate names "
                    f"({', '.join(sorted(peer.nodes or ())) or 'none'}): agents write as their own node",
                )
            rows = self._decoder.decode(
                batch,
                self._limits,
                None if payload is None else len(payload),
                now=self._clock(),
                identity=peer.identity,
            )
        except BatchError as err:
            self._rejected(err)
            raise
        source = source_key(peer.identity, batch.agent.agent_id)
        try:
            if durable is not None:
                # The store logs the wire bytes before it stores the rows: once this returns, the batch
                # survives a crash, so acknowledging it is safe. It checks the sequence atomically.
                stored = durable.write_logged(source, batch.sequence, payload, rows)  # type: ignore[arg-type]
            else:
                stored = self._write_once(source, batch.sequence, rows)
        except StoreUnavailable:
            with self._lock:
                self.stats.deferred += 1
            raise
        if not stored:
            self._duplicates.dropped(batch, peer)
            return self._duplicate()
        if self._on_rows is not None:
            self._on_rows(rows)
        if self._on_gpu is not None and (gpu := gpu_window(batch)) is not None:
            self._on_gpu(gpu)
        samples = rows.total
        with self._lock:
            self.stats.batches += 1
            self.stats.samples += samples
            for fd, value in batch.stats.ListFields():
                self.stats.sampler[fd.name] = self.stats.sampler.get(fd.name, 0) + value
        return True

    def _write_once(self, source: str, sequence: int, rows: ProfileRows) -> bool:
        """The in-memory store's dedupe: the check, the write and the record under the agent's lock, so a
        resend arriving on a new stream while the old stream's handler still writes waits, then is a
        duplicate (a check and a record in two steps let both through)."""
        with self._agent_locks[zlib.crc32(source.encode()) % _AGENT_LOCKS]:
            with self._lock:
                if self._seen.seen(source, sequence):
                    return False
            self._store.write(rows)
            with self._lock:
                self._seen.add(source, sequence, rows.start)
        return True

    def _duplicate(self) -> bool:
        with self._lock:
            self.stats.duplicates += 1
        return False

    def parse(self, payload: bytes) -> pb.Batch:
        """The Batch in `payload`; BatchError (reason "unreadable") when the bytes are not one."""
        try:
            return pb.Batch.FromString(payload)
        except DecodeError as err:
            unreadable = BatchError(
                "unreadable",
                f"batch (unreadable): {len(payload)} bytes are not a fleetprof.v1.Batch message ({err})",
            )
            self._rejected(unreadable)
            raise unreadable from None

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[pb.Ack]:  # noqa: N802
        """Batches arrive as wire bytes (see serve_ingest): parsed here, and logged as they came."""
        peer = peer_of(context.auth_context(), self._node_binding)
        for payload in request_iterator:
            refused = None
            try:
                batch = self.parse(payload)
                self.ingest(batch, payload, peer)
            except BatchError as err:
                refused = str(err)  # not `err`: its traceback holds the batch
            except StoreUnavailable as err:
                # Said once in the store's log; the agent backs off and resends.
                context.abort(grpc.StatusCode.UNAVAILABLE, f"batch {batch.sequence} not stored: {err}")
            if refused is not None:
                log.warning("rejected from %s: %s", context.peer(), refused)
                size = len(payload)
                payload = batch = None  # freed before the heap is trimmed
                self._trimmer.after(size)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
            yield pb.Ack(sequence=batch.sequence)


def serve_ingest(service: IngestService, server: grpc.Server) -> None:
    """Register the Ingest service on `server` with batches handed over as bytes, not parsed by gRPC:
    an unreadable batch gets a clear INVALID_ARGUMENT instead of gRPC's internal error, and the durable
    store logs exactly the bytes that arrived instead of serializing the batch again."""
    handlers = {
        "Push": grpc.stream_stream_rpc_method_handler(
            service.Push, request_deserializer=None, response_serializer=pb.Ack.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INGEST_SERVICE, handlers),))
    server.add_registered_method_handlers(INGEST_SERVICE, handlers)
