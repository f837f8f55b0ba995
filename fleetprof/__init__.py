"""fleetprof: always-on eBPF fleet profiler. This package holds the CLI (cli/), the helpers the agent and
the collector share (TLS, tokens, the HTTP server and client) and the code generated from proto/ (_proto/)."""

__version__ = "0.1.0"
