"""The agent's run loop: sampler → resolver → batch → shipper, every interval, until told to stop."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetprof import __version__
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.attribution import Attributor
from fleetprof.agent.batch import encode_window
from fleetprof.agent.gpu.cuda_libraries import ERROR_REASONS as CUDA_LIBRARY_ERRORS
from fleetprof.agent.gpu.cuda_libraries import cuda_libraries
from fleetprof.agent.gpu.cupti_reader import CudaWindow, CuptiReaders
from fleetprof.agent.gpu.metrics import GpuExporter
from fleetprof.agent.gpu.poller import GpuPoller, GpuPollerConfig
from fleetprof.agent.kernel import BpfUnavailable
from fleetprof.agent.kube.config import KubeConfigError, load_config
from fleetprof.agent.kube.podresources import DEFAULT_SOCKET, GpuOwners, PodResourcesClient
from fleetprof.agent.kube.pods import DEFAULT_POD_LABELS, PodCache, parse_label_map
from fleetprof.agent.kube.watcher import PodWatcher
from fleetprof.agent.memory import HeapTrimmer
from fleetprof.agent.metrics import AgentCounters, build_registry
from fleetprof.agent.model import EVENT_EXEC, EVENT_EXIT, EVENT_NEW, EVENT_UNMAPPED, ProcessInfo
from fleetprof.agent.offcpu import (
    DEFAULT_OFFCPU_EXACT_US,
    DEFAULT_OFFCPU_MIN_BLOCK_US,
    DEFAULT_OFFCPU_SAMPLE_EVERY,
)
from fleetprof.agent.process.rootfs import FileErrors
from fleetprof.agent.process.table import ProcessTable, read_process
from fleetprof.agent.python.unwinder import PythonStacks
from fleetprof.agent.resolver import GpuSources, Resolver
from fleetprof.agent.sampler import CpuSampler, SamplerConfig
from fleetprof.agent.scope import CgroupScope
from fleetprof.agent.shipper import Shipper
from fleetprof.agent.symbols.debuginfod import Debuginfod, DebuginfodConfig
from fleetprof.agent.symbols.modules import ModuleWatch
from fleetprof.agent.symbols.preloader import Preloader
from fleetprof.agent.symbols.symbolizer import Symbolizer
from fleetprof.agent.symbols.unsymbolized import MAX_ADDRESSES, SHOWN_ADDRESSES, UnsymbolizedAddresses
from fleetprof.agent.symbols.vdso import read_own_vdso
from fleetprof.agent.syscalls import LatencyDuty, SyscallConfig, SyscallTracer
from fleetprof.agent.unwind.unwinder import Unwinder
from fleetprof.auth import TokenFile
from fleetprof.httpserve import HttpServer, Request, Response, json_response
from fleetprof.tls import ClientTls, ClientTlsConfig

log = logging.getLogger(__name__)


class _StageClock:
    """The drain thread's CPU time by stage of a drain (the stages' sum is the drain's CPU time)."""

    def __init__(self) -> None:
        self.stages: dict[str, int] = {}
        self._last = time.thread_time_ns()

    def end(self, stage: str) -> None:
        now = time.thread_time_ns()
        self.stages[stage] = self.stages.get(stage, 0) + now - self._last
        self._last = now


@dataclass(frozen=True)
class AgentConfig:
    collector: str = "127.0.0.1:7470"
    http: str = "127.0.0.1:7472"
    frequency_hz: int = 19
    interval_s: float = 10.0
    node: str = ""
    include_idle: bool = False
    scope: CgroupScope | None = None  # --cgroup: profile only this cgroup's tasks (agent/scope.py)
    queue_batches: int = 64
    kubernetes: bool = True  # ask the API server for pod metadata when one is configured
    kubeconfig: str | None = None  # None: in-cluster service account, else $KUBECONFIG / ~/.kube/config
    pod_labels: tuple[str, ...] = ()  # --pod-label specs; empty: DEFAULT_POD_LABELS
    pod_resources_socket: str = DEFAULT_SOCKET
    syscalls: bool = True  # counts always, latency in duty-cycled windows (agent/syscalls.py)
    syscall_latency_sample_every: int | None = None  # None: the tracer's measured default; 0: count only
    syscall_latency_duty: LatencyDuty | None = None  # None: the tracer's measured default
    python: bool = True  # Python-aware stacks: walk CPython frames in BPF
    unwind: str = "eh_frame"  # user stacks by call-frame information where files have it, or "fp" only
    unsymbolized: str = "module"  # a stripped file's code: one frame per file, or per "address" (resolver.py)
    debuginfod: DebuginfodConfig | None = None  # None: no debuginfod server is asked
    # Off-CPU time on sched:sched_switch (agent/sampler.py; defaults measured in bench/offcpu.py).
    off_cpu: bool = SamplerConfig.off_cpu
    offcpu_sample_every: int = DEFAULT_OFFCPU_SAMPLE_EVERY
    offcpu_min_block_us: int = DEFAULT_OFFCPU_MIN_BLOCK_US
    offcpu_exact_us: int = DEFAULT_OFFCPU_EXACT_US  # waits this long are recorded exactly; 0: off
    gpu: bool = True  # poll NVML (off by itself, said once, where there is no driver)
    gpu_interval_s: float = 1.0
    cupti: bool = True  # read the activity rings of processes that load our CUPTI library (agent/cupti/)
    # Uprobes on the CUDA runtime, driver and NCCL of processes that map them (agent/gpu/cuda_probes.py):
    # launches with their stacks (1 in N walked), latency of the calls that wait for the GPU.
    cuda_probes: bool = True
    cuda_launch_sample_every: int = SamplerConfig.cuda_launch_sample_every
    tls: ClientTlsConfig | None = None  # None: plaintext gRPC to the collector
    auth_token_file: str | None = None  # send `authorization: Bearer` with its first token
    metrics_token_file: str | None = None  # /metrics needs `Authorization: Bearer` with one of its tokens

    def node_name(self) -> str:
        return self.node or os.environ.get("NODE_NAME") or socket.gethostname()


def boot_time_ns() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return int(line.split()[1]) * 1_000_000_000
    return 0


def split_hostport(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} must be HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


class Agent:
    """Owns the pipeline's stages and threads. `run()` blocks until `stop()`."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.identity = pb.AgentIdentity(
            node=config.node_name(),
            agent_id=uuid.uuid4().hex,
            boot_time_unix_ns=boot_time_ns(),
            version=__version__,
        )
        self._stop = threading.Event()
        self._wake_events, self._wake_events_w = socket.socketpair()  # stop() wakes the event thread
        self._events_thread: threading.Thread | None = None
        self.file_errors = FileErrors()  # tenant files refused, by reason (agent/process/rootfs.py)
        self.python = PythonStacks(enabled=config.python, file_errors=self.file_errors)
        self.unwinder: Unwinder | None = None  # with --unwind=eh_frame, once the sampler is loaded
        self.cupti = CuptiReaders() if config.cupti else None
        self.cuda_library_errors = dict.fromkeys(
            CUDA_LIBRARY_ERRORS, 0
        )  # CUDA files left unprobed, by reason
        self.processes = ProcessTable(on_capture=self._on_capture, on_forget=self._on_forget)
        self.vdso = read_own_vdso()  # the node's vDSO image: tables and names for every process's [vdso]
        # OSError: the cache directory cannot be made (the agent does not start: said in one line).
        self.debuginfod = Debuginfod(config.debuginfod) if config.debuginfod is not None else None
        self.symbolizer = Symbolizer(file_errors=self.file_errors, vdso=self.vdso, debuginfod=self.debuginfod)
        self.preloader = Preloader(self.symbolizer)
        self._started_ticks = read_process(os.getpid(), mappings=False).start_ticks
        # The module list is read before kallsyms (at start()), so a module loaded in between is read again.
        self.unsymbolized = UnsymbolizedAddresses()  # served at /unsymbolized
        self.shipper = Shipper(
            config.collector,
            max_batches=config.queue_batches,
            tls=ClientTls(config.tls) if config.tls else None,
            tokens=TokenFile(config.auth_token_file) if config.auth_token_file else None,
        )
        self.pods = PodCache(
            label_map=parse_label_map(config.pod_labels) if config.pod_labels else DEFAULT_POD_LABELS
        )
        self.attributor = Attributor(self.pods)
        self.pod_watcher = self._pod_watcher()
        self.gpu_owners = GpuOwners(PodResourcesClient(config.pod_resources_socket))
        self.gpu = GpuPoller(GpuPollerConfig(interval_s=config.gpu_interval_s)) if config.gpu else None
        gpu_sources = (
            GpuSources(
                self.gpu.timeline if self.gpu is not None else None,
                config.gpu_interval_s,
                self.gpu_owners.owner,
                # (CuptiReaders has a length: an empty one is falsy, so `is not None` throughout)
                activity=self.cupti.state if self.cupti is not None else None,
                fine_slot_ns=SamplerConfig().gpu_fine_slot_us * 1000,  # start() keeps the default
            )
            if self.gpu is not None or self.cupti is not None
            else None
        )
        self.resolver = Resolver(
            self.processes,
            self.symbolizer,
            python=self.python,
            modules=ModuleWatch(),
            unsymbolized=config.unsymbolized,
            addresses=self.unsymbolized,
            attributor=self.attributor,
            gpu=gpu_sources,
        )
        self.counters = AgentCounters()
        self._trim_heap = HeapTrimmer(self._symbol_generation)
        self.registry, self._drain_hist = build_registry(
            self.counters,
            lambda: self.shipper.stats,
            self._gauges,
            file_errors=self.file_errors.snapshot,
            totals=self._totals,
        )
        self.registry.register(GpuExporter(self.gpu, self.identity.node))
        if self.debuginfod is not None:
            self.registry.register(self.debuginfod)
        host, port = split_hostport(config.http, "--http")
        metrics_tokens = TokenFile(config.metrics_token_file) if config.metrics_token_file else None
        self.http = HttpServer(
            host,
            port,
            {"/metrics": self._metrics, "/healthz": self._healthz, "/unsymbolized": self._unsymbolized},
            tokens=metrics_tokens,
        )
        self.sampler: CpuSampler | None = None
        self.syscalls: SyscallTracer | None = None
        self._last_drain = time.monotonic()

    def _symbol_generation(self) -> int:
        """Changes whenever symbol tables were loaded or evicted (HeapTrimmer trims then)."""
        sym = self.symbolizer.stats()
        return sym.get("files_loaded", 0) + sym.get("files_evicted", 0)

    def _pod_watcher(self) -> PodWatcher | None:
        """Watch this node's pods when an API server is configured; without one, pods keep their UID only."""
        if not self.config.kubernetes:
            return None
        try:
            kube = load_config(self.config.kubeconfig)
        except KubeConfigError as err:
            if self.config.kubeconfig:
                raise  # asked for explicitly: a broken kubeconfig is an error, not a fallback
            log.info("no Kubernetes API server configured (%s): pods are labelled by UID only", err)
            return None
        return PodWatcher(kube, self.identity.node, self.pods)

    def _on_capture(self, info: ProcessInfo) -> None:
        self.python.on_capture(info)
        if self.cupti is not None:
            self.cupti.on_capture(info)
        probes = self.sampler.cuda if self.sampler is not None else None
        if probes is not None:
            libraries = cuda_libraries(info, probes.known, self.cuda_library_errors)
            if libraries:
                probes.attach(info.pid, libraries)
        if self.unwinder is not None:
            self.unwinder.describe(info)

    def _on_forget(self, pid: int) -> None:
        self.python.forget(pid)
        if self.cupti is not None:
            self.cupti.forget(pid)
        if self.sampler is not None and self.sampler.cuda is not None:
            self.sampler.cuda.forget(pid)
        if self.unwinder is not None:
            self.unwinder.forget(pid)

    def _unwind_gauges(self) -> dict:
        if self.unwinder is None:
            return {}
        u = self.unwinder.stats()
        return {
            "unwind_files_tabled": (u.files_tabled, "Files whose call-frame table is loaded in the kernel"),
            "unwind_files_failed": (u.files_failed, "Files without a table: none in them, refused, no room"),
            "unwind_files_no_room": (u.files_no_room, "Files without a table: the kernel map was full"),
            "unwind_files_queued": (
                u.files_queued,
                "Files whose table is being built or waits to be (their samples walked by frame pointer)",
            ),
            "unwind_rows": (u.rows_used, "Table words in the kernel (4 bytes: a row or a page's entry)"),
            "unwind_rows_capacity": (u.rows_capacity, "Table words the kernel map holds"),
            "unwind_processes": (u.processes, "Processes whose user stacks are walked by tables"),
        }

    def _totals(self) -> dict:
        """Running totals the agent's parts keep (counters on /metrics)."""
        out = {}
        if self.unwinder is not None:
            seconds = self.unwinder.stats().build_ns / 1e9
            out["unwind_table_build_seconds"] = (
                seconds,
                "Seconds the unwind-table worker spent building tables",
            )
        if self.cupti is not None:
            c = self.cupti.counters
            out["cupti_records_read"] = (c.records_read, "Records read from CUPTI library rings")
            out["cupti_records_lost"] = (
                c.records_lost,
                "CUPTI activity records lost: the ring lapped before a drain read it, a copy raced the "
                "writer, or CUPTI dropped them",
            )
            out["cupti_rings_opened"] = (c.processes_opened, "CUPTI library rings opened")
            for reason, n in c.errors.items():
                out[f"cupti_ring_errors_{reason}"] = (
                    n,
                    f"CUPTI rings not read (agent/gpu/cupti_ring.py RingError reason {reason!r})",
                )
        probes = self.sampler.cuda if self.sampler is not None else None
        if probes is not None:
            for reason, n in {**self.cuda_library_errors, **probes.errors}.items():
                out[f"cuda_probe_errors_{reason}"] = (
                    n,
                    f"CUDA library files left unprobed (reason {reason!r}: agent/gpu/cuda_libraries.py, "
                    "agent/cuda_probes.py)",
                )
        return out

    def _gauges(self) -> dict:
        sym = self.symbolizer.stats()
        return {
            "processes": (len(self.processes), "Processes described in the process table"),
            "symbol_files": (sym.get("files_cached", 0), "ELF files with a cached symbol table"),
            "symbol_bytes": (sym.get("bytes_held", 0), "Bytes held by cached symbol tables"),
            "symbol_files_unsymbolized": (
                sym.get("files_from_dynsym", 0),
                "Cached ELF files named by .dynsym alone: stripped, and no debug file found for them (their "
                "own functions read as one frame per file: agent/symbols/debuginfo.py)",
            ),
            "symbol_preloads_pending": (
                self.preloader.pending(),
                "New processes whose symbol tables wait to be loaded (agent/symbols/preloader.py)",
            ),
            "frequency_hertz": (self.config.frequency_hz, "Sampling frequency per CPU"),
            "pods": (len(self.pods), "Pods of this node in the metadata cache"),
            "kubernetes_synced": (
                1 if self.pod_watcher is not None and self.pod_watcher.synced() else 0,
                "1 when the pod list from the API server has been loaded",
            ),
            **self._unwind_gauges(),
            "cupti_processes": (
                len(self.cupti) if self.cupti is not None else 0,
                "Processes whose CUPTI library ring the agent reads",
            ),
            "cuda_probed_files": (
                len(self.sampler.cuda) if self.sampler is not None and self.sampler.cuda is not None else 0,
                "CUDA runtime, driver and NCCL files with the agent's uprobes attached",
            ),
            "gpu_owner_lookup_enabled": (
                1 if self.gpu_owners.enabled else 0,
                "1 when the kubelet PodResources socket answers (GPU → pod ownership)",
            ),
        }

    def _metrics(self, _req: Request) -> Response:
        return Response(generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def _unsymbolized(self, req: Request) -> Response:
        """The raw addresses behind frames named after their file (agent/symbols/unsymbolized.py), each
        file's hottest `addresses` (default SHOWN_ADDRESSES)."""
        text = req.param("addresses", str(SHOWN_ADDRESSES)) or ""
        if not text.isdigit() or not 1 <= int(text) <= MAX_ADDRESSES:
            return json_response({"error": f"addresses: expected 1 to {MAX_ADDRESSES}, got {text!r}"}, 400)
        return json_response(self.unsymbolized.snapshot(int(text)))

    def _healthz(self, _req: Request) -> Response:
        stale = time.monotonic() - self._last_drain > 3 * self.config.interval_s + 5
        body = {
            "status": "stalled" if stale else "ok",
            "node": self.identity.node,
            "collector_connected": self.shipper.connected,
            "queued_batches": self.shipper.pending(),
        }
        return json_response(body, 503 if stale else 200)

    def _on_process_event(self, pid: int, kind: int) -> None:
        if kind == EVENT_EXEC:
            # Same pid and start time, another program: the BPF side dropped its CPython layout at the
            # exec, so what was detected before (a forked Python about to exec another) must be too, or
            # the new interpreter is never registered and loses every Python frame.
            self.python.forget(pid)
        if kind in (EVENT_NEW, EVENT_EXEC):
            info = self.processes.refresh(pid)
            if info is not None and (kind == EVENT_EXEC or info.start_ticks >= self._started_ticks):
                self.preloader.submit(pid, info.mappings)  # new since the agent: it may exit before a drain
        elif kind == EVENT_EXIT:
            self.processes.mark_exited(pid)
        elif kind == EVENT_UNMAPPED:  # a table walk left its mappings: code mapped since (a dlopen, a JIT)?
            if self.processes.remap_if_changed(pid) and self.unwinder is not None:
                self.unwinder.unmapped_handled(pid)

    def _on_syscall_process_event(self, pid: int, kind: int, ns: int) -> None:
        """The syscall tracer met a process (see SyscallTracer): capture its labels while it lives."""
        if kind in (EVENT_NEW, EVENT_EXEC):
            self.processes.note(pid, ns, exec_=kind == EVENT_EXEC)
        elif kind == EVENT_EXIT:
            self.processes.mark_exited(pid, ns)  # a late exit of an earlier process with this pid: ignored

    def _poll_events(self) -> None:
        """Sleep until a new or exec'd process is reported (exits wait for one, or for a window's end) or
        the agent stops."""
        assert self.sampler is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.sampler.events_fd(), selectors.EVENT_READ)
            selector.register(self._wake_events, selectors.EVENT_READ)
            while not self._stop.is_set():
                selector.select(self.config.interval_s)  # exits do not wake it: read them once a window
                try:
                    self.sampler.consume_events()
                except Exception:  # keep describing processes whatever one event did
                    log.exception("process event handling failed")

    def _read_cupti(self) -> None:
        if self.cupti is None:
            return
        try:
            self.cupti.read()
        except Exception:  # the rings must not cost the window its CPU samples
            log.exception("reading CUPTI rings failed")
            self.cupti.counters.error("internal")

    def _drain_cupti(self, start_unix_ns: int, end_unix_ns: int) -> CudaWindow | None:
        """The CUPTI rings' window: their records are on CLOCK_MONOTONIC, the window on the wall clock."""
        if self.cupti is None:
            return None
        offset = time.time_ns() - time.monotonic_ns()
        try:
            cuda = self.cupti.drain(start_unix_ns - offset, end_unix_ns - offset)
            if self.sampler is not None:
                self.sampler.set_gpu_timeline_processes(self.cupti.pids())  # their samples: fine slots
            return cuda
        except Exception:  # the rings must not cost the window its CPU samples
            log.exception("reading CUPTI rings failed")
            self.cupti.counters.error("internal")
            return None

    def drain_once(self) -> pb.Batch:
        """One window: drain, resolve, encode and queue it for the collector."""
        assert self.sampler is not None
        t0 = time.perf_counter()
        cpu = _StageClock()
        self._read_cupti()  # before the maps: their launch stacks then cover the rings' kernels
        drain = self.sampler.drain()
        sys_drain = self.syscalls.drain() if self.syscalls is not None else None
        self.gpu_owners.refresh_if_stale(time.monotonic())
        gpu = self.gpu.drain() if self.gpu is not None else None
        cuda = self._drain_cupti(drain.start_ns, drain.end_ns)
        cpu.end("read")
        window = self.resolver.resolve(drain, sys_drain, gpu, cuda)
        self.counters.add_drain(window.stats, sum(s.count for s in window.samples))
        if window.cuda is not None:
            self.counters.add_cuda(window.cuda)
        self.counters.set_offcpu_pending(drain.offcpu_pending)
        cpu.end("resolve")
        self.processes.end_window()
        if self.unwinder is not None:
            self.unwinder.collect_wanted()
            for pid in self.unwinder.take_unmapped():
                self.processes.remap_if_changed(pid)  # described again if it mapped code since (a dlopen)
        cpu.end("processes")
        batch = encode_window(window, self.identity)
        self.shipper.submit(batch)
        cpu.end("encode")
        self._trim_heap()
        cpu.end("trim")
        self.counters.add_drain_cpu(cpu.stages)
        self._drain_hist.observe(time.perf_counter() - t0)
        self._last_drain = time.monotonic()
        return batch

    def start(self) -> None:
        """Load BPF (raises BpfUnavailable), then start HTTP, shipping and event threads."""
        cfg = self.config
        self.sampler = CpuSampler(
            SamplerConfig(
                frequency_hz=cfg.frequency_hz,
                interval_s=cfg.interval_s,
                include_idle=cfg.include_idle,
                scope=cfg.scope,
                python=cfg.python,
                gpu_slot_s=cfg.gpu_interval_s,
                off_cpu=cfg.off_cpu,
                offcpu_sample_every=cfg.offcpu_sample_every,
                offcpu_min_block_us=cfg.offcpu_min_block_us,
                offcpu_exact_us=cfg.offcpu_exact_us,
                unwind=cfg.unwind,
                cuda=cfg.cuda_probes,
                cuda_launch_sample_every=cfg.cuda_launch_sample_every,
            ),
            on_process_event=self._on_process_event,
            on_python_stack=self.python.announced,
        )
        self.python.attach(self.sampler)
        maps = self.sampler.unwind_maps()
        if maps is not None:
            # The agent walks its own stacks by frame pointer: tables for its LLVM would cost it seconds.
            own = frozenset({os.getpid()})
            self.unwinder = Unwinder(maps, file_errors=self.file_errors, skip_pids=own, vdso=self.vdso)
            self.unwinder.start()
        if cfg.syscalls:
            self.syscalls = self._start_syscalls()
        self.symbolizer.load_kernel_symbols()
        self._trim_heap()
        self.http.start()
        self.shipper.start()
        if self.gpu is not None:
            self.gpu.on_gpu_pids = self.sampler.set_gpu_processes
            self.gpu.start()
        if self.pod_watcher is not None:
            self.pod_watcher.start()
        self.preloader.start()
        if self.debuginfod is not None:
            self.debuginfod.start()
        self._events_thread = threading.Thread(target=self._poll_events, name="process-events", daemon=True)
        self._events_thread.start()
        log.info(
            "agent on node %s sampling at %d Hz, shipping every %gs to %s; metrics on http://%s/metrics",
            self.identity.node,
            cfg.frequency_hz,
            cfg.interval_s,
            cfg.collector,
            cfg.http,
        )
        log.info("collector connection: %s", self._protections())

    def _protections(self) -> str:
        cfg = self.config
        if cfg.tls is None:
            transport = "plaintext"
        else:
            ca = cfg.tls.ca or "the system's CAs"
            name = f", server name {cfg.tls.server_name}" if cfg.tls.server_name else ""
            client = f", client certificate {cfg.tls.cert}" if cfg.tls.cert else ""
            transport = f"TLS (trusting {ca}{name}{client})"
        if cfg.auth_token_file is None:
            token = "no token"
        elif cfg.tls is None:
            token = f"token from {cfg.auth_token_file} (sent in the clear: add --tls-ca)"
        else:
            token = f"token from {cfg.auth_token_file}"
        metrics = f"token from {cfg.metrics_token_file}" if cfg.metrics_token_file else "no token"
        return f"{transport}, {token}; /metrics: {metrics}"

    def _start_syscalls(self) -> SyscallTracer | None:
        cfg, overrides = self.config, {}
        if cfg.syscall_latency_sample_every is not None:
            overrides["latency_sample_every"] = cfg.syscall_latency_sample_every
        if cfg.syscall_latency_duty is not None:
            overrides["latency_duty"] = cfg.syscall_latency_duty
        config = SyscallConfig(scope=cfg.scope, **overrides)
        try:
            tracer = SyscallTracer(config, on_process_event=self._on_syscall_process_event)
        except BpfUnavailable as err:
            # CPU profiling goes on without syscalls; said once.
            log.warning("syscall tracing is off: %s", err)
            return None
        assert self.sampler is not None and tracer.events_table is not None
        self.sampler.poll_also(tracer.events_table, tracer.on_event)
        return tracer

    def run(self) -> None:
        self.start()
        next_drain = time.monotonic() + self.config.interval_s
        while not self._stop.wait(max(0.0, next_drain - time.monotonic())):
            next_drain += self.config.interval_s
            try:
                self.drain_once()
            except Exception:  # a bad window must not end profiling
                self.counters.add_failure()
                log.exception("drain failed")
        self._shutdown()

    def stop(self) -> None:
        self._stop.set()
        self._wake_events_w.send(b"x")

    def _shutdown(self) -> None:
        try:
            if self.sampler is not None:
                self.drain_once()  # the last partial window
        except Exception:
            log.exception("final drain failed")
        self.shipper.stop(flush_timeout_s=5.0)
        shipped, samples = self.shipper.stats, self.counters.snapshot()[0]
        log.info(
            "agent stopped: %d samples drained; batches: %d acknowledged, %d refused as invalid, %d dropped "
            "(queue full), %d unacknowledged at exit",
            samples,
            shipped.batches_acked,
            shipped.batches_rejected,
            shipped.batches_dropped,
            self.shipper.pending(),
        )
        if self._events_thread is not None:
            self._events_thread.join()  # before the sampler frees the ring buffers it waits on
        self.preloader.stop()
        if self.debuginfod is not None:
            self.debuginfod.stop()
        if self.unwinder is not None:
            self.unwinder.stop()
        self._wake_events.close()
        self._wake_events_w.close()
        if self.pod_watcher is not None:
            self.pod_watcher.stop()
        if self.sampler is not None:
            self.sampler.close()
        if self.syscalls is not None:
            self.syscalls.close()
        if self.gpu is not None:
            self.gpu.stop()
        if self.cupti is not None:
            self.cupti.close()
        self.http.stop()
