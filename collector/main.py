"""The collector process: gRPC ingest, the store, the HTTP API and UI, and its self-metrics."""

from __future__ import annotations

import gc
import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from fleetprof.auth import TokenFile
from fleetprof.collector.ingest.auth import TokenInterceptor
from fleetprof.collector.ingest.peer import NODE_BINDINGS
from fleetprof.collector.ingest.service import IngestService, serve_ingest
from fleetprof.collector.ingest.validate import IngestLimits
from fleetprof.collector.metrics.cpu import CpuMetrics
from fleetprof.collector.metrics.gpu import GpuMetrics
from fleetprof.collector.metrics.http import HttpMetrics
from fleetprof.collector.metrics.ingest import IngestMetrics
from fleetprof.collector.metrics.queries import QueryTimer, TimedStore
from fleetprof.collector.metrics.syscalls import CUDA_FAMILIES, SyscallMetrics
from fleetprof.collector.model.gpu import GpuWindow
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.model.rows import ProfileRows
from fleetprof.collector.query.service import QueryService
from fleetprof.collector.render.names import Demangler
from fleetprof.collector.serve.connect import connect_error
from fleetprof.collector.serve.http import HttpApi
from fleetprof.collector.serve.pyroscope import Querier
from fleetprof.collector.store.base import ProfileStore
from fleetprof.collector.store.gpu_usage import GpuUsageLog
from fleetprof.collector.store.memory import MemoryStore
from fleetprof.httpserve import HttpLimits, HttpServer
from fleetprof.tls import ServerTls, TlsError

log = logging.getLogger(__name__)

# Python's cyclic garbage collector, for the collector process (cmd_collector), not for a library user's:
# ingest holds millions of long-lived objects (its stack and frame caches) and allocates tens of thousands
# of short-lived containers a batch, so at the default thresholds (700, 10, 10) young collections run
# hundreds of times a second and older ones are reconsidered every 70,000 allocations. Rarer young
# collections of the same objects (and full ones reconsidered every 8 M allocations) cut the ClickHouse
# store's CPU a batch by ~11% at 5% new stacks (bench/README.md, ClickHouse); the durable store's did not
# move. Cyclic garbage waits longer; the collector makes little of it.
GC_THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


DEFAULT_MEMORY_RETENTION_S = 3600.0
DEFAULT_DISK_RETENTION_S = 7 * 86400.0


@dataclass(frozen=True)
class CollectorConfig:
    grpc: str = "127.0.0.1:7470"
    http: str = "127.0.0.1:7471"
    retention_s: float | None = None  # default: 1 h in memory, 7 d with a data directory
    max_batch_bytes: int = 32 * 1024 * 1024
    data_dir: str | None = None  # None: in-memory only (nothing survives a restart)
    clickhouse: str | None = None  # a clickhouse:// URL: the store many collectors share (not with data_dir)
    clickhouse_password_file: str | None = None  # the ClickHouse user's password, instead of the URL's
    wal_fsync: bool = False  # fsync each batch before acknowledging it (survives power loss too)
    flush_s: float = 10.0  # how often logged batches move into the database
    max_clock_skew_s: float = 300.0  # batch windows ending further ahead of our clock are refused
    tls_cert: str | None = None  # with tls_key: gRPC and HTTP over TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None  # gRPC clients must present a certificate this CA signed
    auth_token_file: str | None = None  # gRPC calls need `authorization: Bearer` with one of its tokens
    api_token_file: str | None = None  # so does every HTTP endpoint but /healthz
    # With client certificates: "certificate" refuses a batch whose node its certificate does not name
    # (ingest/peer.py); "none" for a certificate shared by every agent.
    node_binding: str = "certificate"
    # The label index, per node over an hour (ingest/quota.py); each over-limit batch is refused, counted.
    max_series_per_node: int = IngestLimits.max_series_per_node
    max_label_values: int = IngestLimits.max_values_per_label
    max_series_total: int = IngestLimits.max_series_total
    # The HTTP server's deadlines and connection limits (fleetprof/httpserve.py).
    http_limits: HttpLimits = HttpLimits()

    def ingest_limits(self) -> IngestLimits:
        return IngestLimits(
            max_batch_bytes=self.max_batch_bytes,
            max_clock_skew_s=self.max_clock_skew_s,
            max_series_per_node=self.max_series_per_node,
            max_values_per_label=self.max_label_values,
            max_series_total=self.max_series_total,
            series_horizon_s=min(self.retention_s or DEFAULT_MEMORY_RETENTION_S, DEFAULT_MEMORY_RETENTION_S),
        )


class Protections:
    """What guards the two ports, from the config's files (read and checked here: a bad file stops the
    start with a clear error, not the first request)."""

    def __init__(self, config: CollectorConfig):
        if (config.tls_cert is None) != (config.tls_key is None):
            raise TlsError("TLS needs both --tls-cert and --tls-key")
        if config.tls_client_ca and not config.tls_cert:
            raise TlsError("--tls-client-ca (mutual TLS) needs TLS: add --tls-cert and --tls-key")
        if config.node_binding not in NODE_BINDINGS:
            raise ValueError(
                f"--node-binding must be one of {', '.join(NODE_BINDINGS)}, not {config.node_binding!r}"
            )
        # Nodes are bound to client certificates only where there are some.
        self.node_binding = config.node_binding if config.tls_client_ca else "none"
        self.tls = (
            ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
        )
        self.ingest_tokens = TokenFile(config.auth_token_file) if config.auth_token_file else None
        self.api_tokens = TokenFile(config.api_token_file) if config.api_token_file else None

    def describe(self) -> str:
        tls = self.tls.describe() if self.tls else "plaintext"
        if self.node_binding == "certificate":
            tls += ", each agent writes as the node its certificate names"
        ingest = f"{tls}, token from {self.ingest_tokens.path}" if self.ingest_tokens else f"{tls}, no token"
        http_tls = f"TLS ({self.tls.cert})" if self.tls else "plaintext"
        api = f"{http_tls}, token from {self.api_tokens.path}" if self.api_tokens else f"{http_tls}, no token"
        return f"gRPC ingest: {ingest}; HTTP API, UI and /metrics: {api}"

    @property
    def none(self) -> bool:
        return self.tls is None and self.ingest_tokens is None and self.api_tokens is None


def open_store(config: CollectorConfig) -> tuple[ProfileStore, ContentIds]:
    """The store the flags ask for (in memory, durable in config.data_dir, or in ClickHouse) and the content
    ids its rows are made under: a random key in memory, the data directory's key on disk, the schema's key
    (shared by every collector of the deployment) in ClickHouse."""
    if config.clickhouse is not None:
        from fleetprof.collector.store.clickhouse import ClickHouseConfigError, open_clickhouse, parse_url

        if config.data_dir is not None:
            raise ClickHouseConfigError("--clickhouse and --data-dir exclude each other: choose one store")
        ch = parse_url(config.clickhouse)
        if config.clickhouse_password_file:
            ch = ch.with_password_file(config.clickhouse_password_file)
        store = open_clickhouse(ch, retention_s=config.retention_s or DEFAULT_DISK_RETENTION_S)
        return store, store.ids
    if config.clickhouse_password_file is not None:
        raise ValueError("--clickhouse-password-file needs --clickhouse")
    if config.data_dir is None:
        return MemoryStore(retention_s=config.retention_s or DEFAULT_MEMORY_RETENTION_S), ContentIds()
    from fleetprof.collector.ingest.decode import Decoder
    from fleetprof.collector.store.durable import DurableStore, content_key

    data_dir = Path(config.data_dir)
    ids = ContentIds(content_key(data_dir))
    store = DurableStore(
        data_dir,
        decode=Decoder(ids).decode_payload,
        ids=ids,
        retention_s=config.retention_s or DEFAULT_DISK_RETENTION_S,
        flush_s=config.flush_s,
        fsync=config.wal_fsync,
    )
    return store, ids


class Collector:
    """`store` (tests): a store opened already, with the content ids its rows are made under (`ids`)."""

    def __init__(
        self, config: CollectorConfig, store: ProfileStore | None = None, ids: ContentIds | None = None
    ):
        self.config = config
        self.protections = Protections(config)  # first: bad TLS or token files stop us before the store opens
        if store is None:
            store, ids = open_store(config)
        elif ids is None:
            raise ValueError(
                "a store given to the collector comes with the ContentIds its rows are made under"
            )
        self.store, self.ids = store, ids
        self.syscall_metrics = SyscallMetrics()
        self.cuda_metrics = SyscallMetrics(families=CUDA_FAMILIES)
        self.cpu_metrics = CpuMetrics()
        self.query_timer = QueryTimer()
        self.gpu_metrics = GpuMetrics()
        # A store shared by many collectors keeps the GPU usage history too (every collector answers for
        # every agent); otherwise it lives in this process.
        self.gpu_usage = getattr(self.store, "gpu_usage", None) or GpuUsageLog(
            retention_s=config.retention_s or DEFAULT_MEMORY_RETENTION_S
        )
        self.ingest = IngestService(
            self.store,
            config.ingest_limits(),
            on_rows=self._export_rows,
            on_gpu=self._observe_gpu,
            node_binding=self.protections.node_binding,
            ids=self.ids,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(IngestMetrics(self.ingest, self.store))
        self.registry.register(self.syscall_metrics)
        self.registry.register(self.cuda_metrics)
        self.registry.register(self.gpu_metrics)
        self.registry.register(self.cpu_metrics)
        self.registry.register(self.query_timer)
        # The collector's own CPU, memory and open files (process_*, from /proc) and Python version
        # (python_info), as every Prometheus client process exports them.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        query = QueryService(TimedStore(self.store, self.query_timer), self.gpu_usage)
        # C++ and Rust names are demangled when rendered, by one helper process per collector.
        self.demangler = Demangler()
        api = HttpApi(query, self.registry, self.demangler.display_name)
        # Grafana's Pyroscope datasource: Connect RPCs on the same port, behind the same TLS and token.
        pyroscope = Querier(query, self.demangler.display_name).service()
        host, _, port = config.http.rpartition(":")
        self.http = HttpServer(
            host or "127.0.0.1",
            int(port),
            api.routes(),
            api.prefixes(),
            limits=config.http_limits,
            tls=self.protections.tls,
            tokens=self.protections.api_tokens,
            post_prefixes={pyroscope.prefix: (pyroscope.handle, connect_error), "/": (None, connect_error)},
        )
        self.registry.register(HttpMetrics(self.http))
        # gRPC's own limit sits well above ours so oversized batches reach validation and get a clear
        # INVALID_ARGUMENT instead of a transport-level RESOURCE_EXHAUSTED.
        limit = 4 * config.max_batch_bytes
        interceptors = []
        if self.protections.ingest_tokens is not None:
            refused = lambda: self.ingest.count_rejected("unauthenticated")  # noqa: E731
            interceptors.append(TokenInterceptor(self.protections.ingest_tokens, on_refused=refused))
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ingest"),
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        serve_ingest(self.ingest, self.grpc)
        if self.protections.tls is not None:
            self.grpc_port = self.grpc.add_secure_port(config.grpc, self.protections.tls.grpc_credentials())
        else:
            self.grpc_port = self.grpc.add_insecure_port(config.grpc)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {config.grpc} (address in use?)")
        self._stopped = threading.Event()

    def _observe_gpu(self, window: GpuWindow) -> None:
        self.gpu_metrics.observe(window)
        self.gpu_usage.observe(window)

    def _export_rows(self, rows: ProfileRows) -> None:
        self.cpu_metrics.observe(rows)
        if rows.syscall_rows:
            self.syscall_metrics.observe(rows.syscall_rows)
        if rows.cuda_calls:
            self.cuda_metrics.observe(rows.cuda_calls)

    @property
    def http_port(self) -> int:
        return self.http.port

    def start(self) -> None:
        self.grpc.start()
        self.http.start()
        scheme = "https" if self.protections.tls else "http"
        log.info("collector: gRPC on %s, HTTP on %s://%s", self.config.grpc, scheme, self.config.http)
        if self.protections.none:
            log.warning(
                "protections: none (plaintext, no tokens): whoever reaches %s can write profiles and whoever"
                " reaches %s can read them; see --tls-cert, --auth-token-file and --api-token-file",
                self.config.grpc,
                self.config.http,
            )
        else:
            log.info("protections: %s", self.protections.describe())
        if self.protections.node_binding != "certificate":
            log.warning(
                "agents are not bound to their nodes (no per-node client certificates): whoever can write to"
                " %s can write as any node; see --tls-client-ca and --node-binding",
                self.config.grpc,
            )

    def stop(self) -> None:
        self.grpc.stop(grace=2).wait()
        self.http.stop()
        self.store.close()
        self.demangler.close()
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()
