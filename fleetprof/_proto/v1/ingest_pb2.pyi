from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_STATE_NONE: _ClassVar[GpuState]
    GPU_STATE_IDLE: _ClassVar[GpuState]
    GPU_STATE_BUSY: _ClassVar[GpuState]
GPU_STATE_NONE: GpuState
GPU_STATE_IDLE: GpuState
GPU_STATE_BUSY: GpuState

class AgentIdentity(_message.Message):
    __slots__ = ("node", "agent_id", "boot_time_unix_ns", "version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_id: str
    boot_time_unix_ns: int
    version: str
    def __init__(self, node: _Optional[str] = ..., agent_id: _Optional[str] = ..., boot_time_unix_ns: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("agent", "sequence", "start_unix_ns", "end_unix_ns", "frequency_hz", "strings", "stacks", "processes", "stats", "sample_columns", "stack_ids", "process_ids", "frame_columns", "stack_columns", "syscalls", "syscall_latency_sample_every", "syscall_tracer", "syscall_latency_duty", "gpu_devices", "gpu_processes", "gpu_source", "offcpu_columns", "offcpu_stats", "cuda_launch_columns", "cuda_kernel_columns", "cuda_calls", "cuda_activity", "cuda_stats")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_HZ_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STACK_IDS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAME_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STACK_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    SYSCALLS_FIELD_NUMBER: _ClassVar[int]
    SYSCALL_LATENCY_SAMPLE_EVERY_FIELD_NUMBER: _ClassVar[int]
    SYSCALL_TRACER_FIELD_NUMBER: _ClassVar[int]
    SYSCALL_LATENCY_DUTY_FIELD_NUMBER: _ClassVar[int]
    GPU_DEVICES_FIELD_NUMBER: _ClassVar[int]
    GPU_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    GPU_SOURCE_FIELD_NUMBER: _ClassVar[int]
    OFFCPU_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    OFFCPU_STATS_FIELD_NUMBER: _ClassVar[int]
    CUDA_LAUNCH_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CUDA_KERNEL_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CUDA_CALLS_FIELD_NUMBER: _ClassVar[int]
    CUDA_ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    CUDA_STATS_FIELD_NUMBER: _ClassVar[int]
    agent: AgentIdentity
    sequence: int
    start_unix_ns: int
    end_unix_ns: int
    frequency_hz: int
    strings: _containers.RepeatedScalarFieldContainer[str]
    stacks: _containers.RepeatedCompositeFieldContainer[Stack]
    processes: _containers.RepeatedCompositeFieldContainer[Process]
    stats: SamplerStats
    sample_columns: SampleColumns
    stack_ids: _containers.RepeatedScalarFieldContainer[int]
    process_ids: _containers.RepeatedScalarFieldContainer[int]
    frame_columns: FrameColumns
    stack_columns: StackColumns
    syscalls: _containers.RepeatedCompositeFieldContainer[SyscallStats]
    syscall_latency_sample_every: int
    syscall_tracer: SyscallTracerStats
    syscall_latency_duty: float
    gpu_devices: _containers.RepeatedCompositeFieldContainer[GpuDevice]
    gpu_processes: _containers.RepeatedCompositeFieldContainer[GpuProcessUsage]
    gpu_source: GpuSource
    offcpu_columns: OffCpuColumns
    offcpu_stats: OffCpuStats
    cuda_launch_columns: CudaLaunchColumns
    cuda_kernel_columns: CudaKernelColumns
    cuda_calls: _containers.RepeatedCompositeFieldContainer[CudaCallStats]
    cuda_activity: _containers.RepeatedCompositeFieldContainer[CudaActivity]
    cuda_stats: CudaStats
    def __init__(self, agent: _Optional[_Union[AgentIdentity, _Mapping]] = ..., sequence: _Optional[int] = ..., start_unix_ns: _Optional[int] = ..., end_unix_ns: _Optional[int] = ..., frequency_hz: _Optional[int] = ..., strings: _Optional[_Iterable[str]] = ..., stacks: _Optional[_Iterable[_Union[Stack, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[Process, _Mapping]]] = ..., stats: _Optional[_Union[SamplerStats, _Mapping]] = ..., sample_columns: _Optional[_Union[SampleColumns, _Mapping]] = ..., stack_ids: _Optional[_Iterable[int]] = ..., process_ids: _Optional[_Iterable[int]] = ..., frame_columns: _Optional[_Union[FrameColumns, _Mapping]] = ..., stack_columns: _Optional[_Union[StackColumns, _Mapping]] = ..., syscalls: _Optional[_Iterable[_Union[SyscallStats, _Mapping]]] = ..., syscall_latency_sample_every: _Optional[int] = ..., syscall_tracer: _Optional[_Union[SyscallTracerStats, _Mapping]] = ..., syscall_latency_duty: _Optional[float] = ..., gpu_devices: _Optional[_Iterable[_Union[GpuDevice, _Mapping]]] = ..., gpu_processes: _Optional[_Iterable[_Union[GpuProcessUsage, _Mapping]]] = ..., gpu_source: _Optional[_Union[GpuSource, _Mapping]] = ..., offcpu_columns: _Optional[_Union[OffCpuColumns, _Mapping]] = ..., offcpu_stats: _Optional[_Union[OffCpuStats, _Mapping]] = ..., cuda_launch_columns: _Optional[_Union[CudaLaunchColumns, _Mapping]] = ..., cuda_kernel_columns: _Optional[_Union[CudaKernelColumns, _Mapping]] = ..., cuda_calls: _Optional[_Iterable[_Union[CudaCallStats, _Mapping]]] = ..., cuda_activity: _Optional[_Iterable[_Union[CudaActivity, _Mapping]]] = ..., cuda_stats: _Optional[_Union[CudaStats, _Mapping]] = ...) -> None: ...

class CudaLaunchColumns(_message.Message):
    __slots__ = ("process", "stack", "count", "gpu")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    process: _containers.RepeatedScalarFieldContainer[int]
    stack: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    gpu: _containers.RepeatedScalarFieldContainer[GpuState]
    def __init__(self, process: _Optional[_Iterable[int]] = ..., stack: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., gpu: _Optional[_Iterable[_Union[GpuState, str]]] = ...) -> None: ...

class CudaKernelColumns(_message.Message):
    __slots__ = ("process", "stack", "kernel_ns")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NS_FIELD_NUMBER: _ClassVar[int]
    process: _containers.RepeatedScalarFieldContainer[int]
    stack: _containers.RepeatedScalarFieldContainer[int]
    kernel_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, process: _Optional[_Iterable[int]] = ..., stack: _Optional[_Iterable[int]] = ..., kernel_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class CudaCallStats(_message.Message):
    __slots__ = ("process", "call", "count", "timed", "timed_ns", "latency_log2_ns")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMED_FIELD_NUMBER: _ClassVar[int]
    TIMED_NS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_LOG2_NS_FIELD_NUMBER: _ClassVar[int]
    process: int
    call: int
    count: int
    timed: int
    timed_ns: int
    latency_log2_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, process: _Optional[int] = ..., call: _Optional[int] = ..., count: _Optional[int] = ..., timed: _Optional[int] = ..., timed_ns: _Optional[int] = ..., latency_log2_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class CudaActivity(_message.Message):
    __slots__ = ("process", "device", "uuid", "known_ns", "idle_ns", "gaps", "gap_histogram", "longest_gap_ns", "records_lost")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    GAP_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    LONGEST_GAP_NS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_LOST_FIELD_NUMBER: _ClassVar[int]
    process: int
    device: int
    uuid: int
    known_ns: int
    idle_ns: int
    gaps: int
    gap_histogram: _containers.RepeatedScalarFieldContainer[int]
    longest_gap_ns: int
    records_lost: int
    def __init__(self, process: _Optional[int] = ..., device: _Optional[int] = ..., uuid: _Optional[int] = ..., known_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., gaps: _Optional[int] = ..., gap_histogram: _Optional[_Iterable[int]] = ..., longest_gap_ns: _Optional[int] = ..., records_lost: _Optional[int] = ...) -> None: ...

class CudaStats(_message.Message):
    __slots__ = ("launch_sample_every", "launches", "launches_sampled", "table_full", "kernels", "kernels_attributed")
    LAUNCH_SAMPLE_EVERY_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TABLE_FULL_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_ATTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    launch_sample_every: int
    launches: int
    launches_sampled: int
    table_full: int
    kernels: int
    kernels_attributed: int
    def __init__(self, launch_sample_every: _Optional[int] = ..., launches: _Optional[int] = ..., launches_sampled: _Optional[int] = ..., table_full: _Optional[int] = ..., kernels: _Optional[int] = ..., kernels_attributed: _Optional[int] = ...) -> None: ...

class OffCpuColumns(_message.Message):
    __slots__ = ("process", "stack", "blocked_ns", "gpu", "idle")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_NS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    process: _containers.RepeatedScalarFieldContainer[int]
    stack: _containers.RepeatedScalarFieldContainer[int]
    blocked_ns: _containers.RepeatedScalarFieldContainer[int]
    gpu: _containers.RepeatedScalarFieldContainer[GpuState]
    idle: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, process: _Optional[_Iterable[int]] = ..., stack: _Optional[_Iterable[int]] = ..., blocked_ns: _Optional[_Iterable[int]] = ..., gpu: _Optional[_Iterable[_Union[GpuState, str]]] = ..., idle: _Optional[_Iterable[bool]] = ...) -> None: ...

class OffCpuStats(_message.Message):
    __slots__ = ("switches", "sampled", "recorded", "below_min", "state_full", "sample_every", "min_block_ns")
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    BELOW_MIN_FIELD_NUMBER: _ClassVar[int]
    STATE_FULL_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_EVERY_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCK_NS_FIELD_NUMBER: _ClassVar[int]
    switches: int
    sampled: int
    recorded: int
    below_min: int
    state_full: int
    sample_every: int
    min_block_ns: int
    def __init__(self, switches: _Optional[int] = ..., sampled: _Optional[int] = ..., recorded: _Optional[int] = ..., below_min: _Optional[int] = ..., state_full: _Optional[int] = ..., sample_every: _Optional[int] = ..., min_block_ns: _Optional[int] = ...) -> None: ...

class GpuSource(_message.Message):
    __slots__ = ("up", "state", "idle_below_percent")
    UP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IDLE_BELOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    up: bool
    state: int
    idle_below_percent: int
    def __init__(self, up: _Optional[bool] = ..., state: _Optional[int] = ..., idle_below_percent: _Optional[int] = ...) -> None: ...

class GpuDevice(_message.Message):
    __slots__ = ("index", "uuid", "name", "mig_mode", "parent_uuid", "gpu_instance_id", "samples", "xid_errors", "xid_codes", "owner_namespace", "owner_pod", "owner_container", "xid_watched")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIG_MODE_FIELD_NUMBER: _ClassVar[int]
    PARENT_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    XID_ERRORS_FIELD_NUMBER: _ClassVar[int]
    XID_CODES_FIELD_NUMBER: _ClassVar[int]
    OWNER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    OWNER_POD_FIELD_NUMBER: _ClassVar[int]
    OWNER_CONTAINER_FIELD_NUMBER: _ClassVar[int]
    XID_WATCHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: int
    name: int
    mig_mode: bool
    parent_uuid: int
    gpu_instance_id: int
    samples: _containers.RepeatedCompositeFieldContainer[GpuSample]
    xid_errors: int
    xid_codes: _containers.RepeatedScalarFieldContainer[int]
    owner_namespace: int
    owner_pod: int
    owner_container: int
    xid_watched: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[int] = ..., name: _Optional[int] = ..., mig_mode: _Optional[bool] = ..., parent_uuid: _Optional[int] = ..., gpu_instance_id: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[GpuSample, _Mapping]]] = ..., xid_errors: _Optional[int] = ..., xid_codes: _Optional[_Iterable[int]] = ..., owner_namespace: _Optional[int] = ..., owner_pod: _Optional[int] = ..., owner_container: _Optional[int] = ..., xid_watched: _Optional[bool] = ...) -> None: ...

class GpuSample(_message.Message):
    __slots__ = ("time_unix_ns", "gpu_utilization_percent", "memory_utilization_percent", "memory_used_bytes", "memory_total_bytes", "power_milliwatts", "energy_millijoules", "temperature_celsius", "sm_clock_mhz", "clock_event_reasons", "ecc_corrected_errors", "ecc_uncorrected_errors", "pcie_tx_kilobytes_per_second", "pcie_rx_kilobytes_per_second", "sm_active_percent", "sm_occupancy_percent", "tensor_active_percent", "dram_bandwidth_percent")
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POWER_MILLIWATTS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_MILLIJOULES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PCIE_TX_KILOBYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PCIE_RX_KILOBYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SM_ACTIVE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    SM_OCCUPANCY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ACTIVE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    DRAM_BANDWIDTH_PERCENT_FIELD_NUMBER: _ClassVar[int]
    time_unix_ns: int
    gpu_utilization_percent: int
    memory_utilization_percent: int
    memory_used_bytes: int
    memory_total_bytes: int
    power_milliwatts: int
    energy_millijoules: int
    temperature_celsius: int
    sm_clock_mhz: int
    clock_event_reasons: int
    ecc_corrected_errors: int
    ecc_uncorrected_errors: int
    pcie_tx_kilobytes_per_second: int
    pcie_rx_kilobytes_per_second: int
    sm_active_percent: float
    sm_occupancy_percent: float
    tensor_active_percent: float
    dram_bandwidth_percent: float
    def __init__(self, time_unix_ns: _Optional[int] = ..., gpu_utilization_percent: _Optional[int] = ..., memory_utilization_percent: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., power_milliwatts: _Optional[int] = ..., energy_millijoules: _Optional[int] = ..., temperature_celsius: _Optional[int] = ..., sm_clock_mhz: _Optional[int] = ..., clock_event_reasons: _Optional[int] = ..., ecc_corrected_errors: _Optional[int] = ..., ecc_uncorrected_errors: _Optional[int] = ..., pcie_tx_kilobytes_per_second: _Optional[int] = ..., pcie_rx_kilobytes_per_second: _Optional[int] = ..., sm_active_percent: _Optional[float] = ..., sm_occupancy_percent: _Optional[float] = ..., tensor_active_percent: _Optional[float] = ..., dram_bandwidth_percent: _Optional[float] = ...) -> None: ...

class GpuProcessUsage(_message.Message):
    __slots__ = ("process", "device", "polls", "state_polls", "idle_polls", "memory_used_bytes", "sm_utilization_percent", "memory_utilization_percent")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLLS_FIELD_NUMBER: _ClassVar[int]
    STATE_POLLS_FIELD_NUMBER: _ClassVar[int]
    IDLE_POLLS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SM_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    process: int
    device: int
    polls: int
    state_polls: int
    idle_polls: int
    memory_used_bytes: int
    sm_utilization_percent: int
    memory_utilization_percent: int
    def __init__(self, process: _Optional[int] = ..., device: _Optional[int] = ..., polls: _Optional[int] = ..., state_polls: _Optional[int] = ..., idle_polls: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., sm_utilization_percent: _Optional[int] = ..., memory_utilization_percent: _Optional[int] = ...) -> None: ...

class SyscallStats(_message.Message):
    __slots__ = ("process", "syscall", "count", "timed", "timed_ns", "latency_log2_ns")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    SYSCALL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMED_FIELD_NUMBER: _ClassVar[int]
    TIMED_NS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_LOG2_NS_FIELD_NUMBER: _ClassVar[int]
    process: int
    syscall: int
    count: int
    timed: int
    timed_ns: int
    latency_log2_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, process: _Optional[int] = ..., syscall: _Optional[int] = ..., count: _Optional[int] = ..., timed: _Optional[int] = ..., timed_ns: _Optional[int] = ..., latency_log2_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class SyscallTracerStats(_message.Message):
    __slots__ = ("table_full", "stale_starts")
    TABLE_FULL_FIELD_NUMBER: _ClassVar[int]
    STALE_STARTS_FIELD_NUMBER: _ClassVar[int]
    table_full: int
    stale_starts: int
    def __init__(self, table_full: _Optional[int] = ..., stale_starts: _Optional[int] = ...) -> None: ...

class Stack(_message.Message):
    __slots__ = ("functions", "modules", "kernel_start")
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_START_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedScalarFieldContainer[int]
    modules: _containers.RepeatedScalarFieldContainer[int]
    kernel_start: int
    def __init__(self, functions: _Optional[_Iterable[int]] = ..., modules: _Optional[_Iterable[int]] = ..., kernel_start: _Optional[int] = ...) -> None: ...

class FrameColumns(_message.Message):
    __slots__ = ("index_bytes", "functions", "modules", "ids")
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    index_bytes: int
    functions: bytes
    modules: bytes
    ids: bytes
    def __init__(self, index_bytes: _Optional[int] = ..., functions: _Optional[bytes] = ..., modules: _Optional[bytes] = ..., ids: _Optional[bytes] = ...) -> None: ...

class StackColumns(_message.Message):
    __slots__ = ("index_bytes", "frames", "lengths", "kernel_starts")
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_STARTS_FIELD_NUMBER: _ClassVar[int]
    index_bytes: int
    frames: bytes
    lengths: bytes
    kernel_starts: bytes
    def __init__(self, index_bytes: _Optional[int] = ..., frames: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., kernel_starts: _Optional[bytes] = ...) -> None: ...

class Label(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: int
    value: int
    def __init__(self, name: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...

class Process(_message.Message):
    __slots__ = ("pid", "start_time_ticks", "comm", "exe", "labels")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_TICKS_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    EXE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_time_ticks: int
    comm: int
    exe: int
    labels: _containers.RepeatedCompositeFieldContainer[Label]
    def __init__(self, pid: _Optional[int] = ..., start_time_ticks: _Optional[int] = ..., comm: _Optional[int] = ..., exe: _Optional[int] = ..., labels: _Optional[_Iterable[_Union[Label, _Mapping]]] = ...) -> None: ...

class SampleColumns(_message.Message):
    __slots__ = ("process", "stack", "count", "gpu")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    process: _containers.RepeatedScalarFieldContainer[int]
    stack: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    gpu: _containers.RepeatedScalarFieldContainer[GpuState]
    def __init__(self, process: _Optional[_Iterable[int]] = ..., stack: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., gpu: _Optional[_Iterable[_Union[GpuState, str]]] = ...) -> None: ...

class SamplerStats(_message.Message):
    __slots__ = ("samples", "user_stack_missing", "user_stack_errors", "kernel_stack_errors", "stack_table_full", "count_table_full", "unknown_process")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USER_STACK_MISSING_FIELD_NUMBER: _ClassVar[int]
    USER_STACK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_STACK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STACK_TABLE_FULL_FIELD_NUMBER: _ClassVar[int]
    COUNT_TABLE_FULL_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_PROCESS_FIELD_NUMBER: _ClassVar[int]
    samples: int
    user_stack_missing: int
    user_stack_errors: int
    kernel_stack_errors: int
    stack_table_full: int
    count_table_full: int
    unknown_process: int
    def __init__(self, samples: _Optional[int] = ..., user_stack_missing: _Optional[int] = ..., user_stack_errors: _Optional[int] = ..., kernel_stack_errors: _Optional[int] = ..., stack_table_full: _Optional[int] = ..., count_table_full: _Optional[int] = ..., unknown_process: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...
