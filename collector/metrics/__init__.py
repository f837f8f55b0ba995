"""Prometheus collectors: what the collector exports about the fleet (CPU, syscalls, GPUs) and itself."""
