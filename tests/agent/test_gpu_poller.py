"""The NVML poller against a scripted `pynvml` (tests/support/fake_pynvml.py): snapshots, unsupported fields,
lost GPUs, a missing library, per-process utilization, MIG, XID events and the agent's /metrics."""

from __future__ import annotations

import ctypes
import inspect
import logging
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetprof.agent.gpu.metrics import GpuExporter
from fleetprof.agent.gpu.poller import GpuPoller, GpuPollerConfig
from tests.conftest import wait_until
from tests.support.fake_pynvml import CONSTANTS, ERRORS, STRUCTS, FakeGpu, FakeMig, FakeNvml

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def unix(self) -> float:
        return T0 + self.t

    def mono(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def install(monkeypatch: pytest.MonkeyPatch, world: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", world.module)
    return world


def poller_for(clock: Clock, **cfg: object) -> GpuPoller:
    return GpuPoller(GpuPollerConfig(**cfg), clock=clock.unix, monotonic=clock.mono)


def tick(world: FakeNvml, clock: Clock, poller: GpuPoller, seconds: float = 1.0):
    snap = poller.poll_once()
    world.step += 1
    clock.t += seconds
    return snap


def scrape(poller: GpuPoller | None, node: str = "n1") -> dict[tuple[str, tuple], float]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GpuExporter(poller, node))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def h100(uuid: str = "GPU-aaaa", **kw: object) -> FakeGpu:
    return FakeGpu(uuid, **kw)


def test_fake_has_the_real_pynvml_shape() -> None:
    """Every name the fake defines exists in nvidia-ml-py with the same value or call signature."""
    real = pytest.importorskip("pynvml")
    fake = FakeNvml([]).module
    for name, value in vars(fake).items():
        if name.startswith("__"):
            continue
        assert hasattr(real, name), f"pynvml has no {name}"
        if name in ERRORS or name in CONSTANTS:
            assert getattr(real, name) == value, name
        elif name.startswith("NVMLError_"):
            assert issubclass(getattr(real, name), real.NVMLError)
            assert getattr(real, name)().value == value().value
        elif callable(value) and name.startswith("nvml"):
            real_params = list(inspect.signature(getattr(real, name)).parameters)
            assert list(inspect.signature(value).parameters) == real_params, name
        elif name in STRUCTS or name == "c_nvmlGpmSample_t":
            # ctypes structures: the same fields, each of the same size, in the same order.
            assert ctypes.sizeof(value) == ctypes.sizeof(getattr(real, name)), name
            if name == "c_nvmlGpmSample_t":
                assert value._type_.__name__ == getattr(real, name)._type_.__name__
            else:
                mine = [(f, ctypes.sizeof(t)) for f, t in getattr(value, "_fields_", ())]
                theirs = [(f, ctypes.sizeof(t)) for f, t in getattr(getattr(real, name), "_fields_", ())]
                assert mine == theirs, name


def test_snapshots_match_the_script(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    gpu = h100(utilization=[(90, 40), (0, 0), (55, 20)], compute={4242: 3 << 30}, graphics={4243: 1 << 20})
    world = install(monkeypatch, FakeNvml([gpu, h100("GPU-bbbb", name="NVIDIA A10")]))
    poller = poller_for(clock)
    snaps = [tick(world, clock, poller) for _ in range(3)]
    assert poller.state == "up" and all(snaps)
    idents = [ident for ident, _ in snaps[0].devices]
    assert [(i.index, i.uuid, i.name, i.mig_mode, i.label) for i in idents] == [
        (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", False, "0"),
        (1, "GPU-bbbb", "NVIDIA A10", False, "1"),
    ]
    assert [s.devices[0][1].gpu_util_percent for s in snaps] == [90, 0, 55]
    s = snaps[0].devices[0][1]
    assert s.time_ns == int(T0 * 1e9)
    assert (s.mem_util_percent, s.mem_used_bytes, s.mem_total_bytes) == (40, 10 << 30, 80 << 30)
    assert (s.power_mw, s.energy_mj, s.temperature_c, s.sm_clock_mhz) == (250_000, 1_000_000, 50, 1980)
    assert (s.clock_event_reasons, s.ecc_corrected, s.ecc_uncorrected) == (0, 0, 0)
    assert (s.pcie_tx_kbps, s.pcie_rx_kbps) == (1000, 2000)
    procs = {(p.pid, p.uuid): p for p in snaps[0].processes}
    assert set(procs) == {(4242, "GPU-aaaa"), (4243, "GPU-aaaa")}
    assert procs[(4242, "GPU-aaaa")].mem_used_bytes == 3 << 30
    # current API names only
    called = {name for name, _ in world.calls}
    assert {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"} <= called
    # the window: samples per device, per-process polls and idle polls (0% is idle, 90% and 55% busy)
    window = poller.drain()
    assert [len(d.samples) for d in window.devices] == [3, 3]
    pw = next(p for p in window.processes if p.pid == 4242)
    assert (pw.polls, pw.state_polls, pw.idle_polls) == (3, 3, 1)
    assert poller.drain().devices == []  # drained
    # the timeline the GPU-idle tagging reads
    assert poller.timeline.state(4242, T0 + 0.5) == "idle"  # (T0, T0+1] is described by the poll at T0+1
    assert poller.timeline.state(4242, T0 + 1.5) == "busy"
    assert poller.timeline.gpu_pids() == {4242, 4243}


def test_each_poll_hands_the_gpu_pids_to_the_sampler(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    gpu = h100(utilization=[(90, 40)])
    world = install(monkeypatch, FakeNvml([gpu]))
    poller = poller_for(clock)
    seen: list[set[int]] = []
    poller.on_gpu_pids = seen.append
    tick(world, clock, poller)
    gpu.compute = {4242: 1 << 30}  # a process opens a CUDA context: the very next poll names it
    tick(world, clock, poller)
    gpu.compute = {}
    tick(world, clock, poller)
    assert seen == [set(), {4242}, set()]


def test_not_supported_fields_are_skipped_from_then_on(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    gpu = h100(
        not_supported={
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetPcieThroughput",
        }
    )
    world = install(monkeypatch, FakeNvml([gpu]))
    poller = poller_for(clock)
    for _ in range(3):
        snap = tick(world, clock, poller)
        s = snap.devices[0][1]
        assert s.power_mw is None and s.ecc_corrected is None and s.pcie_tx_kbps is None
        assert s.temperature_c == 50  # the rest keeps coming
    assert len(world.calls_to("nvmlDeviceGetPowerUsage")) == 1
    assert len(world.calls_to("nvmlDeviceGetTotalEccErrors")) == 1
    assert len(world.calls_to("nvmlDeviceGetPcieThroughput")) == 1
    assert len(world.calls_to("nvmlDeviceGetTemperatureV")) == 3
    assert {f for _, f in poller.unsupported} == {"power", "ecc_errors", "pcie"}
    assert poller.state == "up"


def test_lost_gpu_reinitializes_with_backoff(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    world = install(monkeypatch, FakeNvml([h100(utilization=[(70, 10)])]))
    poller = poller_for(clock, interval_s=1.0, max_backoff_s=8.0)
    assert tick(world, clock, poller) is not None
    world.lost = True  # GPU_IS_LOST mid-run
    with caplog.at_level(logging.WARNING, logger="fleetprof.agent.gpu.poller"):
        assert tick(world, clock, poller) is None
    assert poller.state == "lost" and not poller.up
    assert ("nvmlShutdown", ()) in world.calls
    assert len([r for r in caplog.records if "re-initializing" in r.message]) == 1
    inits = lambda: len(world.calls_to("nvmlInit"))  # noqa: E731
    # backoff: 2 s after the first failure, then 4, 8, 8 (capped); no NVML call while waiting
    tries_at = []
    for _ in range(30):
        before = inits()
        calls_before = len(world.calls)
        tick(world, clock, poller)
        if inits() > before:
            tries_at.append(clock.t - 1.0)
        else:
            assert len(world.calls) == calls_before
    gaps = [b - a for a, b in zip([1.0, *tries_at], tries_at, strict=False)]
    assert gaps[:4] == [2.0, 4.0, 8.0, 8.0]
    assert poller.stats.reinits == 0
    world.lost = False
    for _ in range(9):
        tick(world, clock, poller)
    assert poller.state == "up"
    assert poller.stats.reinits == 1
    snap = poller.latest()
    assert snap is not None and snap.devices[0][1].gpu_util_percent == 70
    metrics = scrape(poller)
    assert metrics[("fleetprof_agent_gpu_reinits_total", ())] == 1
    assert metrics[("fleetprof_agent_gpu_up", ())] == 1


def test_no_library_turns_the_source_off_once(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    world = install(monkeypatch, FakeNvml([], library=False))
    poller = poller_for(clock, absent_retry_s=60.0)
    with caplog.at_level(logging.INFO, logger="fleetprof.agent.gpu"):
        for _ in range(200):
            assert tick(world, clock, poller) is None
    assert poller.state == "no_library"
    lines = [r for r in caplog.records if r.name.startswith("fleetprof.agent.gpu")]
    assert len(lines) == 1
    assert "GPU monitoring is off" in lines[0].getMessage()
    assert "no NVIDIA driver library" in lines[0].getMessage()
    assert len(world.calls_to("nvmlInit")) == 4  # retried quietly every absent_retry_s
    metrics = scrape(poller)
    assert metrics[("fleetprof_agent_gpu_up", ())] == 0
    assert metrics[("fleetprof_agent_gpu_state", (("state", "no_library"),))] == 1
    assert metrics[("fleetprof_agent_gpu_state", (("state", "up"),))] == 0
    assert not [k for k in metrics if k[0].startswith("fleetprof_gpu_")]
    window = poller.drain()
    assert window.state == "no_library" and not window.up and window.devices == []


def test_pynvml_not_installed_is_no_library(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    poller = poller_for(clock)
    assert poller.poll_once() is None
    assert poller.state == "no_library"


def test_process_utilization_passes_the_last_seen_timestamp(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    us = int(T0 * 1e6)
    gpu = h100(compute={10: 1 << 30, 11: 2 << 30})
    world = install(monkeypatch, FakeNvml([gpu]))
    poller = poller_for(clock, interval_s=1.0)
    gpu.process_samples = [(10, us - 200_000, 60, 30), (10, us - 100_000, 80, 10), (11, us - 150_000, 20, 0)]
    first = tick(world, clock, poller)
    # first call: the last interval only (not the driver's whole buffer)
    assert world.calls_to("nvmlDeviceGetProcessUtilization")[0][1] == us - 1_000_000
    util = {p.pid: (p.sm_util_percent, p.mem_util_percent) for p in first.processes}
    assert util == {10: (70.0, 20.0), 11: (20.0, 0.0)}
    second = tick(world, clock, poller)  # no new samples: NVML says NOT_FOUND
    assert world.calls_to("nvmlDeviceGetProcessUtilization")[1][1] == us - 100_000
    assert {p.pid: p.sm_util_percent for p in second.processes} == {10: 0.0, 11: 0.0}
    assert poller.state == "up" and not poller.unsupported
    gpu.process_samples.append((11, us + 1_500_000, 90, 5))
    third = tick(world, clock, poller)
    assert world.calls_to("nvmlDeviceGetProcessUtilization")[2][1] == us - 100_000  # NOT_FOUND kept it
    assert {p.pid: p.sm_util_percent for p in third.processes} == {10: 0.0, 11: 90.0}
    assert world.calls_to("nvmlDeviceGetProcessUtilization")[-1][1] == us - 100_000
    tick(world, clock, poller)
    assert world.calls_to("nvmlDeviceGetProcessUtilization")[-1][1] == us + 1_500_000
    window = poller.drain()
    means = {p.pid: p.sm_util_percent for p in window.processes}
    assert means == {10: pytest.approx(70 / 4), 11: pytest.approx((20 + 90) / 4)}


def test_mig_instances_per_instance_where_nvml_allows(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    mig = h100(
        "GPU-mig0",
        name="NVIDIA A100-SXM4-40GB",
        migs=[
            FakeMig("MIG-one", 1, processes={500: 1 << 30}),
            FakeMig("MIG-two", 2, processes={501: 2 << 30}),
        ],
    )
    world = install(monkeypatch, FakeNvml([mig, h100("GPU-full", compute={600: 1 << 30})]))
    poller = poller_for(clock)
    snap = tick(world, clock, poller)
    devs = {i.uuid: (i, s) for i, s in snap.devices}
    assert set(devs) == {"GPU-mig0", "MIG-one", "MIG-two", "GPU-full"}
    parent, ps = devs["GPU-mig0"]
    assert parent.mig_mode and ps.gpu_util_percent is None  # not supported with MIG on
    assert ps.power_mw == 250_000  # device-level fields still come from the GPU
    one, s1 = devs["MIG-one"]
    assert (one.parent_uuid, one.gpu_instance_id, one.label, one.index) == ("GPU-mig0", 1, "0/1", 0)
    assert (s1.mem_used_bytes, s1.mem_total_bytes) == (1 << 30, 5 << 30)
    assert {(p.pid, p.uuid) for p in snap.processes} == {
        (500, "MIG-one"),
        (501, "MIG-two"),
        (600, "GPU-full"),
    }
    tick(world, clock, poller)
    assert poller.state == "up"
    assert poller.timeline.state(500, T0 + 1) is None  # no utilization on MIG: unknown, not idle
    assert poller.timeline.gpus_of(501) == {"MIG-two"}
    # MIG instances are asked only for memory and processes
    mig_calls = {n for n, args in world.calls if args and getattr(args[0], "mig", None) is not None}
    assert mig_calls <= {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
    }


def test_xid_events_are_counted_without_blocking(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    world = install(monkeypatch, FakeNvml([h100("GPU-x"), h100("GPU-noxid", xid_supported=False)]))
    poller = poller_for(clock)
    tick(world, clock, poller)
    world.events += [("GPU-x", 79), ("GPU-x", 48)]
    snap = tick(world, clock, poller)
    assert snap.xids == (("GPU-x", 79), ("GPU-x", 48))
    assert all(args[1] == 0 for args in world.calls_to("nvmlEventSetWait"))  # timeout 0: never waits
    assert poller.xid_watched() == {"GPU-x"}
    metrics = scrape(poller)
    xid = {dict(k[1])["uuid"]: v for k, v in metrics.items() if k[0] == "fleetprof_gpu_xid_errors_total"}
    assert xid == {"GPU-x": 2}  # GPU-noxid does not report XIDs: no series rather than a false 0
    window = poller.drain()
    by_uuid = {d.device.uuid: d for d in window.devices}
    assert (by_uuid["GPU-x"].xid_errors, by_uuid["GPU-x"].xid_codes) == (2, [79, 48])


def test_agent_metrics_show_device_values(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    gpu = h100("GPU-m", utilization=[(37, 12)], power_mw=312_500, energy_mj=5_000_000, sm_clock_mhz=1755)
    world = install(monkeypatch, FakeNvml([gpu]))
    poller = poller_for(clock)
    tick(world, clock, poller)
    m = scrape(poller, node="gpu-node-1")
    labels = (("gpu", "0"), ("model", "NVIDIA H100 80GB HBM3"), ("node", "gpu-node-1"), ("uuid", "GPU-m"))
    assert m[("fleetprof_gpu_utilization_ratio", labels)] == pytest.approx(0.37)
    assert m[("fleetprof_gpu_memory_used_bytes", labels)] == 10 << 30
    assert m[("fleetprof_gpu_memory_total_bytes", labels)] == 80 << 30
    assert m[("fleetprof_gpu_power_watts", labels)] == pytest.approx(312.5)
    assert m[("fleetprof_gpu_energy_joules_total", labels)] == pytest.approx(5000.0)
    assert m[("fleetprof_gpu_temperature_celsius", labels)] == 50
    assert m[("fleetprof_gpu_sm_clock_hertz", labels)] == pytest.approx(1.755e9)
    assert m[("fleetprof_gpu_xid_errors_total", labels)] == 0
    assert m[("fleetprof_agent_gpu_up", ())] == 1
    assert m[("fleetprof_agent_gpu_polls_total", ())] == 1


def test_disabled_source_says_so() -> None:
    m = scrape(None)
    assert m[("fleetprof_agent_gpu_up", ())] == 0
    assert m[("fleetprof_agent_gpu_state", (("state", "disabled"),))] == 1


def test_thread_polls_every_interval_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    world = install(monkeypatch, FakeNvml([h100(compute={1: 1})]))
    poller = GpuPoller(GpuPollerConfig(interval_s=0.05, pcie=False))
    poller.start()
    wait_until(lambda: poller.stats.polls >= 3, 30, "three polls")
    poller.stop()
    assert not poller._thread.is_alive()
    assert not world.calls_to("nvmlDeviceGetPcieThroughput")
    assert world.calls[-1][0] == "nvmlShutdown"


def test_stop_wakes_the_thread_from_its_wait_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an hour between polls, the thread has exited once stop() returns: stop() woke it from its
    wait (a thread that slept the interval out would still be alive after stop()'s 5 s join)."""
    world = install(monkeypatch, FakeNvml([h100(compute={1: 1})]))
    poller = GpuPoller(GpuPollerConfig(interval_s=3600, pcie=False))
    poller.start()
    wait_until(lambda: poller.stats.polls >= 1, 30, "the first poll")
    poller.stop()
    assert not poller._thread.is_alive()
    assert poller.stats.polls == 1
    assert world.calls[-1][0] == "nvmlShutdown"


SM, OCC, TENSOR, DRAM = (
    CONSTANTS[f"NVML_GPM_METRIC_{n}"] for n in ("SM_UTIL", "SM_OCCUPANCY", "ANY_TENSOR_UTIL", "DRAM_BW_UTIL")
)


def gpm_fields(snap) -> tuple:  # Snapshot
    s = snap.devices[0][1]
    return s.sm_active_percent, s.sm_occupancy_percent, s.tensor_active_percent, s.dram_bandwidth_percent


def test_gpm_metrics_come_from_pairs_of_samples(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    """Each poll takes a GPM sample; the metrics are NVML's over the pair (this poll's and the previous
    one's), so the first poll has none. The older sample is freed once used: one stays held per GPU."""
    gpu = h100(
        gpm=[
            {SM: 10.0, OCC: 5.0, TENSOR: 0.0, DRAM: 2.0},
            {SM: 92.5, OCC: 41.25, TENSOR: 63.0, DRAM: 55.5},
            {SM: 30.0, OCC: 12.0, TENSOR: 7.5, DRAM: 101.0},
        ]
    )
    world = install(monkeypatch, FakeNvml([gpu]))
    poller = poller_for(clock)
    snaps = [tick(world, clock, poller) for _ in range(3)]
    assert [gpm_fields(s) for s in snaps] == [
        (None, None, None, None),
        (92.5, 41.25, 63.0, 55.5),  # the interval ending at step 1's sample
        (30.0, 12.0, 7.5, 101.0),
    ]
    assert len(world.calls_to("nvmlGpmQueryDeviceSupport")) == 1
    assert len(world.gpm_samples) == 1  # the newest, held for the next pair
    m = scrape(poller, node="gpu-node-1")
    labels = (("gpu", "0"), ("model", "NVIDIA H100 80GB HBM3"), ("node", "gpu-node-1"), ("uuid", "GPU-aaaa"))
    assert m[("fleetprof_gpu_sm_active_ratio", labels)] == pytest.approx(0.30)
    assert m[("fleetprof_gpu_sm_occupancy_ratio", labels)] == pytest.approx(0.12)
    assert m[("fleetprof_gpu_tensor_active_ratio", labels)] == pytest.approx(0.075)
    assert m[("fleetprof_gpu_dram_bandwidth_ratio", labels)] == 1.0  # clamped: NVML's rounding over 100
    # The drained window carries them to the collector.
    window = poller.drain()
    assert [s.sm_active_percent for s in window.devices[0].samples] == [None, 92.5, 30.0]
    poller.stop()
    assert world.gpm_samples == {}  # nothing of NVML's memory left behind


def test_a_gpu_without_gpm_is_asked_once_and_its_metrics_left_out(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """Before Hopper, nvmlGpmQueryDeviceSupport answers isSupportedDevice = 0: no sample is ever taken.
    A driver that predates GPM answers NOT_SUPPORTED: the field is skipped from then on, as any other."""
    old, driverless = h100("GPU-a100", name="NVIDIA A100"), h100("GPU-old", gpm=[{SM: 50.0}])
    driverless.not_supported = {"nvmlGpmQueryDeviceSupport"}
    world = install(monkeypatch, FakeNvml([old, driverless]))
    poller = poller_for(clock)
    for _ in range(3):
        snap = tick(world, clock, poller)
        assert all(s.sm_active_percent is None for _, s in snap.devices)
        assert all(s.temperature_c == 50 for _, s in snap.devices)
    assert len(world.calls_to("nvmlGpmQueryDeviceSupport")) == 2  # once per GPU
    assert not world.calls_to("nvmlGpmSampleAlloc")
    assert poller.unsupported == {("GPU-old", "gpm")}
    assert poller.state == "up"


def test_a_metric_the_gpu_does_not_report_is_left_out_alone(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    world = install(monkeypatch, FakeNvml([h100(gpm=[{SM: 70.0, OCC: 20.0, DRAM: 15.0}])]))  # no tensor
    poller = poller_for(clock)
    tick(world, clock, poller)
    assert gpm_fields(tick(world, clock, poller)) == (70.0, 20.0, None, 15.0)


def test_a_lost_gpu_frees_its_gpm_samples_and_starts_a_new_pair(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    world = install(monkeypatch, FakeNvml([h100(gpm=[{SM: 10.0}, {SM: 20.0}, {SM: 30.0}, {SM: 40.0}])]))
    poller = poller_for(clock, max_backoff_s=1.0)
    tick(world, clock, poller)
    tick(world, clock, poller)
    world.lost = True
    assert tick(world, clock, poller) is None
    assert world.gpm_samples == {} and poller.state == "lost"
    world.lost = False
    clock.t += 5
    snap = tick(world, clock, poller)
    assert snap is not None and gpm_fields(snap)[0] is None  # a new session: its first sample
    assert gpm_fields(tick(world, clock, poller))[0] == 40.0
