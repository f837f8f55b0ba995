"""The HTTP server's own metrics: what it refused or cut off, by event, and its open connections."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetprof.httpserve import HttpServer


class HttpMetrics:
    def __init__(self, server: HttpServer) -> None:
        self._server = server

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "fleetprof_http_events",
            "HTTP connections and requests by what became of them: accepted, refused_per_address and"
            " refused_busy (503 at once), evicted (closed to make room: it waited longest), request_timeouts"
            " (not whole within the request deadline: 408), idle_closed, write_timeouts, queries_refused"
            " (every query slot taken: 503), over_budget (503), too_large_answers (422), too_long,"
            " too_large_bodies, bad_requests, handshake_failures, unauthorized (401)",
            labels=["event"],
        )
        stats = dict(self._server.stats)
        stats["unauthorized"] = self._server.unauthorized
        for event, n in sorted(stats.items()):
            events.add_metric([event], n)
        yield events
        yield GaugeMetricFamily(
            "fleetprof_http_connections", "HTTP connections open now", value=self._server.connections
        )
