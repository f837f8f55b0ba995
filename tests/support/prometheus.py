"""A real Prometheus server for tests: Debian's `prometheus` on a free 127.0.0.1 port, scraping every 1 s."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import free_port, stop_process, wait_until

SCRAPE_INTERVAL = "1s"


class PrometheusQueryError(Exception):
    """Prometheus answered a query with status "error" (bad PromQL, or it failed to evaluate)."""


@dataclass(frozen=True)
class Target:
    """One static scrape job: `address` is host:port serving /metrics."""

    job: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)
    # True keeps the target's own `namespace`/`pod` labels (the collector's, which name profiled pods)
    # instead of renaming them exported_*, as the collector's ServiceMonitor does with honorLabels.
    honor_labels: bool = False
    # A protected collector: https with this CA (and server name), and the API token from this file.
    ca_file: str | None = None
    server_name: str | None = None
    token_file: str | None = None


def _job(t: Target) -> dict:
    job: dict = {
        "job_name": t.job,
        "honor_labels": t.honor_labels,
        "metrics_path": "/metrics",
        "static_configs": [{"targets": [t.address], "labels": t.labels}],
    }
    if t.ca_file:
        job["scheme"] = "https"
        job["tls_config"] = {"ca_file": t.ca_file} | ({"server_name": t.server_name} if t.server_name else {})
    if t.token_file:
        job["authorization"] = {"type": "Bearer", "credentials_file": t.token_file}
    return job


def require_prometheus() -> str:
    """The prometheus binary; fails (never skips) without it, so CI cannot pass without these tests."""
    path = shutil.which("prometheus")
    if not path:
        pytest.fail(
            "the Prometheus end-to-end tests need the `prometheus` binary (Debian package `prometheus`); "
            "run `make test`, which installs it"
        )
    return path


def scrape_config(targets: list[Target], self_address: str) -> dict:
    """The whole prometheus.yml (JSON is YAML); Prometheus also scrapes itself, job "prometheus"."""
    jobs = [*targets, Target("prometheus", self_address)]
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [_job(t) for t in jobs],
    }


@dataclass
class Prometheus:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def api(self, endpoint: str, **params: str) -> dict:
        """GET /api/v1/ENDPOINT; the `data` of a success, else PrometheusQueryError with its message."""
        url = f"{self.url}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as err:  # 400 bad_data, 422 execution, 503 timeout: JSON bodies
            body = err.read()
            try:
                answer = json.loads(body)
            except ValueError:
                answer = {"errorType": f"HTTP {err.code}", "error": body.decode(errors="replace")}
        if answer.get("status") != "success":
            raise PrometheusQueryError(f"{answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query at now: [{"metric": {...}, "value": [t, "v"]}, ...] for a vector."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an expression with at most one series; None when it has none."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} has {len(result)} series: {[r['metric'] for r in result]}"
        return float(result[0]["value"][1]) if result else None

    def values_by(self, expr: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(expr)}


def start_prometheus(targets: list[Target], workdir: Path, timeout: float = 30.0) -> Prometheus:
    """Starts Prometheus on 127.0.0.1 (never :9090) with its TSDB under `workdir`; returns once /-/ready."""
    binary = require_prometheus()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps(scrape_config(targets, f"127.0.0.1:{port}"), indent=2))
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    prom = Prometheus(proc, port, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}:\n{prom.log_tail()}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, timeout, "Prometheus to answer /-/ready")
    except BaseException:
        stop_prometheus(prom)
        raise
    return prom


def stop_prometheus(prom: Prometheus) -> None:
    stop_process(prom.proc, 15)


def wait_for(prom: Prometheus, expr: str, timeout: float = 30.0) -> list[dict]:
    """Polls an instant query until it returns at least one series (a PromQL filter such as `> 0` makes
    this "until true"); the series, or an AssertionError naming the expression."""
    started = time.monotonic()
    try:
        return wait_until(lambda: prom.query(expr), timeout, f"Prometheus to answer {expr!r}", every=0.25)
    except AssertionError as err:
        waited = time.monotonic() - started
        raise AssertionError(f"{err} ({waited:.0f}s); Prometheus log:\n{prom.log_tail(1500)}") from None
