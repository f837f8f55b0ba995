"""A scripted stand-in for nvidia-ml-py's `pynvml` module (no GPU here): the same function names,
signatures, constants and NVMLError class hierarchy, driven by a device model the test writes.

`FakeNvml(gpus).module` is installed as sys.modules["pynvml"]; tests/agent/test_gpu_poller.py checks that
every name it defines exists in the real module with the same signature."""

from __future__ import annotations

import ctypes
import string
import types
from dataclasses import dataclass, field

# NVML_ERROR_* and the other constants, with nvidia-ml-py's values.
ERRORS = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_ALREADY_INITIALIZED": 5,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_INSUFFICIENT_POWER": 8,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_IRQ_ISSUE": 11,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_CORRUPTED_INFOROM": 14,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_OPERATING_SYSTEM": 17,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_MEMORY": 20,
    "NVML_ERROR_NO_DATA": 21,
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": 25,
    "NVML_ERROR_DEPRECATED": 26,
    "NVML_ERROR_UNKNOWN": 999,
}
CONSTANTS = {
    "NVML_SUCCESS": 0,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_CLOCK_GRAPHICS": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_VOLATILE_ECC": 0,
    "NVML_AGGREGATE_ECC": 1,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_PCIE_UTIL_TX_BYTES": 0,
    "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_DEVICE_MIG_DISABLE": 0,
    "NVML_DEVICE_MIG_ENABLE": 1,
    "nvmlEventTypeSingleBitEccError": 0x1,
    "nvmlEventTypeDoubleBitEccError": 0x2,
    "nvmlEventTypePState": 0x4,
    "nvmlEventTypeXidCriticalError": 0x8,
    "nvmlEventTypeClock": 0x10,
    "NVML_GPM_SUPPORT_VERSION": 1,
    "NVML_GPM_METRICS_GET_VERSION": 1,
    "NVML_GPM_METRIC_MAX": 477,
    "NVML_GPM_METRIC_GRAPHICS_UTIL": 1,
    "NVML_GPM_METRIC_SM_UTIL": 2,
    "NVML_GPM_METRIC_SM_OCCUPANCY": 3,
    "NVML_GPM_METRIC_INTEGER_UTIL": 4,
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5,
    "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
}


# nvidia-ml-py's ctypes structures for GPM, field for field (the shape test compares them): the caller
# fills a c_nvmlGpmMetricsGet_t and NVML writes each metric's value and return code into it.
class struct_c_nvmlGpmSample_t(ctypes.Structure):
    pass  # opaque: NVML's own memory


c_nvmlGpmSample_t = ctypes.POINTER(struct_c_nvmlGpmSample_t)


class c_metricInfo_t(ctypes.Structure):
    _fields_ = [("shortName", ctypes.c_char_p), ("longName", ctypes.c_char_p), ("unit", ctypes.c_char_p)]


class c_nvmlGpmMetric_t(ctypes.Structure):
    _fields_ = [
        ("metricId", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", ctypes.c_double),
        ("metricInfo", c_metricInfo_t),
    ]


class c_nvmlGpmMetricsGet_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("numMetrics", ctypes.c_uint),
        ("sample1", c_nvmlGpmSample_t),
        ("sample2", c_nvmlGpmSample_t),
        ("metrics", c_nvmlGpmMetric_t * CONSTANTS["NVML_GPM_METRIC_MAX"]),
    ]


class c_nvmlGpmSupport_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("isSupportedDevice", ctypes.c_uint)]


STRUCTS = {
    "struct_c_nvmlGpmSample_t": struct_c_nvmlGpmSample_t,
    "c_metricInfo_t": c_metricInfo_t,
    "c_nvmlGpmMetric_t": c_nvmlGpmMetric_t,
    "c_nvmlGpmMetricsGet_t": c_nvmlGpmMetricsGet_t,
    "c_nvmlGpmSupport_t": c_nvmlGpmSupport_t,
}
E = types.SimpleNamespace(**{k.removeprefix("NVML_ERROR_"): v for k, v in ERRORS.items()})


class NVMLError(Exception):
    """nvidia-ml-py's shape: NVMLError(code) returns the subclass for that code, with `.value`."""

    _valClassMapping: dict[int, type] = {}  # nvidia-ml-py's name

    def __new__(cls, value: int):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        names = {v: k for k, v in ERRORS.items()}
        return names.get(self.value, f"NVML Error with code {self.value}").removeprefix("NVML_ERROR_")


def _error_classes() -> dict[str, type]:
    out = {}
    for name, code in ERRORS.items():
        cls_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls, *args, _code=code):
            return NVMLError.__new__(cls, _code)

        cls = type(cls_name, (NVMLError,), {"__new__": new})
        NVMLError._valClassMapping[code] = cls
        out[cls_name] = cls
    return out


ERROR_CLASSES = _error_classes()


@dataclass
class FakeMig:
    uuid: str
    gpu_instance_id: int
    name: str = "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    memory: tuple[int, int] = (1 << 30, 5 << 30)  # used, total
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes


@dataclass
class FakeGpu:
    """One scripted GPU. `utilization` is (gpu %, memory %) per step (the last repeats)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    memory: tuple[int, int] = (10 << 30, 80 << 30)
    power_mw: int = 250_000
    energy_mj: int = 1_000_000
    temperature_c: int = 50
    sm_clock_mhz: int = 1980
    clock_event_reasons: int = 0
    ecc: tuple[int, int] = (0, 0)
    pcie_kbps: tuple[int, int] = (1000, 2000)
    compute: dict[int, int] = field(default_factory=dict)  # pid -> bytes
    graphics: dict[int, int] = field(default_factory=dict)
    # nvmlDeviceGetProcessUtilization samples: (pid, timestamp µs, sm %, mem %)
    process_samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    not_supported: set[str] = field(default_factory=set)  # pynvml function names answering NOT_SUPPORTED
    migs: list[FakeMig] | None = None  # MIG mode on, with these instances
    xid_supported: bool = True
    # GPM metrics by NVML_GPM_METRIC_* id per step (the last repeats), as NVML computes them over the
    # interval ending at a pair's newer sample; a metric left out answers NOT_SUPPORTED. None: a GPU
    # without GPM (before Hopper): nvmlGpmQueryDeviceSupport says isSupportedDevice = 0.
    gpm: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


class _Obj:
    """ctypes-struct-like results: attributes only."""

    def __init__(self, **kw: object):
        self.__dict__.update(kw)


class FakeNvml:
    """The scripted world: `step` selects each GPU's utilization; `lost` makes every call fail with
    GPU_IS_LOST; `library=False` makes nvmlInit raise NVMLError_LibraryNotFound."""

    def __init__(self, gpus: list[FakeGpu], library: bool = True):
        self.gpus = gpus
        self.library = library
        self.step = 0
        self.lost = False
        self.initialized = False
        self.calls: list[tuple[str, tuple]] = []
        self.events: list[tuple[str, int]] = []  # (gpu uuid, xid) waiting to be read
        self._registered: set[str] = set()
        # GPM samples NVML has allocated and not freed: address -> (GPU, step taken; None before a get).
        self.gpm_samples: dict[int, tuple[FakeGpu, int] | None] = {}
        self._gpm_keep: dict[int, struct_c_nvmlGpmSample_t] = {}
        self.module = self._build()

    def calls_to(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]

    def _build(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.__dict__.update(ERRORS)
        m.__dict__.update(CONSTANTS)
        m.__dict__.update(ERROR_CLASSES)
        m.NVMLError = NVMLError
        m.__dict__.update(STRUCTS)
        m.c_nvmlGpmSample_t = c_nvmlGpmSample_t
        for name in dir(self):
            if name.startswith("nvml"):
                m.__dict__[name] = getattr(self, name)
        return m

    # -- plumbing --------------------------------------------------------------------------------

    def _enter(self, name: str, *args: object) -> None:
        self.calls.append((name, args))
        if not self.initialized:
            raise NVMLError(E.UNINITIALIZED)
        if self.lost:
            raise NVMLError(E.GPU_IS_LOST)

    def _dev(self, name: str, handle: _Handle, *args: object) -> FakeGpu:
        self._enter(name, handle, *args)
        if name in handle.gpu.not_supported:
            raise NVMLError(E.NOT_SUPPORTED)
        return handle.gpu

    def _whole_gpu(self, name: str, handle: _Handle, *args: object) -> FakeGpu:
        """Per-GPU fields: NOT_SUPPORTED on MIG instances (and utilization on MIG-enabled GPUs)."""
        gpu = self._dev(name, handle, *args)
        if handle.mig is not None:
            raise NVMLError(E.NOT_SUPPORTED)
        return gpu

    # -- the pynvml API --------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append(("nvmlInit", ()))
        if not self.library:
            raise NVMLError(E.LIBRARY_NOT_FOUND)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.calls.append(("nvmlShutdown", ()))
        self.initialized = False
        self._registered.clear()

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(E.INVALID_ARGUMENT)
        return _Handle(self.gpus[index])

    def nvmlDeviceGetUUID(self, handle):
        gpu = self._dev("nvmlDeviceGetUUID", handle)
        return handle.mig.uuid if handle.mig else gpu.uuid

    def nvmlDeviceGetName(self, handle):
        gpu = self._dev("nvmlDeviceGetName", handle)
        return handle.mig.name if handle.mig else gpu.name

    def nvmlDeviceGetMigMode(self, device):
        gpu = self._whole_gpu("nvmlDeviceGetMigMode", device)
        on = 1 if gpu.migs is not None else 0
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        self._whole_gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        gpu = self._whole_gpu("nvmlDeviceGetMigDeviceHandleByIndex", device, index)
        if gpu.migs is None or index >= len(gpu.migs):
            raise NVMLError(E.NOT_FOUND)
        return _Handle(gpu, gpu.migs[index])

    def nvmlDeviceGetGpuInstanceId(self, device):
        self._dev("nvmlDeviceGetGpuInstanceId", device)
        if device.mig is None:
            raise NVMLError(E.INVALID_ARGUMENT)
        return device.mig.gpu_instance_id

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._whole_gpu("nvmlDeviceGetUtilizationRates", handle)
        if gpu.migs is not None:
            raise NVMLError(E.NOT_SUPPORTED)
        g, m = gpu.utilization[min(self.step, len(gpu.utilization) - 1)]
        return _Obj(gpu=g, memory=m)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._dev("nvmlDeviceGetMemoryInfo", handle)
        used, total = handle.mig.memory if handle.mig else gpu.memory
        return _Obj(used=used, total=total, free=total - used)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._whole_gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._whole_gpu("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetTemperatureV(self, handle, sensor, version=0x100000C):
        return self._whole_gpu("nvmlDeviceGetTemperatureV", handle, sensor).temperature_c

    def nvmlDeviceGetTemperature(self, handle, sensor):
        raise AssertionError("nvmlDeviceGetTemperature is deprecated: use nvmlDeviceGetTemperatureV")

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._whole_gpu("nvmlDeviceGetClockInfo", handle, type)
        if type != CONSTANTS["NVML_CLOCK_SM"]:
            raise NVMLError(E.INVALID_ARGUMENT)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._whole_gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        raise AssertionError("deprecated: use nvmlDeviceGetCurrentClocksEventReasons")

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        gpu = self._whole_gpu("nvmlDeviceGetTotalEccErrors", handle, errorType, counterType)
        return gpu.ecc[errorType]

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        return self._whole_gpu("nvmlDeviceGetPcieThroughput", device, counter).pcie_kbps[counter]

    def _process_list(self, name: str, handle: _Handle, which: str) -> list:
        gpu = self._dev(name, handle)
        if handle.mig is not None:
            procs = handle.mig.processes if which == "compute" else {}
            gi = handle.mig.gpu_instance_id
        else:
            procs = gpu.compute if which == "compute" else gpu.graphics
            gi = 0xFFFFFFFF
        return [_Obj(pid=p, usedGpuMemory=b, gpuInstanceId=gi, computeInstanceId=0) for p, b in procs.items()]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self._process_list("nvmlDeviceGetComputeRunningProcesses", handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self._process_list("nvmlDeviceGetGraphicsRunningProcesses", handle, "graphics")

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):
        gpu = self._whole_gpu("nvmlDeviceGetProcessUtilization", handle, timeStamp)
        new = [s for s in gpu.process_samples if s[1] > timeStamp]
        if not new:
            raise NVMLError(E.NOT_FOUND)  # nvidia-ml-py: no samples since timeStamp
        return [
            _Obj(pid=p, timeStamp=ts, smUtil=sm, memUtil=mu, encUtil=0, decUtil=0) for p, ts, sm, mu in new
        ]

    def nvmlGpmQueryDeviceSupport(self, device):
        gpu = self._whole_gpu("nvmlGpmQueryDeviceSupport", device)
        return c_nvmlGpmSupport_t(CONSTANTS["NVML_GPM_SUPPORT_VERSION"], 1 if gpu.gpm is not None else 0)

    def nvmlGpmSampleAlloc(self):
        self._enter("nvmlGpmSampleAlloc")
        struct = struct_c_nvmlGpmSample_t()
        address = ctypes.addressof(struct)
        self._gpm_keep[address] = struct
        self.gpm_samples[address] = None
        return c_nvmlGpmSample_t(struct)

    def _gpm_sample(self, sample) -> int:  # c_nvmlGpmSample_t
        address = ctypes.addressof(sample.contents) if sample else 0
        if address not in self.gpm_samples:
            raise NVMLError(E.INVALID_ARGUMENT)  # never allocated, or freed
        return address

    def nvmlGpmSampleGet(self, device, gpmSample):
        gpu = self._whole_gpu("nvmlGpmSampleGet", device, gpmSample)
        if gpu.gpm is None:
            raise NVMLError(E.NOT_SUPPORTED)
        self.gpm_samples[self._gpm_sample(gpmSample)] = (gpu, self.step)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet):
        self._enter("nvmlGpmMetricsGet", metricsGet)
        if metricsGet.version != CONSTANTS["NVML_GPM_METRICS_GET_VERSION"]:
            raise NVMLError(E.ARGUMENT_VERSION_MISMATCH)
        first = self.gpm_samples[self._gpm_sample(metricsGet.sample1)]
        second = self.gpm_samples[self._gpm_sample(metricsGet.sample2)]
        if first is None or second is None or first[0] is not second[0] or first[1] >= second[1]:
            raise NVMLError(E.INVALID_ARGUMENT)  # not two samples of one GPU, the older first
        gpu, step = second
        values = gpu.gpm[min(step, len(gpu.gpm) - 1)] if gpu.gpm else {}
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in values:
                metric.value, metric.nvmlReturn = values[metric.metricId], 0
            else:
                metric.value, metric.nvmlReturn = 0.0, E.NOT_SUPPORTED
        return metricsGet

    def nvmlGpmSampleFree(self, gpmSample):
        self.calls.append(("nvmlGpmSampleFree", (gpmSample,)))
        address = self._gpm_sample(gpmSample)
        del self.gpm_samples[address]
        del self._gpm_keep[address]

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        return _Obj(kind="event set")

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        gpu = self._whole_gpu("nvmlDeviceGetSupportedEventTypes", handle)
        return CONSTANTS["nvmlEventTypeXidCriticalError"] | 0x3 if gpu.xid_supported else 0x3

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        gpu = self._whole_gpu("nvmlDeviceRegisterEvents", handle, eventTypes, eventSet)
        self._registered.add(gpu.uuid)

    def nvmlEventSetWait(self, eventSet, timeoutms):
        self._enter("nvmlEventSetWait", eventSet, timeoutms)
        for i, (uuid, xid) in enumerate(self.events):
            if uuid in self._registered:
                del self.events[i]
                gpu = next(g for g in self.gpus if g.uuid == uuid)
                return _Obj(
                    device=_Handle(gpu),
                    eventType=CONSTANTS["nvmlEventTypeXidCriticalError"],
                    eventData=xid,
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
        raise NVMLError(E.TIMEOUT)

    def nvmlEventSetFree(self, eventSet):
        self.calls.append(("nvmlEventSetFree", (eventSet,)))
