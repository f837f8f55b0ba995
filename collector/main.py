"""The collector process: gRPC ingest, the store, the HTTP API and UI, and its self-metrics."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from collector.api import QueryApi
from collector.ingest import IngestLimits, IngestService
from collector.store.base import ProfileRows, ProfileStore
from collector.store.memory import MemoryStore
from collector.syscall_metrics import SyscallMetrics
from fleetprof.httpserve import HttpServer
from fleetprof.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectorConfig:
    grpc: str = "127.0.0.1:7470"
    http: str = "127.0.0.1:7471"
    retention_s: float = 3600.0
    max_batch_bytes: int = 32 * 1024 * 1024


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
            yield GaugeMetricFamily(
                f"fleetprof_store_{name}", f"Store: number of {name.replace('_', ' ')}", value=value
            )


class Collector:
    def __init__(self, config: CollectorConfig, store: ProfileStore | None = None):
        self.config = config
        self.store = store or MemoryStore(retention_s=config.retention_s)
        self.syscall_metrics = SyscallMetrics()
        self.ingest = IngestService(
            self.store, IngestLimits(max_batch_bytes=config.max_batch_bytes), on_rows=self._export_rows
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_IngestMetrics(self.ingest, self.store))
        self.registry.register(self.syscall_metrics)
        api = QueryApi(self.store, self.registry)
        host, _, port = config.http.rpartition(":")
        self.http = HttpServer(host or "127.0.0.1", int(port), api.routes(), api.prefixes())
        # gRPC's own limit sits well above ours so oversized batches reach validation and get a clear
        # INVALID_ARGUMENT instead of a transport-level RESOURCE_EXHAUSTED.
        limit = 4 * config.max_batch_bytes
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ingest"),
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        pb_grpc.add_IngestServicer_to_server(self.ingest, self.grpc)
        self.grpc_port = self.grpc.add_insecure_port(config.grpc)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {config.grpc} (address in use?)")
        self._stopped = threading.Event()

    def _export_rows(self, rows: ProfileRows) -> None:
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
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()
