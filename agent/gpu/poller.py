"""The NVML poller: one thread reads every GPU each `interval_s`, keeps the polls for the next batch and the
busy/idle timeline, and survives missing drivers, unsupported fields and lost GPUs without ever blocking
the CPU sampler (NVML serializes on a driver lock and some calls take tens of ms)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetprof.agent.gpu.nvml import (
    DRIVER_NOT_LOADED,
    Handle,
    Nvml,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
)
from fleetprof.agent.gpu.samples import ProcessSample, Snapshot, aggregate
from fleetprof.agent.gpu.timeline import GpuTimeline
from fleetprof.agent.model import IDLE_BELOW_PERCENT, DeviceIdentity, DeviceSample, GpuWindow

log = logging.getLogger(__name__)

STATES = ("up", "starting", "no_library", "no_driver", "lost", "disabled")


@dataclass(frozen=True)
class GpuPollerConfig:
    interval_s: float = 1.0
    max_backoff_s: float = 60.0  # re-initializing after a lost GPU: interval, doubling up to this
    # No library or driver: look again this often, quietly (the GPU operator may install the driver
    # after the agent started).
    absent_retry_s: float = 300.0
    pcie: bool = True  # PCIe throughput costs ~40 ms per GPU per poll (NVML samples each direction 20 ms)
    # NVML's GPM metrics (SM active, occupancy, tensor active, DRAM bandwidth) where the GPU has GPM. GPM
    # reads the GPU's performance counters: CUPTI's profiling APIs (range profiler, PM sampling) and DCGM's
    # profiling metrics want the same counters. Our CUPTI library records activity (kernel and copy
    # timestamps) only, which takes no counters, so the two run together; turn this off on nodes where
    # another tool profiles with counters.
    gpm: bool = True
    max_pending_polls: int = 3600  # kept for the next drain; older ones are dropped
    idle_below_percent: int = IDLE_BELOW_PERCENT


@dataclass
class PollerStats:
    polls: int = 0
    poll_failures: int = 0  # polls that ended in a lost GPU or an unexpected error
    reinits: int = 0  # successful re-initializations after a failure
    field_errors: int = 0  # transient errors on a single field (the field was left out of that poll)
    xid_errors: dict[str, int] = field(default_factory=dict)  # uuid -> XID events since the agent started


@dataclass
class _Device:
    ident: DeviceIdentity
    handle: Handle
    mig_instance: bool = False
    has_instances: bool = False  # a MIG-enabled GPU whose instances we list processes on instead
    last_seen_us: int = 0  # newest nvmlDeviceGetProcessUtilization timestamp seen
    gpm: bool | None = None  # the device has GPM (None: not asked yet)
    gpm_prev: Any = None  # the previous poll's GPM sample (NVML memory: freed when replaced or closed)


class GpuPoller:
    """`start()` runs `poll_once()` every interval on a daemon thread; `drain()` hands the polls since
    the previous drain to the batch. Tests drive `poll_once()` directly with their own clocks."""

    def __init__(
        self,
        config: GpuPollerConfig | None = None,
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        timeline: GpuTimeline | None = None,
    ):
        self.config = config or GpuPollerConfig()
        # Called from the poll thread after every poll with the pids on any GPU: the sampler tags their
        # samples with time slots from then on, so a new GPU process is tagged within one poll.
        self.on_gpu_pids: Callable[[set[int]], None] | None = None
        self._nvml = nvml or Nvml()
        self._clock = clock
        self._monotonic = monotonic
        self.timeline = timeline or GpuTimeline(
            max_gap_s=2 * self.config.interval_s, idle_below_percent=self.config.idle_below_percent
        )
        self.state = "starting"
        self.stats = PollerStats()
        self.unsupported: set[tuple[str, str]] = set()  # (uuid, field): NOT_SUPPORTED, never asked again
        self._lock = threading.Lock()
        self._pending: deque[Snapshot] = deque(maxlen=self.config.max_pending_polls)
        self._latest: Snapshot | None = None
        self._devices: list[_Device] | None = None  # None: no NVML session
        self._event_set: Any = None
        self._xid_uuids: frozenset[str] = frozenset()  # devices whose XID events are registered
        self._next_try = float("-inf")
        self._failures = 0
        self._said_unavailable = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpu-poller", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close()

    def _run(self) -> None:
        interval = self.config.interval_s
        next_at = self._monotonic()
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # a bug in one poll must not end GPU monitoring
                self.stats.poll_failures += 1
                log.exception("GPU poll failed")
            next_at += interval
            now = self._monotonic()
            if next_at < now:  # a slow poll: skip the missed ticks rather than bursting
                next_at = now + interval
            if self._devices is None and self._next_try > next_at:
                next_at = self._next_try  # no NVML until the next try: sleep until then, not every tick
            self._stop.wait(next_at - now)

    # -- what the rest of the agent reads ---------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.state == "up"

    def latest(self) -> Snapshot | None:
        """The last poll while NVML is up (None otherwise): what the agent's /metrics shows."""
        with self._lock:
            return self._latest

    def xid_watched(self) -> frozenset[str]:
        return self._xid_uuids

    def xid_counts(self) -> dict[str, int]:
        """uuid -> XID events seen since the agent started."""
        with self._lock:
            return dict(self.stats.xid_errors)

    def drain(self) -> GpuWindow:
        """The polls since the previous drain, folded for one batch. Never calls NVML."""
        with self._lock:
            snaps = list(self._pending)
            self._pending.clear()
        return aggregate(snaps, self.state, self.config.idle_below_percent)

    # -- one poll ---------------------------------------------------------------------------------

    def poll_once(self) -> Snapshot | None:
        """Initialize NVML if due, then read every device. None when NVML is not (yet) usable."""
        now = self._monotonic()
        if self._devices is None and (now < self._next_try or not self._open(now)):
            return None
        try:
            snap = self._poll()
        except (NvmlGpuLost, NvmlUnavailable) as err:
            self._lost(err, now)
            return None
        self.stats.polls += 1
        with self._lock:
            self._pending.append(snap)
            self._latest = snap
            for uuid, _xid in snap.xids:
                self.stats.xid_errors[uuid] = self.stats.xid_errors.get(uuid, 0) + 1
        self.timeline.record(
            snap.time_ns / 1e9,
            {ident.uuid: s.gpu_util_percent for ident, s in snap.devices},
            _pids_by_device(snap.processes),
        )
        if self.on_gpu_pids is not None:
            self.on_gpu_pids(self.timeline.gpu_pids())
        return snap

    def _open(self, now: float) -> bool:
        nvml = self._nvml
        try:
            nvml.init()
            devices = self._enumerate()
        except NvmlUnavailable as err:
            self.state = "no_driver" if err.code == DRIVER_NOT_LOADED else "no_library"
            if not self._said_unavailable:
                log.warning("GPU monitoring is off: %s", err)
                self._said_unavailable = True
            self._next_try = now + self.config.absent_retry_s
            return False
        except NvmlError as err:
            nvml.shutdown()
            self._lost(err, now)
            return False
        try:
            self._event_set, covered = nvml.xid_event_set([d.handle for d in devices if not d.mig_instance])
        except NvmlError as err:
            log.info("XID events unavailable (%s): XID errors are not counted", err)
            self._event_set, covered = None, []
        covered_ids = {id(h) for h in covered}
        self._xid_uuids = frozenset(d.ident.uuid for d in devices if id(d.handle) in covered_ids)
        if self._failures or self._said_unavailable:
            self.stats.reinits += 1
            log.info("NVML is up again: %d devices", len(devices))
        else:
            log.info(
                "NVML: %s; XID events on %d of them",
                ", ".join(f"{d.ident.label} {d.ident.name} {d.ident.uuid}" for d in devices) or "no GPUs",
                len(covered),
            )
        self._devices = devices
        self._failures = 0
        self._said_unavailable = False
        self.state = "up"
        return True

    def _enumerate(self) -> list[_Device]:
        nvml = self._nvml
        since_us = int((self._clock() - self.config.interval_s) * 1e6)
        out = []
        for i in range(nvml.device_count()):
            h = nvml.handle(i)
            uuid = nvml.uuid(h)
            mig = bool(self._field(uuid, "mig_mode", lambda h=h: nvml.mig_enabled(h)))
            dev = _Device(DeviceIdentity(i, uuid, nvml.name(h), mig), h, last_seen_us=since_us)
            out.append(dev)
            if not mig:
                continue
            # Per-instance where NVML allows it (memory, processes); device-level otherwise.
            for mh, gi in self._field(uuid, "mig_instances", lambda h=h: nvml.mig_instances(h)) or []:
                ident = DeviceIdentity(i, nvml.uuid(mh), nvml.name(mh), True, uuid, gi)
                out.append(_Device(ident, mh, mig_instance=True))
                dev.has_instances = True
        return out

    def _lost(self, err: NvmlError, now: float) -> None:
        self.stats.poll_failures += 1
        self._failures += 1
        backoff = min(self.config.interval_s * 2**self._failures, self.config.max_backoff_s)
        if self._failures == 1:
            log.warning("NVML failed (%s): re-initializing with backoff", err)
        else:
            log.debug("NVML still failing (%d in a row, next try in %.0fs): %s", self._failures, backoff, err)
        self._close()
        self.state = "lost"
        self._next_try = now + backoff

    def _close(self) -> None:
        if self._devices is None:
            return
        if self._event_set is not None:
            self._nvml.free_event_set(self._event_set)
            self._event_set = None
        for d in self._devices:
            if d.gpm_prev is not None:
                self._nvml.gpm_free(d.gpm_prev)
                d.gpm_prev = None
        self._nvml.shutdown()
        self._devices = None
        with self._lock:
            self._latest = None

    def _poll(self) -> Snapshot:
        assert self._devices is not None
        t_ns = int(self._clock() * 1e9)
        devices = []
        processes: list[ProcessSample] = []
        for d in self._devices:
            devices.append((d.ident, self._sample(d, t_ns)))
            if not d.has_instances:  # a MIG GPU's processes are listed per instance
                processes.extend(self._processes(d))
        xids: list[tuple[str, int]] = []
        if self._event_set is not None:
            try:
                xids = [(e.uuid, e.xid) for e in self._nvml.pending_xids(self._event_set)]
            except NvmlNotSupported:
                self._nvml.free_event_set(self._event_set)
                self._event_set = None
                self._xid_uuids = frozenset()
            except NvmlError as err:
                if isinstance(err, NvmlGpuLost):
                    raise
                self.stats.field_errors += 1
        return Snapshot(t_ns, tuple(devices), tuple(processes), tuple(xids), self._xid_uuids)

    def _field(self, uuid: str, name: str, read: Callable[[], Any]) -> Any:
        """`read()`, or None when the field is unsupported on this device (then never asked again) or
        failed this time. Lost GPUs and drivers propagate."""
        if (uuid, name) in self.unsupported:
            return None
        try:
            return read()
        except NvmlNotSupported as err:
            self.unsupported.add((uuid, name))
            log.info("GPU %s does not support %s (%s): skipped from now on", uuid, name, err)
        except (NvmlGpuLost, NvmlUnavailable):
            raise
        except NvmlError as err:
            self.stats.field_errors += 1
            log.debug("GPU %s: reading %s failed: %s", uuid, name, err)
        return None

    def _sample(self, d: _Device, t_ns: int) -> DeviceSample:
        nvml, h, uuid = self._nvml, d.handle, d.ident.uuid
        mem = self._field(uuid, "memory", lambda: nvml.memory(h))
        if d.mig_instance:  # NVML reports only memory and processes per MIG instance
            return DeviceSample(t_ns, mem_used_bytes=mem and mem[0], mem_total_bytes=mem and mem[1])
        util = self._field(uuid, "utilization", lambda: nvml.utilization(h))
        ecc = self._field(uuid, "ecc_errors", lambda: nvml.ecc_errors(h))
        pcie = (
            self._field(uuid, "pcie", lambda: nvml.pcie_kilobytes_per_second(h)) if self.config.pcie else None
        )
        gpm = self._gpm(d) if self.config.gpm else {}
        return DeviceSample(
            t_ns,
            gpu_util_percent=util and util[0],
            mem_util_percent=util and util[1],
            mem_used_bytes=mem and mem[0],
            mem_total_bytes=mem and mem[1],
            power_mw=self._field(uuid, "power", lambda: nvml.power_milliwatts(h)),
            energy_mj=self._field(uuid, "energy", lambda: nvml.energy_millijoules(h)),
            temperature_c=self._field(uuid, "temperature", lambda: nvml.temperature_celsius(h)),
            sm_clock_mhz=self._field(uuid, "sm_clock", lambda: nvml.sm_clock_mhz(h)),
            clock_event_reasons=self._field(uuid, "clock_event_reasons", lambda: nvml.clock_event_reasons(h)),
            ecc_corrected=ecc and ecc[0],
            ecc_uncorrected=ecc and ecc[1],
            pcie_tx_kbps=pcie and pcie[0],
            pcie_rx_kbps=pcie and pcie[1],
            **gpm,
        )

    def _gpm(self, d: _Device) -> dict[str, float | None]:
        """The GPM metrics since the previous poll (a pair of samples: none at the first poll). A GPU
        without GPM (before Hopper) is asked once per NVML session; a driver without the calls answers
        NOT_SUPPORTED, which marks the field as any other."""
        nvml, h, uuid = self._nvml, d.handle, d.ident.uuid
        if d.gpm is False or (uuid, "gpm") in self.unsupported:
            return {}
        if d.gpm is None:
            supported = self._field(uuid, "gpm", lambda: nvml.gpm_supported(h))
            if supported is None:
                return {}  # not supported (marked), or failed this time (asked again next poll)
            d.gpm = bool(supported)
            if not supported:
                log.info("GPU %s has no GPM (Hopper and newer): SM-level metrics are not polled", uuid)
                return {}
        new = self._field(uuid, "gpm", lambda: nvml.gpm_sample(h))
        prev = d.gpm_prev
        d.gpm_prev = new
        if prev is None or new is None:
            if prev is not None:
                nvml.gpm_free(prev)
            return {}
        try:
            return self._field(uuid, "gpm", lambda: nvml.gpm_metrics(prev, new)) or {}
        finally:
            nvml.gpm_free(prev)
            if (uuid, "gpm") in self.unsupported and d.gpm_prev is not None:
                nvml.gpm_free(d.gpm_prev)
                d.gpm_prev = None

    def _processes(self, d: _Device) -> list[ProcessSample]:
        nvml, h, uuid = self._nvml, d.handle, d.ident.uuid
        running: dict[int, int | None] | None = None
        for name, read in (
            ("compute_processes", nvml.compute_processes),
            ("graphics_processes", nvml.graphics_processes),
        ):
            got = self._field(uuid, name, lambda read=read: read(h))
            if got is None:
                continue
            running = running if running is not None else {}
            for pid, mem in got.items():
                held = running.get(pid)
                running[pid] = mem if held is None else max(held, mem or 0)
        util = None
        if not d.mig_instance:
            util = self._field(
                uuid, "process_utilization", lambda: nvml.process_utilization(h, d.last_seen_us)
            )
        sums: dict[int, list[float]] = {}  # pid -> [sm sum, mem sum, samples]
        for s in util or ():
            d.last_seen_us = max(d.last_seen_us, s.timestamp_us)
            acc = sums.setdefault(s.pid, [0.0, 0.0, 0])
            acc[0] += s.sm_percent
            acc[1] += s.memory_percent
            acc[2] += 1
        if running is None:  # no process lists on this device: who ran is whoever has samples
            running = dict.fromkeys(sums)
        out = []
        for pid, mem in sorted(running.items()):
            if util is None:
                sm = mu = None
            elif pid in sums:
                sm, mu, n = sums[pid]
                sm, mu = sm / n, mu / n
            else:
                sm = mu = 0.0  # listed, but no kernel of its ran since the previous poll
            out.append(ProcessSample(pid, uuid, mem, sm, mu))
        return out


def _pids_by_device(processes: tuple[ProcessSample, ...]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for p in processes:
        out.setdefault(p.uuid, set()).add(p.pid)
    return out
