"""Where the Kubernetes API server is and how to authenticate: the pod's service account or a kubeconfig."""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeConfigError(Exception):
    """The API server cannot be reached with what is configured; the message says what to fix."""


@dataclass(frozen=True)
class KubeConfig:
    """One API server and one identity. Built once at start-up and passed down.

    `token` is the bearer token to send first; `token_file`, when set, is read again after a 401,
    because projected service-account tokens are rotated on disk by the kubelet (about hourly).
    Certificate material given inline in a kubeconfig (`*-data`) stays in memory here and only
    touches disk, in a private temporary directory, for the moment `ssl` needs a file path.
    """

    server: str  # "https://10.0.0.1:443"; plain "http://" is accepted (tests, kubectl proxy)
    token: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    ca_data: bytes | None = None  # PEM (or DER) bundle
    client_cert_file: str | None = None
    client_key_file: str | None = None
    client_cert_data: bytes | None = None  # PEM
    client_key_data: bytes | None = None  # PEM
    insecure_skip_verify: bool = False

    def read_token_file(self) -> str | None:
        """The current content of token_file (None without one); KubeConfigError if unreadable."""
        if not self.token_file:
            return None
        return _read_token(self.token_file)

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context: the cluster CA (or no verification when asked) and any client cert."""
        ctx = ssl.create_default_context()
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif self.ca_file or self.ca_data:
            # The cluster CA replaces the system store: a public CA must not vouch for the API server.
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                if self.ca_file:
                    ctx.load_verify_locations(cafile=self.ca_file)
                if self.ca_data:
                    ctx.load_verify_locations(cadata=_cadata(self.ca_data))
            except (OSError, ssl.SSLError) as e:
                raise KubeConfigError(f"cannot load the cluster CA certificate: {e}") from e
        try:
            if self.client_cert_data or self.client_key_data:
                _load_inline_cert_chain(ctx, self.client_cert_data, self.client_key_data)
            elif self.client_cert_file:
                ctx.load_cert_chain(self.client_cert_file, self.client_key_file)
        except (OSError, ssl.SSLError) as e:
            raise KubeConfigError(f"cannot load the client certificate and key: {e}") from e
        return ctx


def in_cluster_config(env: Mapping[str, str] = os.environ, sa_dir: str = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """The API server as seen from a pod: the kubernetes Service address and the mounted service account."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError(
            "not running inside a Kubernetes pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT "
            "are not set (give a kubeconfig file to run outside a cluster)"
        )
    token_file = os.path.join(sa_dir, "token")
    token = _read_token(token_file, hint=" (is automountServiceAccountToken disabled for the agent's pod?)")
    ca_file = os.path.join(sa_dir, "ca.crt")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return KubeConfig(
        server=f"https://{host}:{port}",
        token=token,
        token_file=token_file,
        ca_file=ca_file if os.path.exists(ca_file) else None,
    )


def kubeconfig_config(path: str, context: str | None = None) -> KubeConfig:
    """The cluster and user of one context (default: current-context) of a kubeconfig file.

    Supported credentials: token, tokenFile, client certificate and key (file or inline data).
    Credential plugins (exec, auth-provider) are refused: running arbitrary commands from a per-node
    agent is not something we want, and in a cluster the agent uses its service account anyway.
    Relative file paths are relative to the kubeconfig's directory, as kubectl resolves them.
    """
    try:
        import yaml  # only needed off-cluster; the in-cluster path never imports it
    except ImportError as e:
        raise KubeConfigError("reading a kubeconfig file needs PyYAML (pip install pyyaml)") from e
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {e.strerror or e}") from e
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KubeConfigError(f"kubeconfig {path} is not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise KubeConfigError(f"kubeconfig {path} is not a kubeconfig (expected a mapping at the top)")

    name = context or doc.get("current-context")
    if not name:
        raise KubeConfigError(f"kubeconfig {path} has no current-context; name the context to use")
    ctx = _named(doc, "contexts", "context", name, path)
    cluster = _named(doc, "clusters", "cluster", ctx.get("cluster"), path)
    user = _named(doc, "users", "user", ctx.get("user"), path) if ctx.get("user") else {}
    base = os.path.dirname(os.path.abspath(path))

    server = cluster.get("server")
    if not server:
        raise KubeConfigError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server")

    token = user.get("token") or None
    token_file = _relative(base, user.get("tokenFile"))
    if token_file and not token:
        token = _read_token(token_file)
    cert_file = _relative(base, user.get("client-certificate"))
    cert_data = _b64(user.get("client-certificate-data"), "client-certificate-data", path)
    if not (token or cert_file or cert_data):
        if "exec" in user or "auth-provider" in user:
            plugin = "exec" if "exec" in user else "auth-provider"
            raise KubeConfigError(
                f"kubeconfig {path}: user {ctx.get('user')!r} authenticates with an {plugin} credential "
                "plugin, which fleetprof does not run; use a token, tokenFile or client certificate"
            )
        if "username" in user or "password" in user:
            raise KubeConfigError(
                f"kubeconfig {path}: user {ctx.get('user')!r} uses basic auth, which Kubernetes no "
                "longer supports; use a token, tokenFile or client certificate"
            )
    return KubeConfig(
        server=str(server).rstrip("/"),
        token=token,
        token_file=token_file,
        ca_file=_relative(base, cluster.get("certificate-authority")),
        ca_data=_b64(cluster.get("certificate-authority-data"), "certificate-authority-data", path),
        client_cert_file=cert_file,
        client_key_file=_relative(base, user.get("client-key")),
        client_cert_data=cert_data,
        client_key_data=_b64(user.get("client-key-data"), "client-key-data", path),
        insecure_skip_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
    )


def load_config(
    kubeconfig: str | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    sa_dir: str = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """An explicit kubeconfig, else the in-cluster service account, else $KUBECONFIG or ~/.kube/config.

    Of a $KUBECONFIG list the first existing file is used (kubectl merges them; we do not).
    """
    if kubeconfig:
        return kubeconfig_config(kubeconfig)
    try:
        return in_cluster_config(env, sa_dir)
    except KubeConfigError as e:
        in_cluster_reason = str(e)
    candidates = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    home = env.get("HOME") or os.path.expanduser("~")
    candidates.append(os.path.join(home, ".kube", "config"))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return kubeconfig_config(candidate)
    raise KubeConfigError(
        f"no Kubernetes API configuration found: {in_cluster_reason}; and no kubeconfig file at "
        f"{', '.join(candidates)}"
    )


def _read_token(path: str, hint: str = "") -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise KubeConfigError(f"cannot read the API token file {path}: {e.strerror or e}{hint}") from e
    if not token:
        raise KubeConfigError(f"the API token file {path} is empty{hint}")
    return token


def _named(doc: dict, section: str, key: str, name: Any, path: str) -> dict:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key)
            return value if isinstance(value, dict) else {}
    raise KubeConfigError(f"kubeconfig {path} has no {key} named {name!r} (in {section})")


def _relative(base: str, value: Any) -> str | None:
    if not value:
        return None
    return os.path.join(base, os.path.expanduser(str(value)))


def _b64(value: Any, field: str, path: str) -> bytes | None:
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=False)
    except (binascii.Error, ValueError) as e:
        raise KubeConfigError(f"kubeconfig {path}: {field} is not valid base64: {e}") from e


def _cadata(data: bytes) -> str | bytes:
    # ssl takes PEM as text and DER as bytes.
    return data.decode("ascii") if data.lstrip().startswith(b"-----BEGIN") else data


def _load_inline_cert_chain(ctx: ssl.SSLContext, cert: bytes | None, key: bytes | None) -> None:
    """load_cert_chain only reads files: write the PEM to a 0700 directory and remove it at once."""
    if not cert:
        raise KubeConfigError("the kubeconfig has a client key but no client certificate")
    with tempfile.TemporaryDirectory(prefix="fleetprof-kube-") as tmp:  # mode 0700
        cert_path = os.path.join(tmp, "client.crt")
        _write_private(cert_path, cert)
        key_path = None
        if key:
            key_path = os.path.join(tmp, "client.key")
            _write_private(key_path, key)
        ctx.load_cert_chain(cert_path, key_path)


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
