"""The agent's self-metrics (Prometheus), read from plain snapshots on each scrape."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetprof.agent.python.codes import UNNAMED_REASONS
from fleetprof.agent.shipper import ShipperStats


class AgentCounters:
    """Cumulative counters the drain loop adds to; scrapes read a consistent copy."""

    STACK_OUTCOMES = (
        "user_stack_missing",
        "user_stack_errors",
        "kernel_stack_errors",
        "stack_table_full",
        "stack_insert_failed",  # not full: the map's allocator or bucket could not serve in the moment
        "count_table_full",
        "unknown_process",
        "events_lost",
        # Python-aware stacks (agent/python): samples of CPython processes that kept native frames only.
        "python_thread_unknown",
        "python_unwind_failed",
        "python_truncated",
        "python_stack_table_full",
        "python_namespace_mismatch",
        "python_unsupported_samples",
        # ... whose Python frames were dropped (a frame met twice: stale memory) or cut (a stale frame), and
        # new Python stacks BPF could not announce (named at the drain, if still there)
        "python_cycle",
        "python_stale",
        "python_names_lost",
        # Samples whose user stack was cut at a return address outside every executable mapping (a
        # frame-pointer walk through code that keeps none; table walks end there in BPF: no_mapping, jit)
        "user_stack_cut_unmapped",
        # Samples whose user stack holds code of a file that no symbol covers (stripped, and no debug file
        # found: agent/symbols/debuginfo.py), shown as one frame per file (resolver.py --unsymbolized)
        "user_stack_unsymbolized",
    )
    # Python frames whose code object could not be named, weighted by samples (agent/python/codes.py
    # UNNAMED_*): the process had exited, the object was freed and replaced, unreadable, or no code object.
    PYTHON_UNNAMED = UNNAMED_REASONS
    PYTHON_PROCESS_OUTCOMES = ("supported", "unsupported_version", "no_runtime_symbol", "unreadable")
    # The off-CPU recorder (agent/sampler.py STAT_NAMES; all 0 with --no-off-cpu): the tables-full and
    # unresolved events are waits lost, the rest its work.
    OFFCPU_EVENTS = (
        "switches",
        "sampled",
        "runnable",
        "recorded",
        "below_min",
        "state_table_full",
        "count_table_full",
        "stacks_carried",
        "stacks_unresolved",
        "exact",
        "exact_untaken",
        "exact_walks",
    )

    # The table walk of user stacks (agent/bpf/unwind.h; all 0 with --unwind=fp): how each walk ended
    # (end: the outermost frame, the normal end); every walk ends once, so they add up to the walks.
    UNWIND_ENDS = (
        "end",
        "no_mapping",
        "jit",
        "no_table",
        "fp_failed",
        "read_fault",
        "depth",
        "signal",
        "unsupported",
    )
    # ... and what is counted in walks, frames or samples rather than by how a walk ended: each its own
    # series (metric name suffix, help), so no sum over one label mixes walks with frames.
    UNWIND_COUNTS = {
        "walks": ("walks", "User stacks walked by call-frame information (agent/bpf/unwind.h)"),
        "fp_frames": ("fp_frames", "Frames of table walks stepped by frame pointer (a file not tabled yet)"),
        "jit_fp": (
            "jit_fp_frames",
            "Frames of JIT code (anonymous executable memory) stepped by frame pointer back into mapped code",
        ),
        "fallback": (
            "fallback_samples",
            "Samples of processes walked by tables that were unwound by frame pointer instead",
        ),
    }
    UNWIND_EVENTS = (*UNWIND_COUNTS, *UNWIND_ENDS)  # the sampler's stats, unwind_<event>
    # CUDA, per window (agent/model.py CudaWindow): launches the uprobes saw, those whose stacks were
    # taken, those lost to a full table; kernels the CUPTI rings gave, and those whose time went under
    # the stacks that launched them (the rest is under the kernel's name alone).
    CUDA_EVENTS = ("launches", "launches_sampled", "launch_table_full", "kernels", "kernels_attributed")
    DRAIN_STAGES = ("read", "resolve", "processes", "encode", "trim")  # agent/main.py, drain_once

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples = 0
        self.drains = 0
        self.drain_failures = 0
        self.outcomes = dict.fromkeys(self.STACK_OUTCOMES, 0)
        self.python_processes = dict.fromkeys(self.PYTHON_PROCESS_OUTCOMES, 0)
        self.python_samples = 0
        self.offcpu = dict.fromkeys(self.OFFCPU_EVENTS, 0)
        self.unwind = dict.fromkeys(self.UNWIND_EVENTS, 0)
        self.python_unnamed = dict.fromkeys(self.PYTHON_UNNAMED, 0)
        self.kernel_symbol_reloads = 0
        self.cuda = dict.fromkeys(self.CUDA_EVENTS, 0)
        self.offcpu_pending = 0
        self.drain_cpu_ns = 0  # CPU time of the drain thread in drain, resolve and encode (ns: sums exact)
        self.drain_stage_cpu_ns = dict.fromkeys(self.DRAIN_STAGES, 0)

    def add_drain(self, stats: dict[str, int], samples: int) -> None:
        with self._lock:
            self.drains += 1
            self.samples += samples
            for k in self.STACK_OUTCOMES:
                self.outcomes[k] += stats.get(k, 0)
            for k in self.PYTHON_PROCESS_OUTCOMES:
                self.python_processes[k] += stats.get(f"python_processes_{k}", 0)
            self.python_samples += stats.get("python_merged_samples", 0)
            for k in self.OFFCPU_EVENTS:
                self.offcpu[k] += stats.get(f"offcpu_{k}", 0)
            for k in self.UNWIND_EVENTS:
                self.unwind[k] += stats.get(f"unwind_{k}", 0)
            for k in self.PYTHON_UNNAMED:
                self.python_unnamed[k] += stats.get(f"python_unnamed_{k}", 0)
            self.kernel_symbol_reloads += stats.get("kernel_symbol_reloads", 0)

    def add_cuda(self, cuda) -> None:  # a CudaWindow
        with self._lock:
            self.cuda["launches"] += cuda.launches_seen
            self.cuda["launches_sampled"] += cuda.launches_sampled
            self.cuda["launch_table_full"] += cuda.table_full
            self.cuda["kernels"] += cuda.kernels
            self.cuda["kernels_attributed"] += cuda.kernels_attributed

    def cuda_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.cuda)

    def set_offcpu_pending(self, pending: int) -> None:
        with self._lock:
            self.offcpu_pending = pending

    def add_drain_cpu(self, stages: dict[str, int]) -> None:
        """One drain's CPU time of the drain thread, in ns by stage (DRAIN_STAGES)."""
        with self._lock:
            for stage, ns in stages.items():
                self.drain_cpu_ns += ns
                self.drain_stage_cpu_ns[stage] += ns

    def drain_stages(self) -> dict[str, int]:
        with self._lock:
            return dict(self.drain_stage_cpu_ns)

    def add_failure(self) -> None:
        with self._lock:
            self.drain_failures += 1

    def snapshot(self) -> tuple[int, int, int, dict[str, int]]:
        with self._lock:
            return self.samples, self.drains, self.drain_failures, dict(self.outcomes)

    def python_snapshot(self) -> tuple[int, dict[str, int], dict[str, int]]:
        with self._lock:
            return self.python_samples, dict(self.python_processes), dict(self.python_unnamed)

    def kernel_snapshot(self) -> int:
        with self._lock:
            return self.kernel_symbol_reloads

    def offcpu_snapshot(self) -> tuple[dict[str, int], int]:
        with self._lock:
            return dict(self.offcpu), self.offcpu_pending

    def unwind_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.unwind)


def _labelled(name: str, help_: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    """A counter family with one series per key of `values`, the key as `label`."""
    m = CounterMetricFamily(name, help_, labels=[label])
    for k, v in values.items():
        m.add_metric([k], v)
    return m


class _AgentCollector:
    def __init__(
        self,
        counters: AgentCounters,
        shipper: Callable[[], ShipperStats],
        gauges: Callable[[], dict],
        file_errors: Callable[[], dict[str, int]] | None = None,
        totals: Callable[[], dict] | None = None,
    ):
        self._counters = counters
        self._shipper = shipper
        self._gauges = gauges
        self._file_errors = file_errors
        self._totals = totals or dict

    def describe(self) -> list[Metric]:
        return []  # keeps registration from running collect()

    def collect(self) -> Iterator[Metric]:
        samples, drains, failures, outcomes = self._counters.snapshot()
        yield CounterMetricFamily(
            "fleetprof_agent_samples", "CPU samples drained from the kernel", value=samples
        )
        yield CounterMetricFamily("fleetprof_agent_drains", "Drains of the BPF maps", value=drains)
        yield CounterMetricFamily(
            "fleetprof_agent_drain_cpu_seconds",
            "CPU time the drain thread spent draining the BPF maps, resolving and encoding windows (the"
            " agent's cost per sample; shipping and the other threads are apart)",
            value=self._counters.drain_cpu_ns / 1e9,
        )
        stages = {k: ns / 1e9 for k, ns in self._counters.drain_stages().items()}
        yield _labelled(
            "fleetprof_agent_drain_stage_cpu_seconds",
            "The drain thread's CPU time by stage: read (the BPF maps, syscall counts, GPU polls and CUPTI"
            " rings), resolve (processes, symbols, Python frames), processes (describing and re-reading"
            " them, unwind tables wanted), encode (the wire batch), trim (returning freed memory to the OS);"
            " their sum is fleetprof_agent_drain_cpu_seconds",
            "stage",
            stages,
        )
        yield CounterMetricFamily("fleetprof_agent_drain_failures", "Drains that failed", value=failures)
        yield _labelled(
            "fleetprof_agent_stack_outcomes",
            "Samples whose stack was missing, failed or lost, by reason (user_stack_missing is normal for"
            " kernel threads)",
            "reason",
            outcomes,
        )
        py_samples, py_procs, py_unnamed = self._counters.python_snapshot()
        yield CounterMetricFamily(
            "fleetprof_agent_python_samples", "Samples whose stack carries CPython frames", value=py_samples
        )
        yield _labelled(
            "fleetprof_agent_python_processes",
            "CPython processes detected, by outcome (only 'supported' ones get Python frames)",
            "outcome",
            py_procs,
        )
        yield _labelled(
            "fleetprof_agent_python_unnamed_frames",
            "Sampled Python frames whose code object could not be named, weighted by samples, by reason:"
            " exited (the process was gone first), replaced (freed, another code object there now),"
            " unreadable (no memory there), not_code (no code object's names there)",
            "reason",
            py_unnamed,
        )
        yield CounterMetricFamily(
            "fleetprof_agent_kernel_symbol_reloads",
            "Times kernel symbols were read again because the module list changed",
            value=self._counters.kernel_snapshot(),
        )
        yield _labelled(
            "fleetprof_agent_cuda_events",
            "CUDA, by event: launches the uprobes saw (launches_sampled: those whose stacks were taken,"
            " launch_table_full: lost to a full table); kernels the CUPTI rings gave (kernels_attributed:"
            " those whose time went under the stacks that launched them, the rest under the kernel's name"
            " alone)",
            "event",
            self._counters.cuda_snapshot(),
        )
        offcpu, pending = self._counters.offcpu_snapshot()
        yield _labelled(
            "fleetprof_agent_offcpu_events",
            "Off-CPU recorder (sched_switch), by event: switches seen on the node; switch-outs sampled"
            " (of them runnable: preempted); waits recorded, or dropped as below_min; waits lost to a"
            " full state_table or count_table, or with their stacks unresolved; stacks carried across"
            " drains; exact: waits at or above --off-cpu-exact-ms recorded once at their length (of them"
            " exact_untaken: without a user stack, they did not end in a syscall's return), exact_walks:"
            " their user stacks walked at the syscall's return",
            "event",
            offcpu,
        )
        unwind = self._counters.unwind_snapshot()
        for event, (suffix, help_) in AgentCounters.UNWIND_COUNTS.items():
            yield CounterMetricFamily(f"fleetprof_agent_unwind_{suffix}", help_, value=unwind[event])
        yield _labelled(
            "fleetprof_agent_unwind_walk_ends",
            "User stacks walked by call-frame information, by how the walk ended (each once: they add up to"
            " fleetprof_agent_unwind_walks_total): end (the outermost frame, the normal end); no_mapping, jit"
            " (an address outside the mappings, in JIT code), no_table, fp_failed, read_fault, depth,"
            " signal, unsupported",
            "reason",
            {k: unwind[k] for k in AgentCounters.UNWIND_ENDS},
        )
        yield GaugeMetricFamily(
            "fleetprof_agent_offcpu_pending",
            "Sampled switch-outs waiting for their threads to run again at the last drain",
            value=pending,
        )
        if self._file_errors is not None:
            yield _labelled(
                "fleetprof_agent_symbol_file_errors",
                "ELF files of processes (tenants' files included) refused while loading symbols or detecting"
                " CPython, by reason (agent/process/rootfs.py): truncated, too_large, decompression_bomb,"
                " unsupported_compression, malformed, not_regular, escapes_root",
                "reason",
                self._file_errors(),
            )
        s = self._shipper()
        for name, value, help_ in (
            ("batches_sent", s.batches_sent, "Batches written to the collector stream (resends included)"),
            ("batches_acked", s.batches_acked, "Batches the collector acknowledged"),
            ("batches_rejected", s.batches_rejected, "Batches the collector refused as invalid"),
            ("batches_dropped", s.batches_dropped, "Batches dropped because the queue was full"),
            ("send_errors", s.send_errors, "Broken or failed streams to the collector"),
        ):
            yield CounterMetricFamily(f"fleetprof_agent_{name}", help_, value=value)
        yield GaugeMetricFamily("fleetprof_agent_queue_batches", "Batches waiting for an ack", value=s.queued)
        yield GaugeMetricFamily(
            "fleetprof_agent_queue_bytes", "Bytes waiting for an ack", value=s.queued_bytes
        )
        for name, (value, help_) in self._gauges().items():
            yield GaugeMetricFamily(f"fleetprof_agent_{name}", help_, value=value)
        for name, (value, help_) in self._totals().items():  # running totals: counters (name sans _total)
            yield CounterMetricFamily(f"fleetprof_agent_{name}", help_, value=value)


def build_registry(
    counters: AgentCounters,
    shipper: Callable[[], ShipperStats],
    gauges: Callable[[], dict],
    file_errors: Callable[[], dict[str, int]] | None = None,
    totals: Callable[[], dict] | None = None,
) -> tuple[CollectorRegistry, Histogram]:
    """A registry of our own (no process-global state): agent metrics, own CPU and RSS, drain timing.
    `gauges` and `totals` give {name: (value, help)} read at each scrape, as gauges and as counters (running
    totals kept elsewhere; the name without "_total"). `file_errors` (FileErrors.snapshot) adds
    fleetprof_agent_symbol_file_errors_total{reason}."""
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
    reg.register(_AgentCollector(counters, shipper, gauges, file_errors, totals))
    drain_hist = Histogram(
        "fleetprof_agent_drain_duration_seconds",
        "Time to drain, symbolize and encode one window",
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        registry=reg,
    )
    return reg, drain_hist
