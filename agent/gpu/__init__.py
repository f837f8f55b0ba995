"""GPUs: the NVML poller (its own thread), the busy/idle timeline, the window sent to the collector; where a
workload loads our CUPTI library (agent/cupti/), its ring's reader and the exact activity timeline."""
