"""The agent's own GPU metrics (a DaemonSet scrape target, like dcgm-exporter): device values from the last
poll and whether the GPU source is up. Reads the poller's cached snapshot; never calls NVML on a scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetprof.agent.gpu.poller import STATES, GpuPoller
from fleetprof.agent.model import DeviceIdentity, DeviceSample
from fleetprof.gpu_families import DeviceReading, device_families, percent, scaled


def reading(node: str, ident: DeviceIdentity, s: DeviceSample, xid_errors: int | None) -> DeviceReading:
    """NVML's units → base units."""
    return DeviceReading(
        node=node,
        gpu=ident.label,
        uuid=ident.uuid,
        model=ident.name,
        utilization_ratio=percent(s.gpu_util_percent),
        memory_utilization_ratio=percent(s.mem_util_percent),
        memory_used_bytes=s.mem_used_bytes,
        memory_total_bytes=s.mem_total_bytes,
        power_watts=scaled(s.power_mw, 1e-3),
        energy_joules=scaled(s.energy_mj, 1e-3),
        temperature_celsius=s.temperature_c,
        sm_clock_hertz=scaled(s.sm_clock_mhz, 1e6),
        clock_event_reasons=s.clock_event_reasons,
        pcie_tx_bytes_per_second=scaled(s.pcie_tx_kbps, 1024),
        pcie_rx_bytes_per_second=scaled(s.pcie_rx_kbps, 1024),
        ecc_corrected_errors=s.ecc_corrected,
        ecc_uncorrected_errors=s.ecc_uncorrected,
        xid_errors=xid_errors,
        sm_active_ratio=percent(s.sm_active_percent),
        sm_occupancy_ratio=percent(s.sm_occupancy_percent),
        tensor_active_ratio=percent(s.tensor_active_percent),
        dram_bandwidth_ratio=percent(s.dram_bandwidth_percent),
    )


class GpuExporter:
    """A prometheus_client collector. `poller` None: the agent runs with --no-gpu (state "disabled")."""

    def __init__(self, poller: GpuPoller | None, node: str):
        self._poller = poller
        self._node = node

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self._poller
        state = p.state if p is not None else "disabled"
        yield GaugeMetricFamily(
            "fleetprof_agent_gpu_up",
            "1 when NVML answers on this node (the GPU source is on)",
            value=state == "up",
        )
        states = GaugeMetricFamily(
            "fleetprof_agent_gpu_state",
            "The GPU source's state: up, starting, no_library, no_driver, lost (re-initializing), disabled",
            labels=["state"],
        )
        for st in STATES:
            states.add_metric([st], 1 if st == state else 0)
        yield states
        if p is None:
            return
        stats = p.stats
        for name, value, help_ in (
            ("gpu_polls", stats.polls, "NVML polls completed"),
            ("gpu_poll_failures", stats.poll_failures, "Polls that lost NVML (GPU lost, driver error)"),
            ("gpu_reinits", stats.reinits, "Times NVML came back after a failure"),
            ("gpu_field_errors", stats.field_errors, "Single fields left out of a poll after an error"),
        ):
            yield CounterMetricFamily(f"fleetprof_agent_{name}", help_, value=value)
        yield GaugeMetricFamily(
            "fleetprof_agent_gpu_unsupported_fields",
            "Device fields NVML reported as not supported (skipped from then on)",
            value=len(p.unsupported),
        )
        snap = p.latest()
        if snap is None:
            return
        xids = p.xid_counts()
        watched = p.xid_watched()
        readings = [
            reading(self._node, ident, s, xids.get(ident.uuid, 0) if ident.uuid in watched else None)
            for ident, s in snap.devices
        ]
        yield from device_families(readings)
