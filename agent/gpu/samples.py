"""Plain data the GPU poller produces: one snapshot per poll, and the window of polls sent per batch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetprof.agent.kube.podresources import DeviceAssignment
    from fleetprof.agent.process.table import ProcessInfo

# A GPU counts as idle in a poll when its utilization (the share of NVML's sample period in which a kernel
# ran) is below this. Not 0: an idle GPU with a polling monitor or a stray context shows 1-3%, while a
# stalled training loop (data loader, collective wait, host-side Python) drops below 5% for whole seconds.
IDLE_BELOW_PERCENT = 5


@dataclass(frozen=True)
class DeviceIdentity:
    index: int  # NVML index (of the parent GPU for a MIG instance)
    uuid: str
    name: str
    mig_mode: bool = False
    parent_uuid: str = ""  # MIG instances: the GPU they live on
    gpu_instance_id: int = 0

    @property
    def label(self) -> str:
        """The `gpu` label: "0" for a whole GPU, "0/3" for GPU instance 3 of GPU 0."""
        return f"{self.index}/{self.gpu_instance_id}" if self.parent_uuid else str(self.index)


@dataclass(frozen=True)
class DeviceSample:
    """One poll of one device; None where the device does not support the field."""

    time_ns: int
    gpu_util_percent: int | None = None
    mem_util_percent: int | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_mw: int | None = None
    energy_mj: int | None = None  # since the driver was loaded
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    pcie_tx_kbps: int | None = None
    pcie_rx_kbps: int | None = None


@dataclass(frozen=True)
class ProcessSample:
    """One process on one device in one poll."""

    pid: int
    uuid: str
    mem_used_bytes: int | None = None
    # Mean of the process's NVML utilization samples since the previous poll (0 when it had none);
    # None where the device does not report per-process utilization.
    sm_util_percent: float | None = None
    mem_util_percent: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """Everything one poll saw. `xids` holds the XID events read during this poll."""

    time_ns: int
    devices: tuple[tuple[DeviceIdentity, DeviceSample], ...]
    processes: tuple[ProcessSample, ...] = ()
    xids: tuple[tuple[str, int], ...] = ()  # (uuid, xid code)
    xid_watched: frozenset[str] = frozenset()  # uuids whose XID events are registered


@dataclass
class DeviceWindow:
    device: DeviceIdentity
    samples: list[DeviceSample] = field(default_factory=list)
    xid_codes: list[int] = field(default_factory=list)
    xid_errors: int = 0
    xid_watched: bool = False
    owner: DeviceAssignment | None = None  # from the kubelet's PodResources, filled by `attributed`


@dataclass
class ProcessWindow:
    """One process's use of one device over the window (see GpuProcessUsage in ingest.proto)."""

    pid: int
    uuid: str
    polls: int = 0
    state_polls: int = 0
    idle_polls: int = 0
    mem_used_bytes: int | None = None
    sm_util_sum: float | None = None
    mem_util_sum: float | None = None
    process: ProcessInfo | None = None  # filled by `attributed`

    @property
    def sm_util_percent(self) -> float | None:
        return None if self.sm_util_sum is None or not self.polls else self.sm_util_sum / self.polls

    @property
    def mem_util_percent(self) -> float | None:
        return None if self.mem_util_sum is None or not self.polls else self.mem_util_sum / self.polls


@dataclass
class GpuWindow:
    """The polls since the previous drain, for one batch."""

    state: str  # "up", "no_library", "no_driver", "lost", "disabled"
    devices: list[DeviceWindow] = field(default_factory=list)
    processes: list[ProcessWindow] = field(default_factory=list)
    idle_below_percent: int = IDLE_BELOW_PERCENT

    @property
    def up(self) -> bool:
        return self.state == "up"

    def attributed(self, process_of, owner_of) -> GpuWindow:  # two lookups, see below
        """A copy with each process's ProcessInfo (`process_of(pid)`, e.g. ProcessTable.get) and each
        device's PodResources owner (`owner_of(uuid)`, e.g. GpuOwners.owner) filled in."""
        return replace(
            self,
            devices=[replace(d, owner=owner_of(d.device.uuid)) for d in self.devices],
            processes=[replace(p, process=process_of(p.pid)) for p in self.processes],
        )


def aggregate(snapshots: list[Snapshot], state: str, idle_below: int = IDLE_BELOW_PERCENT) -> GpuWindow:
    """Fold the polls of one window into per-device samples and per-(process, device) usage."""
    devices: dict[str, DeviceWindow] = {}
    procs: dict[tuple[int, str], ProcessWindow] = {}
    for snap in snapshots:
        util: dict[str, int | None] = {}
        for ident, sample in snap.devices:
            dw = devices.get(ident.uuid)
            if dw is None:
                dw = devices[ident.uuid] = DeviceWindow(ident)
            dw.samples.append(sample)
            dw.xid_watched = dw.xid_watched or ident.uuid in snap.xid_watched
            util[ident.uuid] = sample.gpu_util_percent
        for uuid, xid in snap.xids:
            dw = devices.get(uuid)
            if dw is not None:
                dw.xid_errors += 1
                if len(dw.xid_codes) < 64:
                    dw.xid_codes.append(xid)
        for ps in snap.processes:
            pw = procs.get((ps.pid, ps.uuid))
            if pw is None:
                pw = procs[(ps.pid, ps.uuid)] = ProcessWindow(ps.pid, ps.uuid)
            pw.polls += 1
            u = util.get(ps.uuid)
            if u is not None:
                pw.state_polls += 1
                pw.idle_polls += u < idle_below
            if ps.mem_used_bytes is not None:
                pw.mem_used_bytes = max(pw.mem_used_bytes or 0, ps.mem_used_bytes)
            if ps.sm_util_percent is not None:
                pw.sm_util_sum = (pw.sm_util_sum or 0.0) + ps.sm_util_percent
            if ps.mem_util_percent is not None:
                pw.mem_util_sum = (pw.mem_util_sum or 0.0) + ps.mem_util_percent
    return GpuWindow(state, list(devices.values()), list(procs.values()), idle_below)
