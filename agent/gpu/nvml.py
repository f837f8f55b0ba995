"""The narrow face over NVML (nvidia-ml-py's `pynvml` module): plain values in, plain values out, and
three kinds of error the poller acts on. Nothing else in the agent imports pynvml."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

Handle = Any  # an opaque nvmlDevice_t


class NvmlError(Exception):
    """An NVML call failed; `code` is the NVML_ERROR_* value (0 when not from NVML)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """No NVML library or no driver on this node: the GPU source is off."""


class NvmlNotSupported(NvmlError):
    """This device does not support this query (or the driver predates it): skip it from now on."""


class NvmlGpuLost(NvmlError):
    """The GPU fell off the bus or the driver went away: shut NVML down, back off, initialize again."""


# NVML_ERROR_* codes (nvml.h; stable across driver versions).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_UNINITIALIZED = 1
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_LIB_RM_VERSION_MISMATCH = 18
_UNKNOWN = 999

# NO_PERMISSION is as permanent as NOT_SUPPORTED for an unprivileged agent: skip the field too.
_UNSUPPORTED = {_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _NO_PERMISSION}
_LOST = {_GPU_IS_LOST, _UNINITIALIZED, _RESET_REQUIRED, _LIB_RM_VERSION_MISMATCH, _UNKNOWN, DRIVER_NOT_LOADED}


# The GPM metrics polled (nvmlGpmMetricId_t names), by the DeviceSample field they fill.
GPM_METRICS = {
    "sm_active_percent": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy_percent": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_active_percent": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "dram_bandwidth_percent": "NVML_GPM_METRIC_DRAM_BW_UTIL",
}


@dataclass(frozen=True)
class ProcessUtilization:
    """One nvmlDeviceGetProcessUtilization sample (percent over NVML's sample period)."""

    pid: int
    timestamp_us: int
    sm_percent: int
    memory_percent: int


@dataclass(frozen=True)
class XidEvent:
    uuid: str  # of the GPU that raised it
    xid: int


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """One NVML session. `module` is the pynvml module (imported on `init()` when not given)."""

    def __init__(self, module: ModuleType | None = None):
        self._m = module

    # -- session ---------------------------------------------------------------------------------

    def init(self) -> None:
        if self._m is None:
            try:
                self._m = importlib.import_module("pynvml")
            except ImportError as err:
                raise NvmlUnavailable(f"the nvidia-ml-py package (module pynvml) is missing: {err}") from err
        try:
            self._call("nvmlInit")
        except NvmlGpuLost as err:
            if err.code == DRIVER_NOT_LOADED:
                raise NvmlUnavailable(str(err), err.code) from err
            raise

    def shutdown(self) -> None:
        try:
            self._call("nvmlShutdown")
        except NvmlError:
            pass  # shutting down after a lost GPU may fail too; the next init starts clean

    def _call(self, name: str, *args: Any) -> Any:
        m = self._m
        assert m is not None, "Nvml.init() first"
        try:
            return getattr(m, name)(*args)
        except m.NVMLError as err:
            code = getattr(err, "value", 0)
            text = f"{name}: {err}"
            if code == _LIBRARY_NOT_FOUND:
                raise NvmlUnavailable(f"{text} (no NVIDIA driver library on this node)", code) from err
            if code in _UNSUPPORTED:
                raise NvmlNotSupported(text, code) from err
            if code in _LOST:
                raise NvmlGpuLost(text, code) from err
            raise NvmlError(text, code) from err

    def _const(self, name: str) -> Any:
        return getattr(self._m, name)

    # -- devices ---------------------------------------------------------------------------------

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Handle:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def uuid(self, h: Handle) -> str:
        return _text(self._call("nvmlDeviceGetUUID", h))

    def name(self, h: Handle) -> str:
        return _text(self._call("nvmlDeviceGetName", h))

    def mig_enabled(self, h: Handle) -> bool:
        current, _pending = self._call("nvmlDeviceGetMigMode", h)
        return current == self._const("NVML_DEVICE_MIG_ENABLE")

    def mig_instances(self, h: Handle) -> list[tuple[Handle, int]]:
        """(handle, GPU instance id) of each MIG instance on a MIG-enabled GPU; empty slots skipped."""
        out = []
        for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, slot)
            except NvmlError as err:
                if err.code == _NOT_FOUND:
                    continue
                raise
            out.append((mh, int(self._call("nvmlDeviceGetGpuInstanceId", mh))))
        return out

    # -- device fields (each may raise NvmlNotSupported) -------------------------------------------

    def utilization(self, h: Handle) -> tuple[int, int]:
        """(GPU %, memory %) over NVML's last sample period (1/6 s to 1 s depending on the GPU)."""
        u = self._call("nvmlDeviceGetUtilizationRates", h)
        return int(u.gpu), int(u.memory)

    def memory(self, h: Handle) -> tuple[int, int]:
        """(used, total) bytes."""
        m = self._call("nvmlDeviceGetMemoryInfo", h)
        return int(m.used), int(m.total)

    def power_milliwatts(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", h))

    def energy_millijoules(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetTotalEnergyConsumption", h))

    def temperature_celsius(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetTemperatureV", h, self._const("NVML_TEMPERATURE_GPU")))

    def sm_clock_mhz(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", h, self._const("NVML_CLOCK_SM")))

    def clock_event_reasons(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", h))

    def ecc_errors(self, h: Handle) -> tuple[int, int]:
        """(corrected, uncorrected) memory errors since the driver was loaded."""
        volatile = self._const("NVML_VOLATILE_ECC")
        corrected = self._call(
            "nvmlDeviceGetTotalEccErrors", h, self._const("NVML_MEMORY_ERROR_TYPE_CORRECTED"), volatile
        )
        uncorrected = self._call(
            "nvmlDeviceGetTotalEccErrors", h, self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"), volatile
        )
        return int(corrected), int(uncorrected)

    def pcie_kilobytes_per_second(self, h: Handle) -> tuple[int, int]:
        """(TX, RX) KB/s; NVML measures each over 20 ms, so this call blocks ~40 ms."""
        tx = self._call("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_TX_BYTES"))
        rx = self._call("nvmlDeviceGetPcieThroughput", h, self._const("NVML_PCIE_UTIL_RX_BYTES"))
        return int(tx), int(rx)

    # -- GPM (GPU Performance Monitoring: Hopper and newer) -----------------------------------------

    def gpm_supported(self, h: Handle) -> bool:
        """Whether the device has GPM; drivers before it raise NvmlNotSupported (FUNCTION_NOT_FOUND)."""
        return bool(self._call("nvmlGpmQueryDeviceSupport", h).isSupportedDevice)

    def gpm_sample(self, h: Handle) -> Any:
        """A new GPM sample of the device (NVML-allocated: gpm_free it)."""
        sample = self._call("nvmlGpmSampleAlloc")
        try:
            self._call("nvmlGpmSampleGet", h, sample)
        except NvmlError:
            self.gpm_free(sample)
            raise
        return sample

    def gpm_free(self, sample: Any) -> None:
        try:
            self._call("nvmlGpmSampleFree", sample)
        except NvmlError:
            pass  # freeing after a lost GPU may fail; the driver reclaims it with the session

    def gpm_metrics(self, older: Any, newer: Any) -> dict[str, float | None]:
        """The GPM_METRICS over the interval between two samples of one device, percent; None for a
        metric the device does not report (its own nvmlReturn)."""
        m = self._m
        get = m.c_nvmlGpmMetricsGet_t()
        get.version = m.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(GPM_METRICS)
        get.sample1 = older
        get.sample2 = newer
        for i, name in enumerate(GPM_METRICS.values()):
            get.metrics[i].metricId = self._const(name)
        self._call("nvmlGpmMetricsGet", get)
        return {
            field: float(get.metrics[i].value) if get.metrics[i].nvmlReturn == 0 else None
            for i, field in enumerate(GPM_METRICS)
        }

    # -- processes -------------------------------------------------------------------------------

    def compute_processes(self, h: Handle) -> dict[int, int | None]:
        """Host pid → GPU memory used (None where NVML cannot say)."""
        return self._processes("nvmlDeviceGetComputeRunningProcesses", h)

    def graphics_processes(self, h: Handle) -> dict[int, int | None]:
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses", h)

    def _processes(self, fn: str, h: Handle) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for p in self._call(fn, h):
            mem = getattr(p, "usedGpuMemory", None)
            out[int(p.pid)] = None if mem is None else int(mem)
        return out

    def process_utilization(self, h: Handle, last_seen_us: int) -> list[ProcessUtilization]:
        """Samples newer than `last_seen_us`; NVML says NOT_FOUND when there are none."""
        try:
            samples = self._call("nvmlDeviceGetProcessUtilization", h, last_seen_us)
        except NvmlError as err:
            if err.code == _NOT_FOUND:
                return []
            raise
        return [
            ProcessUtilization(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in samples
        ]

    # -- XID events ------------------------------------------------------------------------------

    def xid_event_set(self, handles: list[Handle]) -> tuple[Any, list[Handle]]:
        """An event set with XID (critical error) events registered on each GPU that supports them;
        returns it with the handles it covers (possibly none)."""
        event_set = self._call("nvmlEventSetCreate")
        xid = self._const("nvmlEventTypeXidCriticalError")
        covered = []
        for h in handles:
            try:
                if not int(self._call("nvmlDeviceGetSupportedEventTypes", h)) & xid:
                    continue
                self._call("nvmlDeviceRegisterEvents", h, xid, event_set)
            except NvmlNotSupported:
                continue
            covered.append(h)
        return event_set, covered

    def pending_xids(self, event_set: Any, limit: int = 256) -> list[XidEvent]:
        """The XID events waiting in `event_set`, without blocking (timeout 0)."""
        xid_type = self._const("nvmlEventTypeXidCriticalError")
        out = []
        for _ in range(limit):
            try:
                data = self._call("nvmlEventSetWait", event_set, 0)
            except NvmlError as err:
                if err.code == _TIMEOUT:
                    break
                raise
            if int(data.eventType) & xid_type:
                out.append(XidEvent(self.uuid(data.device), int(data.eventData)))
        return out

    def free_event_set(self, event_set: Any) -> None:
        try:
            self._call("nvmlEventSetFree", event_set)
        except NvmlError:
            pass
