"""The collector's readers: the HTTP API and web UI, and Grafana's Pyroscope API over Connect."""
