"""The `--clickhouse` URL: where the store is, as whom, and how it replicates; every mistake named at start.

    clickhouse://[user[:password]@]host[:port][,host[:port]...]/database[?cluster=NAME&quorum=N&secure=1&ca=FILE]

More hosts than one are tried in turn when the one in use fails (replicas behind no load balancer). Without
`cluster`, tables are plain MergeTree on the server(s) named. With `cluster=NAME` (a cluster in the
servers' `remote_servers`), tables are ReplicatedMergeTree behind Distributed tables, and an insert returns
once `quorum` replicas of each shard it touched have it (default: 2, or the shard's replicas if fewer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

DEFAULT_PORT, DEFAULT_SECURE_PORT = 9000, 9440
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OPTIONS = ("cluster", "quorum", "secure", "ca")
_HOST = re.compile(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?")  # [v6]:port or name:port


class ClickHouseConfigError(ValueError):
    """A `--clickhouse` URL or password file that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class ClickHouseConfig:
    hosts: tuple[tuple[str, int], ...]
    database: str
    user: str = "default"
    password: str = ""
    cluster: str | None = None
    quorum: int | None = None  # None: the default for the cluster (see module docstring); 0 without one
    secure: bool = False
    ca: str | None = None

    def describe(self) -> str:
        """The URL without its password, for logs and errors."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        query = "&".join(
            f"{k}={v}"
            for k, v in (("cluster", self.cluster), ("quorum", self.quorum), ("secure", int(self.secure)))
            if v not in (None, 0)
        )
        return f"clickhouse://{self.user}@{hosts}/{self.database}" + (f"?{query}" if query else "")

    def with_password_file(self, path: str) -> ClickHouseConfig:
        """The password read from `path` (one line; surrounding whitespace dropped)."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ClickHouseConfigError(f"--clickhouse-password-file {path}: {err.strerror or err}") from None
        password = text.strip()
        if not password:
            raise ClickHouseConfigError(f"--clickhouse-password-file {path} is empty")
        return replace(self, password=password)


def _flag(name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ClickHouseConfigError(f"--clickhouse: {name}={value!r}: use 1 or 0")


def parse_url(url: str) -> ClickHouseConfig:
    """The config a `--clickhouse` URL names (see the module docstring), or ClickHouseConfigError."""
    parts = urlsplit(url)
    if parts.scheme != "clickhouse":
        raise ClickHouseConfigError(
            f"--clickhouse {url!r}: expected clickhouse://[user[:password]@]host[:port]/database"
        )
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    options: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _OPTIONS:
            raise ClickHouseConfigError(
                f"--clickhouse: unknown option {key!r} (known: {', '.join(_OPTIONS)})"
            )
        options[key] = value
    secure = _flag("secure", options["secure"]) if "secure" in options else False
    hosts = []
    for item in hostlist.split(","):
        m = _HOST.fullmatch(item)
        if m is None:
            raise ClickHouseConfigError(f"--clickhouse {_safe(url)}: {item!r} is not HOST[:PORT]")
        host, port_text = m.group(1) or m.group(3), m.group(2) or m.group(4)
        port = int(port_text) if port_text else (DEFAULT_SECURE_PORT if secure else DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ClickHouseConfigError(f"--clickhouse: port {port} is out of range")
        hosts.append((host, port))
    database = unquote(parts.path.lstrip("/"))
    if not _IDENTIFIER.match(database):
        raise ClickHouseConfigError(
            f"--clickhouse {_safe(url)}: name the database as the URL's path (letters, digits, _), e.g. "
            "clickhouse://host:9000/fleetprof"
        )
    cluster = options.get("cluster") or None
    if cluster is not None and not _IDENTIFIER.match(cluster):
        raise ClickHouseConfigError(f"--clickhouse: cluster={cluster!r} is not a cluster name")
    quorum = None
    if "quorum" in options:
        if cluster is None:
            raise ClickHouseConfigError("--clickhouse: quorum= needs cluster= (replication)")
        try:
            quorum = int(options["quorum"])
        except ValueError:
            raise ClickHouseConfigError(
                f"--clickhouse: quorum={options['quorum']!r} is not a number"
            ) from None
        if quorum < 1:
            raise ClickHouseConfigError("--clickhouse: quorum must be at least 1")
    ca = options.get("ca") or None
    if ca is not None:
        if not secure:
            raise ClickHouseConfigError("--clickhouse: ca= needs secure=1")
        if not Path(ca).is_file():
            raise ClickHouseConfigError(f"--clickhouse: ca={ca}: no such file")
    return ClickHouseConfig(
        hosts=tuple(hosts),
        database=database,
        user=unquote(user) or "default",
        password=unquote(password),
        cluster=cluster,
        quorum=quorum,
        secure=secure,
        ca=ca,
    )


def _safe(url: str) -> str:
    """`url` with its password replaced, for error messages."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)
