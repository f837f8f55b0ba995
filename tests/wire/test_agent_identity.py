"""An agent writes as its own node only, and cannot reach another agent's dedupe state or wire-id tables:
with client certificates required, a certificate names the node(s) its agent may write as (CN, kubelet's
`system:node:NAME`, or a DNS name) and its subject keys the agent's state; node names are plain names
everywhere. Real grpcio mutual TLS, certificates made here."""

from __future__ import annotations

import json
import logging
import ssl
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc
from fleetprof.collector.ingest.peer import Peer, certificate_nodes, peer_of
from fleetprof.collector.main import Collector, CollectorConfig
from fleetprof.tls import ClientTls, ClientTlsConfig
from tests.conftest import RunningCollector, free_port, wait_until
from tests.support.certs import Ca, Pair
from tests.support.wire import BatchBuilder, make_batch, push


@dataclass
class Mtls:
    collector: Collector
    ca: Ca

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.collector.grpc_port}"

    def push(self, pair: Pair, batches: list[pb.Batch]) -> list[int] | grpc.RpcError:
        """Push on one stream with `pair` as the client certificate: the acknowledged sequences, or the
        error that ended the stream."""
        tls = ClientTls(ClientTlsConfig(str(self.ca.cert), str(pair.cert), str(pair.key), "localhost"))
        with tls.channel(self.target, []) as ch:
            try:
                return [a.sequence for a in pb_grpc.IngestStub(ch).Push(iter(batches), timeout=10)]
            except grpc.RpcError as err:
                return err

    def top(self, node: str) -> dict:
        """/api/v1/top of the node's samples (HTTP is over TLS too)."""
        query = urllib.parse.urlencode({"query": f'{{node="{node}"}}', "since": "1h"})
        url = f"https://127.0.0.1:{self.collector.http_port}/api/v1/top?{query}"
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:
            return json.loads(resp.read())

    def samples(self, node: str) -> int:
        return self.top(node)["total"]

    def rejected(self, reason: str) -> int:
        return self.collector.ingest.stats.rejected.get(reason, 0)


def _mtls(tmp_path: Path, binding: str) -> Iterator[Mtls]:
    ca = Ca(tmp_path, "fleet")
    server = ca.server()
    col = Collector(
        CollectorConfig(
            grpc="127.0.0.1:0",
            http=f"127.0.0.1:{free_port()}",
            tls_cert=str(server.cert),
            tls_key=str(server.key),
            tls_client_ca=str(ca.cert),
            node_binding=binding,
        )
    )
    col.start()
    try:
        yield Mtls(col, ca)
    finally:
        col.stop()


@pytest.fixture
def mtls(tmp_path: Path) -> Iterator[Mtls]:
    """Client certificates required, each agent bound to the nodes its certificate names (the default)."""
    yield from _mtls(tmp_path, "certificate")


def _refused(result: list[int] | grpc.RpcError, words: str) -> None:
    assert isinstance(result, grpc.RpcError), f"acknowledged: {result}"
    assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in result.details(), result.details()


def test_an_agent_writes_as_the_node_its_certificate_names_and_no_other(mtls: Mtls) -> None:
    own = mtls.ca.client("node-a", name="node-a")
    assert mtls.push(own, [make_batch(node="node-a", count=4)]) == [1]
    # The run of 2026-11-27: one valid credential, node="victim", and the samples appeared as the victim's.
    _refused(mtls.push(own, [make_batch(node="victim", count=9)]), "'victim' is not a node its client")
    _refused(mtls.push(own, [make_batch(node="node-a.evil", count=9)]), "is not a node its client")
    assert mtls.rejected("wrong_node") == 2
    assert (mtls.samples("node-a"), mtls.samples("victim")) == (4, 0)


@pytest.mark.parametrize(
    ("name", "dns", "node"),
    [
        ("system:node:gpu-7", (), "gpu-7"),  # a kubelet's certificate
        ("fleetprof-agent", ("gpu-8.example.internal", "gpu-8"), "gpu-8"),  # a DNS name, as serving certs
        ("gpu-9", (), "gpu-9"),
    ],
)
def test_a_certificate_names_its_node_by_cn_kubelet_cn_or_dns_name(
    mtls: Mtls, name: str, dns: tuple[str, ...], node: str
) -> None:
    pair = mtls.ca.client(f"c-{node}", name=name, dns=dns)
    assert mtls.push(pair, [make_batch(node=node, count=3)]) == [1]
    assert mtls.samples(node) == 3
    _refused(mtls.push(pair, [make_batch(node="gpu-1", count=1)]), "is not a node")


def test_a_kubelet_client_certificate_file_serves_as_both_certificate_and_key(
    mtls: Mtls, tmp_path: Path
) -> None:
    """kubelet keeps its client certificate and key in one PEM file (kubelet-client-current.pem); the
    agent's --tls-cert and --tls-key may both name it."""
    pair = mtls.ca.client("kubelet-k1", name="system:node:k1")
    combined = tmp_path / "kubelet-client-current.pem"
    combined.write_bytes(pair.cert.read_bytes() + pair.key.read_bytes())
    assert mtls.push(Pair(combined, combined), [make_batch(node="k1", count=2)]) == [1]
    assert mtls.samples("k1") == 2


def test_a_shared_certificate_without_node_binding_writes_as_any_node(tmp_path: Path) -> None:
    """--node-binding none: one certificate for every agent proves "one of our agents", not which node."""
    for m in _mtls(tmp_path, "none"):
        shared = m.ca.client("shared")
        assert m.push(shared, [make_batch(node="node-x", count=1), make_batch(seq=2, node="node-y")]) == [
            1,
            2,
        ]
        assert (m.samples("node-x"), m.samples("node-y")) == (1, 5)


@pytest.mark.parametrize(
    "node", ["victim ", " victim", "vict\tim", "vіctim", "victim\u200b", "-victim", "a/b", ""]
)
def test_look_alike_node_names_are_refused_without_certificates_too(
    collector: RunningCollector, node: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        push(collector.grpc_target, [make_batch(node=node)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "agent.node" in info.value.details()
    assert collector.collector.ingest.stats.rejected == {"no_node" if not node else "bad_node": 1}


def test_another_agents_id_does_not_reach_its_dedupe_state(
    mtls: Mtls, caplog: pytest.LogCaptureFixture
) -> None:
    """The run of 2026-11-27: an agent that learned the victim's agent id pre-sent its next sequence numbers,
    and the victim's real batches were acknowledged and dropped as duplicates (2,000 samples lost), with
    nothing logged. Keyed by the certificate's subject, both are stored, each under its own node."""
    victim, attacker = mtls.ca.client("victim", name="victim"), mtls.ca.client("mallory", name="mallory")
    stolen = "0f3c9a61d2b84e7f9a0c11d5e6b7a8c9"
    pre_sent = [make_batch(seq, agent_id=stolen, node="mallory", count=1) for seq in range(1, 6)]
    assert mtls.push(attacker, pre_sent) == [1, 2, 3, 4, 5]
    real = [make_batch(seq, agent_id=stolen, node="victim", count=400) for seq in range(1, 6)]
    assert mtls.push(victim, real) == [1, 2, 3, 4, 5]
    assert (mtls.samples("victim"), mtls.samples("mallory")) == (2000, 5)
    assert mtls.collector.ingest.stats.duplicates == 0
    # A real duplicate (the victim's resend) is still dropped, and said in the log.
    with caplog.at_level(logging.WARNING, logger="fleetprof.collector.ingest.service"):
        assert mtls.push(victim, [make_batch(3, agent_id=stolen, node="victim", count=400)]) == [3]
    assert mtls.samples("victim") == 2000 and mtls.collector.ingest.stats.duplicates == 1
    said = [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()]
    assert said and f"batch 3 of agent {stolen} (node 'victim', authenticated as cert:victim)" in said[0]


def test_another_agents_id_does_not_reach_its_wire_id_tables(mtls: Mtls) -> None:
    """Wire ids are the agent's own names for its stacks and processes; under a stolen agent id an attacker
    sends the victim's next wire id first, with its own frames. The victim's samples keep the victim's."""
    victim, attacker = mtls.ca.client("victim", name="victim"), mtls.ca.client("mallory", name="mallory")
    stolen = "5b2e7d90c4a14f3e8b6a0d1c2e3f4a5b"
    bait = BatchBuilder("mallory", stolen, 1)
    bait.sample(bait.process(42, "worker"), bait.stack([("evil", "x")]), 1)
    lie = bait.build()
    real = BatchBuilder("victim", stolen, 1)
    real.sample(real.process(42, "worker"), real.stack([("honest", "app")]), 7)
    honest = real.build()
    lie.stack_ids[0], lie.process_ids[0] = honest.stack_ids[0], honest.process_ids[0]
    assert mtls.push(attacker, [lie]) == [1]
    assert mtls.push(victim, [honest]) == [1]
    top = mtls.top("victim")
    assert [f["function"] for f in top["functions"]] == ["honest"] and top["total"] == 7


def test_without_client_certificates_a_duplicate_drop_is_logged(
    collector: RunningCollector, caplog: pytest.LogCaptureFixture
) -> None:
    """No identity beyond the agent id: a second batch under an agent id and sequence already stored is a
    duplicate, acknowledged, dropped, and said."""
    agent = "c0ffee00c0ffee00c0ffee00c0ffee00"
    assert push(collector.grpc_target, [make_batch(1, agent_id=agent, node="node-a")]) == [1]
    with caplog.at_level(logging.WARNING, logger="fleetprof.collector.ingest.service"):
        assert push(collector.grpc_target, [make_batch(1, agent_id=agent, node="node-b")]) == [1]
    wait_until(lambda: collector.collector.ingest.stats.duplicates == 1, 5, "the duplicate to be counted")
    assert any(f"batch 1 of agent {agent} (node 'node-b')" in r.getMessage() for r in caplog.records)


def test_peer_of_reads_the_certificates_names() -> None:
    context = {"x509_common_name": [b"system:node:n1"], "peer_dns": [b"n1.internal", b"n1"]}
    assert peer_of(context, "certificate") == Peer("cert:system:node:n1", frozenset({"n1", "n1.internal"}))
    assert peer_of(context, "none") == Peer("cert:system:node:n1", None)
    assert peer_of({"transport_security_type": [b"ssl"]}, "certificate") == Peer()
    assert certificate_nodes("", ["a"]) == frozenset({"a"})
