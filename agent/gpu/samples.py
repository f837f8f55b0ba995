"""Plain data the GPU poller produces: one snapshot per poll, and the window of polls sent per batch."""

from __future__ import annotations

from dataclasses import dataclass

from fleetprof.agent.model import (
    IDLE_BELOW_PERCENT,
    DeviceIdentity,
    DeviceSample,
    DeviceWindow,
    GpuWindow,
    ProcessWindow,
)


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
