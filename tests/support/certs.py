"""Real X.509 material for the TLS tests, made with `cryptography`: a CA, and server or client certificates
it signs, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(subject: str, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@dataclass
class Pair:
    cert: Path
    key: Path


class Ca:
    """A self-signed CA in `directory`/`name`-ca.pem that signs server and client certificates."""

    def __init__(self, directory: Path, name: str = "test"):
        self.dir = directory
        self.name = name
        self._key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        self._subject = subject
        self._cert = (
            _builder(f"{name} CA", subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def _issue(
        self, stem: str, subject: str, usage: x509.ObjectIdentifier, names: list[x509.GeneralName]
    ) -> Pair:
        key = _key()
        builder = _builder(subject, self._subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = Pair(self.dir / f"{stem}.pem", self.dir / f"{stem}-key.pem")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_pem_key(key))
        pair.key.chmod(0o600)
        return pair

    def server(self, stem: str = "server", dns: tuple[str, ...] = ("localhost",)) -> Pair:
        """A server certificate for 127.0.0.1 and `dns`."""
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        return self._issue(f"{self.name}-{stem}", dns[0], ExtendedKeyUsageOID.SERVER_AUTH, names)

    def client(self, stem: str = "client", name: str | None = None, dns: tuple[str, ...] = ()) -> Pair:
        """A client certificate with the common name `name` (default `STEM.agents`, a name no node has) and
        the DNS names `dns`: an agent's certificate names its node by either."""
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        subject = name if name is not None else f"{stem}.agents"
        return self._issue(f"{self.name}-{stem}", subject, ExtendedKeyUsageOID.CLIENT_AUTH, names)
