"""The collector process: gRPC ingest, the store, the HTTP API and UI, and its self-metrics."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from fleetprof.collector.api import QueryApi
from fleetprof.collector.ingest.service import IngestService, serve_ingest
from fleetprof.collector.ingest.validate import IngestLimits
from fleetprof.collector.metrics.cpu import CpuMetrics
from fleetprof.collector.metrics.gpu import GpuMetrics
from fleetprof.collector.metrics.ingest import IngestMetrics
from fleetprof.collector.metrics.queries import QueryTimer, TimedStore
from fleetprof.collector.metrics.syscalls import SyscallMetrics
from fleetprof.collector.model.gpu import GpuWindow
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.store.base import ProfileStore
from fleetprof.collector.store.gpu_usage import GpuUsageLog
from fleetprof.collector.store.memory import MemoryStore
from fleetprof.httpserve import HttpServer

log = logging.getLogger(__name__)


DEFAULT_MEMORY_RETENTION_S = 3600.0
DEFAULT_DISK_RETENTION_S = 7 * 86400.0


@dataclass(frozen=True)
class CollectorConfig:
    grpc: str = "127.0.0.1:7470"
    http: str = "127.0.0.1:7471"
    retention_s: float | None = None  # default: 1 h in memory, 7 d with a data directory
    max_batch_bytes: int = 32 * 1024 * 1024
    data_dir: str | None = None  # None: in-memory only (nothing survives a restart)
    wal_fsync: bool = False  # fsync each batch before acknowledging it (survives power loss too)
    flush_s: float = 10.0  # how often logged batches move into the database
    max_clock_skew_s: float = 300.0  # batch windows ending further ahead of our clock are refused


def open_store(config: CollectorConfig) -> ProfileStore:
    """The store the flags ask for: in memory, or durable in config.data_dir."""
    if config.data_dir is None:
        return MemoryStore(retention_s=config.retention_s or DEFAULT_MEMORY_RETENTION_S)
    from fleetprof.collector.ingest.decode import Decoder, decode_payload
    from fleetprof.collector.store.durable import DurableStore

    decoder = Decoder()
    return DurableStore(
        Path(config.data_dir),
        decode=lambda payload: decode_payload(payload, decoder),
        retention_s=config.retention_s or DEFAULT_DISK_RETENTION_S,
        flush_s=config.flush_s,
        fsync=config.wal_fsync,
    )


class Collector:
    def __init__(self, config: CollectorConfig, store: ProfileStore | None = None):
        self.config = config
        self.store = store or open_store(config)
        self.syscall_metrics = SyscallMetrics()
        self.cpu_metrics = CpuMetrics()
        self.query_timer = QueryTimer()
        self.gpu_metrics = GpuMetrics()
        self.gpu_usage = GpuUsageLog(retention_s=config.retention_s or DEFAULT_MEMORY_RETENTION_S)
        self.ingest = IngestService(
            self.store,
            IngestLimits(max_batch_bytes=config.max_batch_bytes, max_clock_skew_s=config.max_clock_skew_s),
            on_rows=self._export_rows,
            on_gpu=self._observe_gpu,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(IngestMetrics(self.ingest, self.store))
        self.registry.register(self.syscall_metrics)
        self.registry.register(self.gpu_metrics)
        self.registry.register(self.cpu_metrics)
        self.registry.register(self.query_timer)
        api = QueryApi(TimedStore(self.store, self.query_timer), self.registry, gpu_usage=self.gpu_usage)
        host, _, port = config.http.rpartition(":")
        self.http = HttpServer(host or "127.0.0.1", int(port), api.routes(), api.prefixes())
        # gRPC's own limit sits well above ours so oversized batches reach validation and get a clear
        # INVALID_ARGUMENT instead of a transport-level RESOURCE_EXHAUSTED.
        limit = 4 * config.max_batch_bytes
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ingest"),
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        serve_ingest(self.ingest, self.grpc)
        self.grpc_port = self.grpc.add_insecure_port(config.grpc)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {config.grpc} (address in use?)")
        self._stopped = threading.Event()

    def _observe_gpu(self, window: GpuWindow) -> None:
        self.gpu_metrics.observe(window)
        self.gpu_usage.observe(window)

    def _export_rows(self, rows: ProfileRows) -> None:
        self.cpu_metrics.observe(rows)
        if rows.syscalls:
            self.syscall_metrics.observe(rows.syscalls)

    @property
    def http_port(self) -> int:
        return self.http.port

    def start(self) -> None:
        self.grpc.start()
        self.http.start()
        log.info("collector: gRPC on %s, HTTP on http://%s", self.config.grpc, self.config.http)

    def stop(self) -> None:
        self.grpc.stop(grace=2).wait()
        self.http.stop()
        self.store.close()
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()
