"""The collector process: gRPC ingest, the store, the HTTP API and UI, and its self-metrics."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from collector.api import QueryApi
from collector.cpu_metrics import CpuMetrics
from collector.decode import IngestLimits
from collector.gpu_metrics import GpuMetrics
from collector.gpu_usage import GpuUsageLog
from collector.ingest import IngestService, serve_ingest
from collector.store.base import ProfileRows, ProfileStore
from collector.store.memory import MemoryStore
from collector.store.timing import QueryTimer, TimedStore
from collector.syscall_metrics import SyscallMetrics
from fleetprof.httpserve import HttpServer
from fleetprof.v1 import ingest_pb2 as pb

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
    from collector.decode import Decoder, decode_payload
    from collector.store.durable import DurableStore

    decoder = Decoder()
    return DurableStore(
        Path(config.data_dir),
        decode=lambda payload: decode_payload(payload, decoder),
        retention_s=config.retention_s or DEFAULT_DISK_RETENTION_S,
        flush_s=config.flush_s,
        fsync=config.wal_fsync,
    )


class _IngestMetrics:
    def __init__(self, ingest: IngestService, store: ProfileStore):
        self._ingest = ingest
        self._store = store

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._ingest.stats
        yield CounterMetricFamily("fleetprof_ingest_batches", "Batches ingested", value=s.batches)
        yield CounterMetricFamily("fleetprof_ingest_samples", "Samples ingested", value=s.samples)
        yield CounterMetricFamily(
            "fleetprof_ingest_duplicate_batches", "Resent batches dropped as duplicates", value=s.duplicates
        )
        yield CounterMetricFamily(
            "fleetprof_ingest_deferred_batches",
            "Batches not acknowledged because the store could not log them (disk full or failing); the "
            "agents keep them and resend them",
            value=s.deferred,
        )
        stacks = CounterMetricFamily(
            "fleetprof_ingest_stacks",
            "Stacks in the batches received: found by the agent's wire id (known), or checked and decoded "
            "(new to that agent, or sent without an id); the decoded share is what ingest CPU follows",
            labels=["how"],
        )
        for how, n in self._ingest.stack_counts.items():
            stacks.add_metric([how], n)
        yield stacks
        rej = CounterMetricFamily(
            "fleetprof_ingest_rejected_batches", "Batches refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(s.rejected.items()):
            rej.add_metric([reason], n)
        yield rej
        samp = CounterMetricFamily(
            "fleetprof_agent_sampler_events",
            "Sampler outcomes reported by agents (SamplerStats)",
            labels=["outcome"],
        )
        for name, n in sorted(s.sampler.items()):
            samp.add_metric([name], n)
        yield samp
        for name, value in self._store.stats().items():
            help_text = f"Store: {name.replace('_', ' ')}" + ("" if name.endswith("bytes") else " (count)")
            yield GaugeMetricFamily(f"fleetprof_store_{name}", help_text, value=value)


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
            on_batch=self._observe_batch,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_IngestMetrics(self.ingest, self.store))
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

    def _observe_batch(self, batch: pb.Batch) -> None:
        usage = GpuMetrics.pod_usage(batch.agent.node, batch) if batch.gpu_processes else {}
        self.gpu_metrics.observe(batch, usage)
        self.gpu_usage.observe(batch, usage)

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
