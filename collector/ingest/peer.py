"""Who sent a batch: the identity the transport authenticated, and the nodes it may write as.

With client certificates required (--tls-client-ca), an agent's certificate names its node, as kubelets'
certificates do: its common name (`NAME`, or kubelet's `system:node:NAME`) or one of its DNS names. The
collector then refuses a batch whose `agent.node` is none of them (--node-binding certificate, the
default), so one node's credentials cannot write another node's profiles. The certificate's subject also
keys the agent's dedupe state and wire-id tables (ingest/decode.py source_key), so an agent that learns
another's agent id cannot pre-send that agent's sequence numbers. A certificate shared by every agent
(--node-binding none) names no node: it proves only "one of our agents".

Without client certificates there is no identity beyond the token, which every agent shares: any holder of
the ingest token can write as any node (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KUBELET_PREFIX = "system:node:"  # kubelet client and serving certificates: CN=system:node:NAME
NODE_BINDINGS = ("certificate", "none")


@dataclass(frozen=True)
class Peer:
    """`identity`: who authenticated ("" for no one in particular: no client certificate); `nodes`: the node
    names it may write as (None: any)."""

    identity: str = ""
    nodes: frozenset[str] | None = None

    def allows(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes

    def describe(self) -> str:
        names = ", ".join(sorted(self.nodes)) if self.nodes else "none"
        return f"{self.identity} (may write as: {names})"


ANONYMOUS = Peer()


def _texts(values: Iterable[bytes | str] | None) -> list[str]:
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values or ()]


def certificate_nodes(common_name: str, dns_names: Iterable[str]) -> frozenset[str]:
    """The node names a certificate speaks for: its CN (without kubelet's `system:node:` prefix) and its
    DNS names."""
    names = set(dns_names)
    if common_name:
        names.add(common_name.removeprefix(KUBELET_PREFIX))
    names.discard("")
    return frozenset(names)


def peer_of(auth_context: Mapping[str, Iterable[bytes]], node_binding: str) -> Peer:
    """The peer of a gRPC call from its auth context (`context.auth_context()`): the client certificate's
    names where one was presented (grpc gives its CN and DNS names), else anonymous."""
    common = _texts(auth_context.get("x509_common_name"))
    dns = _texts(auth_context.get("peer_dns"))
    if not common and not dns:
        return ANONYMOUS
    cn = common[0] if common else ""
    identity = f"cert:{cn or dns[0]}"
    nodes = certificate_nodes(cn, dns) if node_binding == "certificate" else None
    return Peer(identity, nodes)
