"""Real ClickHouse servers (Debian's clickhouse-server 18.16) and a ZooKeeper (Debian's zookeeper 3.8) on
loopback, for tests and bench/collector.py: each on free ports in its own directory, started without their
system services, stopped (or killed) by the caller. scripts/setup.sh --test installs both packages.

Their directories are made with `scratch()`, not pytest's tmp_path: pytest deletes all but the newest three
of its base directories, and with other test runs on the machine that happened under running servers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SERVER = shutil.which("clickhouse-server") or "/usr/sbin/clickhouse-server"
ZOOKEEPER_CLASSPATH = "/usr/share/java/*:/etc/zookeeper/conf"


def scratch(prefix: str) -> Path:
    """A fresh directory of our own under the system's temporary directory (see the module docstring)."""
    return Path(tempfile.mkdtemp(prefix=f"fleetprof-{prefix}-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within {timeout} s")
        time.sleep(0.1)


@dataclass
class ZooKeeper:
    """One standalone ZooKeeper on 127.0.0.1."""

    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> ZooKeeper:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "data").mkdir(exist_ok=True)
        cfg = self.directory / "zoo.cfg"
        cfg.write_text(
            f"tickTime=500\ninitLimit=10\nsyncLimit=5\ndataDir={self.directory / 'data'}\n"
            f"clientPort={self.port}\nclientPortAddress=127.0.0.1\nadmin.enableServer=false\n"
            "maxClientCnxns=200\n4lw.commands.whitelist=ruok,srvr\n"
        )
        log = self.directory / "zookeeper.log"
        self.proc = subprocess.Popen(
            ["java", "-Xmx256m", "-cp", ZOOKEEPER_CLASSPATH, "-Dzookeeper.jmx.log4j.disable=true",
             "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(cfg)],
            stdout=open(log, "ab"),  # lives with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        _wait(self._ok, 60, "zookeeper", self.proc, log)
        return self

    def _ok(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                # "srvr" answers with the server's mode only once it serves sessions ("ruok" answers
                # earlier, and a ClickHouse connecting then keeps a broken session)
                s.sendall(b"srvr")
                return b"Mode: standalone" in s.recv(4096)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class ClickHouse:
    """One clickhouse-server on 127.0.0.1. `users` adds users (name -> (password, readonly)) beside the
    passwordless `default`; `zookeeper`, `macros` and `clusters` make it a replica in a cluster."""

    directory: Path
    tcp_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    interserver_port: int = field(default_factory=free_port)
    zookeeper: ZooKeeper | None = None
    macros: dict[str, str] = field(default_factory=dict)
    clusters: dict[str, Sequence[Sequence[ClickHouse]]] = field(default_factory=dict)
    users: dict[str, tuple[str, bool]] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"clickhouse://127.0.0.1:{self.tcp_port}"

    def _config(self) -> str:
        d = self.directory
        zk = ""
        if self.zookeeper is not None:
            zk = (
                f"<zookeeper><node><host>127.0.0.1</host><port>{self.zookeeper.port}</port></node>"
                "<session_timeout_ms>10000</session_timeout_ms></zookeeper>"
                "<distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>"
            )
        macros = "".join(f"<{k}>{v}</{k}>" for k, v in self.macros.items())
        clusters = ""
        for name, shards in self.clusters.items():
            body = "".join(
                "<shard><internal_replication>true</internal_replication>"
                + "".join(
                    f"<replica><host>127.0.0.1</host><port>{r.tcp_port}</port></replica>" for r in replicas
                )
                + "</shard>"
                for replicas in shards
            )
            clusters += f"<{name}>{body}</{name}>"
        return f"""<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>{d}/server.log</log><errorlog>{d}/server.err.log</errorlog>
    <size>50M</size><count>2</count></logger>
  <listen_host>127.0.0.1</listen_host>
  <tcp_port>{self.tcp_port}</tcp_port>
  <http_port>{self.http_port}</http_port>
  <interserver_http_port>{self.interserver_port}</interserver_http_port>
  <interserver_http_host>127.0.0.1</interserver_http_host>
  <path>{d}/data/</path>
  <tmp_path>{d}/tmp/</tmp_path>
  <format_schema_path>{d}/format_schemas/</format_schema_path>
  <users_config>{d}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>268435456</mark_cache_size>
  <uncompressed_cache_size>268435456</uncompressed_cache_size>
  <max_concurrent_queries>100</max_concurrent_queries>
  <builtin_dictionaries_reload_interval>0</builtin_dictionaries_reload_interval>
  <remote_servers>{clusters}</remote_servers>
  {zk}
  <macros>{macros}</macros>
</yandex>
"""

    def _users(self) -> str:
        extra = "".join(
            f"<{name}><password>{pw}</password><networks><ip>127.0.0.1</ip></networks>"
            f"<profile>{'readonly' if ro else 'default'}</profile><quota>default</quota></{name}>"
            for name, (pw, ro) in self.users.items()
        )
        return f"""<?xml version="1.0"?>
<yandex>
  <profiles><default><max_memory_usage>4000000000</max_memory_usage></default>
    <readonly><readonly>1</readonly></readonly></profiles>
  <users>
    <default><password></password><networks><ip>127.0.0.1</ip></networks>
      <profile>default</profile><quota>default</quota></default>
    {extra}
  </users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
    <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval>
  </default></quotas>
</yandex>
"""

    def start(self, timeout: float = 60) -> ClickHouse:
        d = self.directory
        for sub in ("data", "tmp", "format_schemas"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "config.xml").write_text(self._config())
        (d / "users.xml").write_text(self._users())
        log = d / "stdout.log"
        self.proc = subprocess.Popen(
            [SERVER, f"--config-file={d / 'config.xml'}"],
            stdout=open(log, "ab"),  # lives with the process
            stderr=subprocess.STDOUT,
            cwd=d,
            start_new_session=True,
        )
        _wait(self.ping, timeout, f"clickhouse-server in {d}", self.proc, d / "server.err.log")
        if self.zookeeper is not None:
            _wait(
                self._zookeeper_ok,
                timeout,
                f"clickhouse-server in {d} to reach ZooKeeper",
                self.proc,
                d / "server.err.log",
            )
        return self

    def _zookeeper_ok(self) -> bool:
        from clickhouse_driver import Client

        try:
            Client("127.0.0.1", port=self.tcp_port).execute(
                "SELECT count() FROM system.zookeeper WHERE path = '/'"
            )
            return True
        except Exception:
            return False

    def ping(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ping", timeout=1) as r:
                return r.read().strip() == b"Ok."
        except OSError:
            return False

    def kill(self) -> None:
        """kill -9: what a crashed or lost replica looks like to the others."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        """Stop it and delete its directory."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def disk_bytes(self, database: str) -> int:
        """Bytes of `database`'s table files on disk."""
        root = self.directory / "data" / "data" / database
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


@dataclass
class Cluster:
    """`shards` × `replicas` servers and one ZooKeeper: the cluster `name` in every server's config."""

    directory: Path
    shards: int = 2
    replicas: int = 2
    name: str = "fleet"
    zookeeper: ZooKeeper | None = None
    servers: list[list[ClickHouse]] = field(default_factory=list)

    def start(self) -> Cluster:
        self.zookeeper = ZooKeeper(self.directory / "zk").start()
        self.servers = [
            [
                ClickHouse(
                    self.directory / f"s{s + 1}r{r + 1}",
                    zookeeper=self.zookeeper,
                    macros={"shard": str(s + 1), "replica": f"r{r + 1}"},
                )
                for r in range(self.replicas)
            ]
            for s in range(self.shards)
        ]
        for shard in self.servers:
            for server in shard:
                server.clusters = {self.name: self.servers}
        for shard in self.servers:
            for server in shard:
                server.start()
        return self

    @property
    def all(self) -> list[ClickHouse]:
        return [s for shard in self.servers for s in shard]

    def stop(self, remove: bool = True) -> None:
        for server in self.all:
            server.stop()
        if self.zookeeper is not None:
            self.zookeeper.stop()
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
