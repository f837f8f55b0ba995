"""Prometheus families for GPU devices in base units, shared by the agent's and the collector's /metrics
so both expose the same names and labels ({node, gpu, uuid, model})."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

DEVICE_LABELS = ["node", "gpu", "uuid", "model"]

# Upper bounds of the GPU idle-gap histogram's buckets (10 µs .. 1 s); the last bucket is everything longer.
# Fixed by the wire contract (CudaActivity.gap_histogram): the agent counts gaps into them, the collector
# adds them up and shows them.
GAP_BUCKETS_NS = (10_000, 100_000, 1_000_000, 10_000_000, 100_000_000, 1_000_000_000)


@dataclass(frozen=True)
class DeviceReading:
    """One device's latest values in base units; None where the device does not report the field."""

    node: str
    gpu: str  # "0", or "0/3" for GPU instance 3 of GPU 0 (MIG)
    uuid: str
    model: str
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    power_watts: float | None = None
    energy_joules: float | None = None  # since the driver was loaded
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    clock_event_reasons: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    ecc_corrected_errors: float | None = None
    ecc_uncorrected_errors: float | None = None
    xid_errors: float | None = None  # None: XID events not watched on this device
    # NVML's GPM metrics (Hopper and newer), ratios 0..1 over the interval between two polls.
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_bandwidth_ratio: float | None = None

    @property
    def labels(self) -> list[str]:
        return [self.node, self.gpu, self.uuid, self.model]


def percent(v: float | None) -> float | None:
    return None if v is None else min(max(v, 0), 100) / 100.0


def scaled(v: float | None, factor: float) -> float | None:
    return None if v is None else v * factor


_GAUGES = (
    ("utilization_ratio", "utilization_ratio", "Share of time a kernel ran on the GPU (NVML sample period)"),
    ("memory_utilization_ratio", "memory_utilization_ratio", "Share of time device memory was read/written"),
    ("memory_used_bytes", "memory_used_bytes", "Device memory in use"),
    ("memory_total_bytes", "memory_total_bytes", "Device memory"),
    ("power_watts", "power_watts", "Power draw"),
    ("temperature_celsius", "temperature_celsius", "GPU core temperature"),
    ("sm_clock_hertz", "sm_clock_hertz", "SM clock"),
    (
        "clock_event_reasons",
        "clock_event_reasons",
        "Bit mask of NVML clock event (throttle) reasons; 0 or 1 (GPU idle) is unthrottled",
    ),
    ("pcie_tx_bytes_per_second", "pcie_transmit_bytes_per_second", "PCIe throughput sent by the GPU"),
    ("pcie_rx_bytes_per_second", "pcie_receive_bytes_per_second", "PCIe throughput received by the GPU"),
    # GPM (Hopper and newer): finer than utilization_ratio, which is "any kernel running at all".
    ("sm_active_ratio", "sm_active_ratio", "Share of SMs with at least one warp resident (NVML GPM)"),
    ("sm_occupancy_ratio", "sm_occupancy_ratio", "Warps resident on the SMs over their maximum (NVML GPM)"),
    ("tensor_active_ratio", "tensor_active_ratio", "Share of time a tensor core pipe was busy (NVML GPM)"),
    ("dram_bandwidth_ratio", "dram_bandwidth_ratio", "DRAM bandwidth used over its peak (NVML GPM)"),
)


def device_families(readings: Iterable[DeviceReading]) -> list[Metric]:
    """fleetprof_gpu_* families; a series is left out where its field is None."""
    readings = list(readings)
    out: list[Metric] = []
    for attr, name, help_ in _GAUGES:
        fam = GaugeMetricFamily(f"fleetprof_gpu_{name}", help_, labels=DEVICE_LABELS)
        for r in readings:
            v = getattr(r, attr)
            if v is not None:
                fam.add_metric(r.labels, v)
        out.append(fam)
    energy = CounterMetricFamily(
        "fleetprof_gpu_energy_joules",
        "Energy used since the driver was loaded (resets with the driver)",
        labels=DEVICE_LABELS,
    )
    xid = CounterMetricFamily(
        "fleetprof_gpu_xid_errors", "XID (critical error) events seen by the agent", labels=DEVICE_LABELS
    )
    ecc = CounterMetricFamily(
        "fleetprof_gpu_ecc_errors",
        "Memory ECC errors since the driver was loaded, by type (corrected, uncorrected)",
        labels=[*DEVICE_LABELS, "type"],
    )
    for r in readings:
        if r.energy_joules is not None:
            energy.add_metric(r.labels, r.energy_joules)
        if r.xid_errors is not None:
            xid.add_metric(r.labels, r.xid_errors)
        if r.ecc_corrected_errors is not None:
            ecc.add_metric([*r.labels, "corrected"], r.ecc_corrected_errors)
        if r.ecc_uncorrected_errors is not None:
            ecc.add_metric([*r.labels, "uncorrected"], r.ecc_uncorrected_errors)
    out += [energy, xid, ecc]
    return out
