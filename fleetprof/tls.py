"""TLS material from PEM files, re-read when the files change (cert-manager renews certificates in place).

The server side gives gRPC credentials and an ssl.SSLContext for HTTP, both following the files: gRPC asks
for a new configuration before each handshake, HTTP takes the current context for each new connection. A
changed file that does not load (half-written, key and certificate mismatched) is said once in the log and
the material in use stays. The client side gives a gRPC channel and says when its files changed, so the
agent can open a new channel with the new client certificate.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """TLS files that cannot be used: missing, unreadable, not PEM, or a key that does not match."""


class _Files:
    """The bytes of some files, and whether any of them changed since they were read."""

    def __init__(self, paths: Sequence[str]):
        self.paths = tuple(paths)
        self.stamp = self._stamp()
        self.data = self._read()

    def _stamp(self) -> tuple:
        stamps = []
        for p in self.paths:
            try:
                st = os.stat(p)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def _read(self) -> tuple[bytes, ...]:
        out = []
        for p in self.paths:
            try:
                with open(p, "rb") as f:
                    out.append(f.read(1024 * 1024))
            except OSError as err:
                raise TlsError(f"cannot read {p}: {err}") from None
        return tuple(out)

    def changed(self) -> bool:
        return self._stamp() != self.stamp

    def reread(self) -> tuple[bytes, ...]:
        """Read the files again (raises TlsError); updates the stamp only when every file was read."""
        stamp = self._stamp()
        data = self._read()
        self.stamp, self.data = stamp, data
        return data


def _server_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """An HTTP server context from PEM bytes (ssl wants files: written to a private temporary directory)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="fleetprof-tls-") as d:
        cpath, kpath = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cpath, cert), (kpath, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            ctx.load_cert_chain(cpath, kpath)
        except (ssl.SSLError, OSError) as err:
            raise TlsError(f"the certificate and key do not load together: {err}") from None
    return ctx


def _check_ca(path: str, data: bytes) -> None:
    try:
        ssl.create_default_context(cadata=data.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as err:
        raise TlsError(f"{path} holds no usable CA certificate: {err}") from None


class ServerTls:
    """`cert` and `key` (PEM) for gRPC and HTTP; with `client_ca`, gRPC clients must present a certificate
    that CA signed (mutual TLS). Raises TlsError at start when the files do not load."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._files = _Files([cert, key] + ([client_ca] if client_ca else []))
        self._lock = threading.Lock()
        self._data = self._files.data
        self._context = self._load(self._data)
        self._generation = 0  # bumped when new material loads; each consumer notices on its own

    def _load(self, data: tuple[bytes, ...]) -> ssl.SSLContext:
        if self.client_ca:
            _check_ca(self.client_ca, data[2])
        return _server_context(data[0], data[1])

    def _refresh(self) -> None:
        if not self._files.changed():
            return
        with self._lock:
            if not self._files.changed():
                return
            try:
                data = self._files.reread()
                self._context = self._load(data)
            except TlsError as err:
                # Keep serving what loaded before; the stamp moved, so this is said once per change.
                log.error(
                    "TLS files changed but do not load (%s); still serving the previous certificate", err
                )
                return
            self._data = data
            self._generation += 1
            log.info("TLS files changed: serving the new certificate")

    def http_context(self) -> ssl.SSLContext:
        self._refresh()
        return self._context

    def _grpc_config(self) -> grpc.ServerCertificateConfiguration:
        data = self._data
        ca = data[2] if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([(data[1], data[0])], root_certificates=ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        served = [self._generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            self._refresh()
            if self._generation == served[0]:
                return None
            served[0] = self._generation
            return self._grpc_config()

        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(), fetch, require_client_authentication=self.client_ca is not None
        )

    def describe(self) -> str:
        client = f", client certificates required (CA {self.client_ca})" if self.client_ca else ""
        return f"TLS ({self.cert}){client}"


@dataclass(frozen=True)
class ClientTlsConfig:
    ca: str | None = None  # None: the system's roots
    cert: str | None = None  # client certificate (mutual TLS), with key
    key: str | None = None
    server_name: str | None = None  # checked against the server's certificate instead of the target host

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a client certificate needs both --tls-cert and --tls-key")


class ClientTls:
    """A gRPC channel over TLS from `config`'s files; `changed()` says when a new channel should be made."""

    def __init__(self, config: ClientTlsConfig):
        self.config = config
        paths = [p for p in (config.ca, config.cert, config.key) if p]
        self._files = _Files(paths)
        if config.ca:
            _check_ca(config.ca, self._files.data[0])
        if config.cert:
            _server_context(*self._files.data[-2:])  # the pair loads together, or say so now

    def changed(self) -> bool:
        return self._files.changed()

    def channel(self, target: str, options: list[tuple[str, object]]) -> grpc.Channel:
        try:
            data = self._files.reread() if self._files.changed() else self._files.data
        except TlsError as err:
            log.error("TLS files changed but cannot be read (%s); using the previous ones", err)
            data = self._files.data
        named = dict(zip((p for p in ("ca", "cert", "key") if getattr(self.config, p)), data, strict=True))
        creds = grpc.ssl_channel_credentials(
            root_certificates=named.get("ca"),
            private_key=named.get("key"),
            certificate_chain=named.get("cert"),
        )
        if self.config.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.config.server_name)]
        return grpc.secure_channel(target, creds, options=options)


def client_http_context(ca: str | None) -> ssl.SSLContext:
    """What the query commands verify an https:// collector with: `ca`, or the system's roots."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as err:
        raise TlsError(f"cannot use --ca {ca}: {err}") from None
