"""fleetprof: always-on eBPF fleet profiler (CLI, shared helpers and the generated wire code in v1/)."""

__version__ = "0.1.0"
