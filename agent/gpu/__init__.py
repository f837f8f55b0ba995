"""GPUs: the NVML poller (its own thread), the busy/idle timeline, the window sent to the collector."""
