"""TLS, mutual TLS and tokens on the collector's two ports, with certificates made here and real grpcio TLS:
the right credentials get through, every wrong one is refused and stores nothing, and rotated tokens and
certificates take effect without a restart."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.agent.shipper import Shipper
from fleetprof.auth import TokenFile, TokenFileError, presented_token
from fleetprof.collector.main import Collector, CollectorConfig
from fleetprof.tls import ClientTls, ClientTlsConfig, TlsError
from tests.conftest import REPO, free_port, start_agent, stop_process, wait_until
from tests.support.certs import Ca
from tests.support.wire import make_batch

INGEST_TOKEN = "ingest-0f8b3c6e2a"
API_TOKEN = "api-7d41e9a0bb"


@dataclass
class Secured:
    collector: Collector
    dir: Path
    ca: Ca

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.collector.grpc_port}"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.collector.http_port}"

    def get(
        self, path: str, headers: dict[str, str] | None = None, ca: Path | None = None
    ) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(ca or self.ca.cert))
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def nodes(self) -> dict[str, int]:
        """Samples stored per node, read through the protected API."""
        status, body = self.get("/api/v1/top?by=node&since=1h", {"Authorization": f"Bearer {API_TOKEN}"})
        assert status == 200, body
        return {g["labels"]["node"]: g["samples"] for g in json.loads(body)["groups"]}

    def rejected(self, reason: str) -> int:
        return self.collector.ingest.stats.rejected.get(reason, 0)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    """A collector with every protection on: TLS, client certificates required, both tokens."""
    ca = Ca(tmp_path, "fleet")
    server = ca.server()
    config = CollectorConfig(
        grpc="127.0.0.1:0",
        http=f"127.0.0.1:{free_port()}",
        tls_cert=str(server.cert),
        tls_key=str(server.key),
        tls_client_ca=str(ca.cert),
        auth_token_file=str(
            _write(tmp_path / "ingest-tokens", f"# accepted ingest tokens\n{INGEST_TOKEN}\n")
        ),
        api_token_file=str(_write(tmp_path / "api-tokens", API_TOKEN + "\n")),
    )
    col = Collector(config)
    col.start()
    try:
        yield Secured(col, tmp_path, ca)
    finally:
        col.stop()


def _shipper(
    s: Secured, token: str | None = INGEST_TOKEN, client: bool = True, node: str = "node-good", **tls: object
) -> Shipper:
    """A shipper with a client certificate for `node` (its common name): the nodes it may write as."""
    pair = s.ca.client(f"client-{node}", name=node) if client else None
    config = ClientTlsConfig(
        ca=str(tls.get("ca", s.ca.cert)),
        cert=str(pair.cert) if pair else None,
        key=str(pair.key) if pair else None,
        server_name=tls.get("server_name"),  # type: ignore[arg-type]
    )
    token_file = _write(s.dir / f"agent-token-{free_port()}", token + "\n") if token else None
    shipper = Shipper(
        s.target,
        backoff_s=(0.05, 0.2),
        tls=ClientTls(config),
        tokens=TokenFile(str(token_file)) if token_file else None,
    )
    shipper.start()
    return shipper


def test_an_agent_with_the_right_certificate_and_token_is_stored(secured: Secured) -> None:
    shipper = _shipper(secured, server_name="localhost")  # the certificate's DNS name, not the address
    try:
        shipper.submit(make_batch(node="node-good", count=7))
        assert shipper.flush(20), f"not acknowledged: {shipper.stats}"
    finally:
        shipper.stop()
    assert secured.nodes() == {"node-good": 7}


@pytest.mark.parametrize("token", [None, "ingest-wrong", INGEST_TOKEN + "x", INGEST_TOKEN[:-1]])
def test_a_missing_or_wrong_ingest_token_is_unauthenticated_and_stores_nothing(
    secured: Secured, token: str | None
) -> None:
    client = secured.ca.client()
    creds = grpc.ssl_channel_credentials(
        secured.ca.cert.read_bytes(), client.key.read_bytes(), client.cert.read_bytes()
    )
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.secure_channel(secured.target, creds) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(
                pb_grpc.IngestStub(ch).Push(
                    iter([make_batch(node="node-bad")]), metadata=metadata, timeout=10
                )
            )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in err.value.details()
    assert secured.rejected("unauthenticated") == 1
    assert secured.nodes() == {}


def test_the_agent_keeps_refused_batches_and_a_rotated_token_gets_them_through(secured: Secured) -> None:
    """The agent's token is not (yet) accepted: it keeps the batch and retries. Once the collector's token
    file accepts it (a second line: rotation without downtime), the same batch arrives, once."""
    shipper = _shipper(secured, token="ingest-next-4c2a", node="node-rotated")
    try:
        shipper.submit(make_batch(node="node-rotated", count=3))
        wait_until(lambda: secured.rejected("unauthenticated") >= 2, 20, "the collector to refuse the token")
        assert shipper.pending() == 1 and shipper.stats.batches_rejected == 0
        _write(secured.dir / "ingest-tokens", f"{INGEST_TOKEN}\ningest-next-4c2a\n")
        assert shipper.flush(20), f"not acknowledged after rotation: {shipper.stats}"
    finally:
        shipper.stop()
    assert secured.nodes() == {"node-rotated": 3}


def test_the_agent_reads_its_own_rotated_token_file(secured: Secured) -> None:
    shipper = _shipper(secured, token="stale", node="node-agent-rotated")
    try:
        shipper.submit(make_batch(node="node-agent-rotated", count=2))
        wait_until(lambda: secured.rejected("unauthenticated") >= 1, 20, "the collector to refuse the token")
        token_file = next(secured.dir.glob("agent-token-*"))
        _write(token_file, INGEST_TOKEN + "\n")
        assert shipper.flush(20), f"not acknowledged after the agent's token changed: {shipper.stats}"
    finally:
        shipper.stop()
    assert secured.nodes() == {"node-agent-rotated": 2}


def _refused_connection(secured: Secured, shipper: Shipper) -> None:
    """The shipper cannot get its batch through (it keeps it), and nothing is stored."""
    try:
        shipper.submit(make_batch(node="node-refused"))
        wait_until(lambda: shipper.stats.send_errors >= 2, 20, "the connection to fail")
        assert shipper.pending() == 1
    finally:
        shipper.stop(flush_timeout_s=0)
    assert secured.nodes() == {}


def test_no_client_certificate_when_one_is_required_is_refused(secured: Secured) -> None:
    _refused_connection(secured, _shipper(secured, client=False))


def test_a_client_certificate_from_another_ca_is_refused(secured: Secured) -> None:
    other = Ca(secured.dir, "other")
    stranger = other.client()
    shipper = Shipper(
        secured.target,
        backoff_s=(0.05, 0.2),
        tls=ClientTls(ClientTlsConfig(str(secured.ca.cert), str(stranger.cert), str(stranger.key))),
        tokens=TokenFile(str(_write(secured.dir / "t", INGEST_TOKEN))),
    )
    shipper.start()
    _refused_connection(secured, shipper)


def test_an_agent_that_does_not_trust_the_server_certificate_does_not_send(secured: Secured) -> None:
    other = Ca(secured.dir, "other")
    _refused_connection(secured, _shipper(secured, ca=other.cert))


def test_plaintext_against_tls_is_refused_on_both_ports(secured: Secured) -> None:
    shipper = Shipper(secured.target, backoff_s=(0.05, 0.2))  # no TLS, no token
    shipper.start()
    _refused_connection(secured, shipper)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secured.collector.http_port}/healthz", timeout=10)


def test_http_needs_the_api_token_except_healthz(secured: Secured) -> None:
    assert secured.get("/healthz")[0] == 200
    for path in ("/", "/api/v1/top", "/metrics", "/api/v1/profile?format=folded", "/no-such-page"):
        status, body = secured.get(path)
        assert status == 401, path
        assert "token" in json.loads(body)["error"]
        assert secured.get(path, {"Authorization": "Bearer " + API_TOKEN[:-1]})[0] == 401
        assert secured.get(path, {"Authorization": "Bearer " + INGEST_TOKEN})[0] == 401  # the other token
    bearer = {"Authorization": f"Bearer {API_TOKEN}"}
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{API_TOKEN}".encode()).decode()}
    for headers in (bearer, basic):
        assert secured.get("/api/v1/top", headers)[0] == 200
        assert secured.get("/metrics", headers)[0] == 200
    status, page = secured.get("/", basic)  # what a browser sends after its login prompt
    assert status == 200 and b"<html" in page.lower()
    assert secured.collector.http.unauthorized == 15


def test_the_401_asks_a_browser_to_log_in(secured: Secured) -> None:
    ctx = ssl.create_default_context(cafile=str(secured.ca.cert))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(secured.url + "/", timeout=10, context=ctx)
    assert err.value.code == 401
    assert "Basic" in err.value.headers["WWW-Authenticate"]


def test_the_api_token_file_is_read_again_when_it_changes(secured: Secured) -> None:
    new = {"Authorization": "Bearer api-rotated-91c"}
    assert secured.get("/api/v1/top", new)[0] == 401
    _write(secured.dir / "api-tokens", "api-rotated-91c\n")
    assert secured.get("/api/v1/top", new)[0] == 200
    assert secured.get("/api/v1/top", {"Authorization": f"Bearer {API_TOKEN}"})[0] == 401


def test_renewed_server_certificates_are_served_without_a_restart(secured: Secured) -> None:
    """cert-manager renews in place: new certificate and key from a new CA, same paths. New connections on
    both ports present the new certificate; clients that trust only the old CA fail, the new CA works."""
    config = secured.collector.config
    renewed_ca = Ca(secured.dir, "renewed")
    renewed = renewed_ca.server()
    shutil.copy(renewed.cert, config.tls_cert)
    shutil.copy(renewed.key, config.tls_key)
    assert secured.get("/healthz", ca=renewed_ca.cert)[0] == 200
    with pytest.raises(urllib.error.URLError):
        secured.get("/healthz")  # the old CA no longer verifies the server
    client = secured.ca.client()  # client certificates are still checked against --tls-client-ca
    shipper = Shipper(
        secured.target,
        backoff_s=(0.05, 0.2),
        tls=ClientTls(ClientTlsConfig(str(renewed_ca.cert), str(client.cert), str(client.key))),
        tokens=TokenFile(str(_write(secured.dir / "t", INGEST_TOKEN))),
    )
    shipper.start()
    try:
        shipper.submit(make_batch(node="node-renewed", count=4))
        assert shipper.flush(20), f"not acknowledged with the renewed certificate: {shipper.stats}"
    finally:
        shipper.stop()


def test_a_renewal_that_does_not_load_keeps_the_previous_certificate(secured: Secured, caplog) -> None:
    key = Path(secured.collector.config.tls_key)
    key.write_text("-----BEGIN PRIVATE KEY-----\nhalf written\n")
    with caplog.at_level(logging.ERROR, logger="fleetprof.tls"):
        assert secured.get("/healthz")[0] == 200
        assert secured.get("/healthz")[0] == 200
    assert sum("do not load" in r.getMessage() for r in caplog.records) == 1  # said once, not per request


def test_token_files_hold_several_tokens_and_survive_a_botched_rotation(tmp_path: Path) -> None:
    path = _write(tmp_path / "tokens", "# comment\n\n  first  \nsecond\n")
    tokens = TokenFile(str(path))
    assert tokens.current() == "first"
    assert tokens.accepts("first") and tokens.accepts("second")
    assert not tokens.accepts("") and not tokens.accepts("firs") and not tokens.accepts("# comment")
    _write(path, "\n")  # emptied by mistake: the tokens read before stay
    assert tokens.accepts("first")
    path.unlink()
    assert tokens.accepts("second")
    _write(path, "third\n")
    assert tokens.accepts("third") and not tokens.accepts("first")
    with pytest.raises(TokenFileError, match="holds no token"):
        TokenFile(str(_write(tmp_path / "empty", "# nothing\n")))
    with pytest.raises(TokenFileError, match="cannot read"):
        TokenFile(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("Basic " + base64.b64encode(b"user:p:w").decode(), "p:w"),
        ("Basic " + base64.b64encode(b"user:").decode(), None),
        ("Basic !!!", None),
        ("Bearer", None),
        ("Token abc", None),
        ("", None),
    ],
)
def test_presented_token(header: str, token: str | None) -> None:
    assert presented_token(header) == token


def test_unusable_tls_and_token_files_stop_the_start_with_a_clear_error(tmp_path: Path) -> None:
    ca = Ca(tmp_path)
    server = ca.server()
    base = {"grpc": "127.0.0.1:0", "http": f"127.0.0.1:{free_port()}"}
    cases = [
        ({"tls_cert": str(server.cert)}, "both --tls-cert and --tls-key"),
        ({"tls_client_ca": str(ca.cert)}, "needs TLS"),
        ({"tls_cert": str(server.cert), "tls_key": str(ca.cert)}, "do not load together"),
        ({"tls_cert": str(server.cert), "tls_key": str(tmp_path / "nope")}, "cannot read"),
        ({"auth_token_file": str(_write(tmp_path / "e", ""))}, "holds no token"),
    ]
    for extra, message in cases:
        with pytest.raises((TlsError, TokenFileError), match=message):
            Collector(CollectorConfig(**base, **extra))
    with pytest.raises(TlsError, match="both --tls-cert and --tls-key"):
        ClientTlsConfig(ca=str(ca.cert), cert=str(server.cert))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetprof.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_query_commands_take_a_ca_and_a_token(secured: Secured) -> None:
    shipper = _shipper(secured, node="node-cli")
    try:
        shipper.submit(make_batch(node="node-cli", count=5))
        assert shipper.flush(20)
    finally:
        shipper.stop()
    token_file = _write(secured.dir / "cli-token", API_TOKEN + "\n")
    common = ["top", "--collector", secured.url, "--ca", str(secured.ca.cert), "--since", "1h"]
    by_file = _cli(*common, "--token-file", str(token_file))
    assert by_file.returncode == 0, by_file.stderr
    assert "5 samples" in by_file.stdout and "work" in by_file.stdout
    by_env = _cli(*common, env={"FLEETPROF_TOKEN": API_TOKEN})
    # The same table; the first line's clock times may have moved on by a second between the two runs.
    assert by_env.returncode == 0
    assert by_env.stdout.splitlines()[1:] == by_file.stdout.splitlines()[1:]
    missing = _cli(*common)
    assert missing.returncode == 1
    assert "401" in missing.stderr and "--token-file" in missing.stderr
    untrusted = _cli("top", "--collector", secured.url, "--token-file", str(token_file))
    assert untrusted.returncode == 1 and "TLS failed" in untrusted.stderr


def test_the_collector_says_once_which_protections_are_on(tmp_path: Path) -> None:
    ca = Ca(tmp_path)
    server = ca.server()
    token = _write(tmp_path / "t", "x\n")
    port = free_port()
    args = ["collector", "--grpc", "127.0.0.1:0", "--http", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetprof.cli", *args, "--tls-cert", str(server.cert), "--tls-key",
         str(server.key), "--tls-client-ca", str(ca.cert), "--auth-token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        ctx = ssl.create_default_context(cafile=str(ca.cert))

        def up() -> bool:
            try:
                return urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/healthz", timeout=1, context=ctx
                ).status
            except OSError:
                return False

        wait_until(up, 60, "the TLS collector")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if "protections:" in line]
    assert len(lines) == 1, err
    assert "client certificates required" in lines[0] and f"token from {token}" in lines[0]
    assert "HTTP API, UI and /metrics: TLS" in lines[0] and "no token" in lines[0]
    assert f"https://127.0.0.1:{port}/" in out
    plain = subprocess.run(
        [sys.executable, "-m", "fleetprof.cli", *args, "--tls-cert", str(server.cert)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 1 and "both --tls-cert and --tls-key" in plain.stderr


@pytest.mark.bpf
def test_a_real_agent_profiles_into_a_collector_with_every_protection_on(secured: Secured) -> None:
    client = secured.ca.client("agent", name="test-node")  # the node start_agent names
    token = _write(secured.dir / "agent-token", INGEST_TOKEN + "\n")
    agent = start_agent(
        secured.target, 99, 1.0,
        "--tls-ca", str(secured.ca.cert), "--tls-cert", str(client.cert), "--tls-key", str(client.key),
        "--tls-server-name", "localhost", "--auth-token-file", str(token),
        "--metrics-token-file", str(_write(secured.dir / "metrics-token", "agent-metrics-2b\n")),
    )  # fmt: skip
    metrics = f"http://127.0.0.1:{agent.http_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(metrics, timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(metrics, headers={"Authorization": "Bearer agent-metrics-2b"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert b"fleetprof_agent" in resp.read()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wait_until(lambda: secured.nodes().get("test-node", 0) > 20, 60, "the agent's samples to arrive")
    finally:
        spin.kill()
        spin.wait()
        stop_process(agent.proc, 30)
    err = agent.proc.stderr.read().decode()
    agent.proc.stderr.close()
    lines = [line for line in err.splitlines() if "collector connection:" in line]
    assert len(lines) == 1, err[-2000:]
    assert (
        f"TLS (trusting {secured.ca.cert}, server name localhost, client certificate {client.cert})"
        in lines[0]
    )
    assert f"token from {token}; /metrics: token from {secured.dir / 'metrics-token'}" in lines[0]
    assert secured.rejected("unauthenticated") == 0


def test_a_real_prometheus_scrapes_the_protected_metrics_with_the_token(secured: Secured) -> None:
    """What the chart's ServiceMonitor asks of Prometheus: https with the CA, the API token from a file.
    The same target with a wrong token is down with the collector's 401."""
    from tests.support.prometheus import Target, start_prometheus, stop_prometheus

    address = f"127.0.0.1:{secured.collector.http_port}"
    good = _write(secured.dir / "prom-token", API_TOKEN + "\n")
    bad = _write(secured.dir / "prom-wrong-token", "not-the-token\n")
    ca = str(secured.ca.cert)
    targets = [
        Target("fleetprof-collector", address, ca_file=ca, server_name="localhost", token_file=str(good)),
        Target("wrong-token", address, ca_file=ca, token_file=str(bad)),
    ]
    prom = start_prometheus(targets, secured.dir / "prometheus")
    try:
        wait_until(lambda: prom.value('up{job="fleetprof-collector"}') == 1, 30, "the protected scrape")
        assert prom.value('fleetprof_ingest_batches_total{job="fleetprof-collector"}') is not None
        wait_until(lambda: prom.value('up{job="wrong-token"}') == 0, 30, "the refused scrape")
        down = {t["labels"]["job"]: t["lastError"] for t in prom.api("targets")["activeTargets"]}
        assert "401" in down["wrong-token"]
    finally:
        stop_prometheus(prom)
