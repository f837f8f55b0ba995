"""The attacks of issue 26 (run against the collector on 2026-11-27), run again against a real collector
process, and what each gets now. Three collectors: in memory, with --data-dir (DuckDB + write-ahead log),
and with TLS, client certificates naming each agent's node (as kubelets' do) and tokens. Each attack is
what the issue describes, at its numbers:

1. slowloris: 70 connections from one address, each sending one header byte every 5 s for 45 s (the
   attacker reconnects whenever cut off), then 560 such connections from 10 addresses; a query with the
   token and /healthz from elsewhere at 3, 20 and 40 s.
2. refused batches: 80 batches of 16 new stacks with ~65 KB names and a bad sample row (and the control:
   the same bytes as strings no stack uses); the collector's RSS and its ingest tables before and after.
3. label flood: 10 batches of 20,000 processes each with a unique 1,000-byte pod; one process with 20,000
   labels of 1,000 bytes; then the label-values listing and a `pod=~` query. And the same pods spread over
   40 node names at 4,000 each (within each node's quota): what a token holder who may speak for any node
   reaches.
4. node spoofing: an agent writes node="victim", and the look-alike "victim ".
5. dedupe: an agent that learned the victim's agent id pre-sends its next 5 sequence numbers; the victim
   then sends 5 batches of 400 samples.

    .venv/bin/python bench/attacks.py [--variants memory,data-dir,tls] [--attacks 1,2,3,4,5] [--json F]

RSS is the collector's (VmRSS, and VmHWM for the peak) from /proc; all numbers go to stdout (and --json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from common import free_port, proc_status

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetprof._proto.v1 import ingest_pb2 as pb  # noqa: E402
from fleetprof._proto.v1 import ingest_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.wire import BatchBuilder, make_batch  # noqa: E402

INGEST_TOKEN = "attack-ingest-token-81c2"
API_TOKEN = "attack-api-token-3e9d"
MIB = 1 << 20


class Target:
    """One collector process under attack, and how a client with the right credentials reaches it."""

    def __init__(self, variant: str, workdir: Path) -> None:
        self.variant = variant
        self.dir = workdir / variant
        self.dir.mkdir(parents=True)
        self.grpc_port, self.http_port = free_port(), free_port()
        (self.dir / "ingest").write_text(INGEST_TOKEN + "\n")
        (self.dir / "api").write_text(API_TOKEN + "\n")
        argv = [
            sys.executable, "-m", "fleetprof.cli", "collector",
            "--grpc", f"127.0.0.1:{self.grpc_port}", "--http", f"127.0.0.1:{self.http_port}",
            "--auth-token-file", str(self.dir / "ingest"), "--api-token-file", str(self.dir / "api"),
        ]  # fmt: skip
        self.ca = None
        if variant == "data-dir":
            argv += ["--data-dir", str(self.dir / "data")]
        if variant == "tls":
            from tests.support.certs import Ca

            self.ca = Ca(self.dir, "fleet")
            server = self.ca.server()
            argv += [
                "--tls-cert",
                str(server.cert),
                "--tls-key",
                str(server.key),
                "--tls-client-ca",
                str(self.ca.cert),
            ]
        self.log = self.dir / "collector.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.get("/healthz", token=False)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the {variant} collector did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # -- HTTP ---------------------------------------------------------------------------------------
    def connect(self, source: str = "127.0.0.9", timeout: float = 30.0) -> socket.socket:
        sock = socket.create_connection(
            ("127.0.0.1", self.http_port), timeout=timeout, source_address=(source, 0)
        )
        if self.ca is not None:
            ctx = ssl.create_default_context(cafile=str(self.ca.cert))
            sock = ctx.wrap_socket(sock, server_hostname="localhost")
        return sock

    def get(self, path: str, source: str = "127.0.0.9", token: bool = True) -> tuple[int, bytes, float]:
        """(status, body, seconds) of GET `path` from the client address `source`."""
        t0 = time.monotonic()
        with self.connect(source) as s:
            auth = f"Authorization: Bearer {API_TOKEN}\r\n" if token else ""
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: c\r\n{auth}Connection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(1 << 20):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), body, time.monotonic() - t0

    def metrics(self) -> dict[str, float]:
        status, body, _ = self.get("/metrics")
        assert status == 200, body[:300]
        samples = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def rss(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MiB."""
        st = proc_status(self.proc.pid)
        return int(st["VmRSS"][0]) / 1024, int(st["VmHWM"][0]) / 1024

    # -- gRPC ---------------------------------------------------------------------------------------
    def push(self, batches: list[pb.Batch], node_cert: str | None = None) -> list[int] | str:
        """Push on one stream (over TLS with a client certificate naming `node_cert`): the acknowledged
        sequences, or the status and details that ended it."""
        target = f"127.0.0.1:{self.grpc_port}"
        if self.ca is not None:
            pair = self.ca.client(f"agent-{node_cert}", name=f"system:node:{node_cert}")
            creds = grpc.ssl_channel_credentials(
                self.ca.cert.read_bytes(), pair.key.read_bytes(), pair.cert.read_bytes()
            )
            channel = grpc.secure_channel(
                target, creds, options=[("grpc.ssl_target_name_override", "localhost")] + _BIG
            )
        else:
            channel = grpc.insecure_channel(target, options=_BIG)
        with channel:
            try:
                return [
                    a.sequence
                    for a in pb_grpc.IngestStub(channel).Push(
                        iter(batches), metadata=(("authorization", f"Bearer {INGEST_TOKEN}"),), timeout=120
                    )
                ]
            except grpc.RpcError as err:
                return f"{err.code().name}: {err.details()[:160]}"


_BIG = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]


# -- 1. slowloris -------------------------------------------------------------------------------------------
class Trickle:
    """Connections that each send one header byte every `every_s`, reconnecting when cut off; run on one
    thread. Counts what the server answered them."""

    REQUEST = b"GET /api/v1/top HTTP/1.1\r\nHost: collector\r\nX-Padding: " + b"p" * 4000

    def __init__(self, target: Target, sources: list[str], per_source: int, every_s: float) -> None:
        self.target, self.every_s = target, every_s
        self.slots = [(src, i) for src in sources for i in range(per_source)]
        self.answers: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _open(self, source: str) -> tuple[socket.socket | None, int]:
        try:
            s = self.target.connect(source, timeout=10)
            s.settimeout(0.001)
            return s, 0
        except OSError:
            self.answers["connect_failed"] = self.answers.get("connect_failed", 0) + 1
            return None, 0

    def _answer(self, s: socket.socket, first: bytes) -> None:
        """Count what the server said before it cut the connection off (`first`: its first byte)."""
        data = first
        try:
            s.settimeout(5)
            while len(data) < 12 and (more := s.recv(200)):
                data += more
        except OSError:
            pass
        key = data.split()[1].decode() if data.startswith(b"HTTP/1.1 ") and len(data) >= 12 else "closed"
        self.answers[key] = self.answers.get(key, 0) + 1
        s.close()

    def _run(self) -> None:
        conns = [self._open(src) for src, _ in self.slots]
        while not self._stop.wait(self.every_s):
            for k, (s, sent) in enumerate(conns):
                src = self.slots[k][0]
                if s is None:
                    conns[k] = self._open(src)
                    continue
                first = b""
                try:
                    s.send(self.REQUEST[sent : sent + 1])
                    conns[k] = (s, sent + 1)
                    first = s.recv(1)  # anything back (a 503 or 408) means we were cut off
                except (BlockingIOError, ssl.SSLWantReadError, TimeoutError):
                    continue
                except OSError:
                    pass
                self._answer(s, first)
                conns[k] = self._open(src)
        for s, _ in conns:
            if s is not None:
                s.close()


def attack_slowloris(t: Target) -> dict:
    out: dict = {}
    for phase, sources, per in (
        ("one address, 70", ["127.0.0.1"], 70),
        ("10 addresses, 560", [f"127.0.1.{i}" for i in range(1, 11)], 56),
    ):
        trickle = Trickle(t, sources, per, 5.0)
        t0 = time.monotonic()
        trickle.start()
        checks = []
        for at in (3, 20, 40):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            api = t.get("/api/v1/labels", source="127.0.0.2")
            health = t.get("/healthz", source="127.0.0.3", token=False)
            checks.append(
                {
                    "at_s": at,
                    "api": api[0],
                    "api_s": round(api[2], 3),
                    "healthz": health[0],
                    "healthz_s": round(health[2], 3),
                }
            )
        time.sleep(max(0.0, t0 + 45 - time.monotonic()))
        m = t.metrics()
        trickle.stop()
        events = {
            k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("fleetprof_http_events_total{")
        }
        out[phase] = {"checks": checks, "slow_clients_got": trickle.answers, "server_events": events}
        time.sleep(3)
    return out


# -- 2. refused batches ------------------------------------------------------------------------------------
AGENT = "a77ac4000000000000000000000000aa"


def _bad_stacks_batch(seq: int, unused: bool) -> pb.Batch:
    b = BatchBuilder("attacker", AGENT, seq)
    proc = b.process(42, "worker", {"pod": "p"})
    for i in range(16):
        name = f"{seq:06d}-{i:02d}-" + "x" * 65_000
        if unused:
            b.string(name)  # in the string table, in no stack
            b.sample(proc, b.stack([("main", "app")]), 1)
        else:
            b.sample(proc, b.stack([("main", "app"), (name, "app")]), 1)
    batch = b.build()
    batch.sample_columns.count[-1] = 0
    return batch


def attack_refused(t: Target) -> dict:
    assert t.push([make_batch(1, agent_id=AGENT, node="attacker")], node_cert="attacker") == [1]
    out = {}
    for kind, unused, seq0 in (
        ("control: unused strings", True, 1000),
        ("attack: 16 x 65 KB stacks", False, 2000),
    ):
        tables = {k: v for k, v in t.metrics().items() if k.startswith("fleetprof_ingest_cache_entries")}
        before = t.rss()[0]
        answers: dict[str, int] = {}
        for seq in range(seq0, seq0 + 80):
            got = t.push([_bad_stacks_batch(seq, unused)], node_cert="attacker")
            key = got.split(":")[0] if isinstance(got, str) else "ACKED"
            answers[key] = answers.get(key, 0) + 1
        after = t.rss()[0]
        tables_after = {
            k: v for k, v in t.metrics().items() if k.startswith("fleetprof_ingest_cache_entries")
        }
        out[kind] = {
            "answers": answers,
            "rss_before_mib": round(before, 1),
            "rss_after_mib": round(after, 1),
            "tables_unchanged": tables == tables_after,
        }
    return out


# -- 3. label flood ----------------------------------------------------------------------------------------
def _pods_batch(seq: int, n: int, node: str, tag: str, small: bool = False) -> pb.Batch:
    """`n` processes, each with a unique 1,000-byte pod (`small`: one of 100 short pods)."""
    b = BatchBuilder(node, f"f100d{node.encode().hex()}", seq)
    stack = b.stack([("main", "app")])
    for i in range(n):
        pod = f"{tag}-{i % 100}" if small else f"{tag}-{seq:02d}-{i:06d}-" + "p" * 985
        b.sample(b.process(seq * 100_000 + i, "worker", {"pod": pod}), stack, 1)
    return b.build()


def attack_labels(t: Target) -> dict:
    out: dict = {}
    before = t.rss()
    answers = []
    for seq in range(1, 11):
        got = t.push([_pods_batch(seq, 20_000, "attacker", "a")], node_cert="attacker")
        answers.append(got if isinstance(got, str) else "ACKED")
    b = BatchBuilder("attacker", "f100d0000000000000000000000000ab", 1)
    b.sample(b.process(1, "w", {f"l{i:05d}": "v" * 1000 for i in range(20_000)}), b.stack([("main", "m")]), 1)
    wide = t.push([b.build()], node_cert="attacker")
    after = t.rss()
    status, body, secs = t.get("/api/v1/labels/pod/values?limit=10000")
    q_status, _, q_secs = t.get("/api/v1/top?since=1h&query=%7Bpod%3D~%22a-0.*%22%7D")
    out["one node: 10 x 20,000 unique 1,000-byte pods"] = {
        "answers": sorted(set(answers)),
        "wide process (20,000 labels)": wide if isinstance(wide, str) else "ACKED",
        "rss_mib": [round(before[0], 1), round(after[0], 1)],
        "peak_mib": round(after[1], 1),
        "label_values": {"status": status, "bytes": len(body), "seconds": round(secs, 3)},
        "pod=~ query": {"status": q_status, "seconds": round(q_secs, 3)},
    }
    # The same pods spread over node names, each within its node's quota: what the token allows.
    before = t.rss()
    acked = refused = 0
    reasons: set[str] = set()
    for n in range(40):
        got = t.push([_pods_batch(1, 4_000, f"spread-{n:02d}", "s")], node_cert="spreader")
        if isinstance(got, str):
            refused += 1
            reasons.add(got[:120])
        else:
            acked += 1
    after = t.rss()
    status, body, secs = t.get("/api/v1/labels/pod/values")
    label_sets = t.metrics().get('fleetprof_ingest_cache_entries{table="quota_label_sets"}')
    out["40 node names x 4,000 unique 1,000-byte pods"] = {
        "label_sets_held": label_sets,
        "acked": acked,
        "refused": refused,
        "refusals": sorted(reasons)[:3],
        "rss_mib": [round(before[0], 1), round(after[0], 1)],
        "peak_mib": round(after[1], 1),
        "label_values (default limit)": {"status": status, "bytes": len(body), "seconds": round(secs, 3)},
    }
    # Many label sets with small values (pid alone makes each distinct), spread over node names.
    before = t.rss()
    acked = refused = 0
    reasons = set()
    for n in range(15):
        got = t.push([_pods_batch(1, 20_000, f"many-{n:02d}", "m", small=True)], node_cert="spreader")
        if isinstance(got, str):
            refused += 1
            reasons.add(got[:120])
        else:
            acked += 1
    after = t.rss()
    out["15 node names x 20,000 small label sets"] = {
        "acked": acked,
        "refused": refused,
        "refusals": sorted(reasons)[:3],
        "label_sets_held": t.metrics().get('fleetprof_ingest_cache_entries{table="quota_label_sets"}'),
        "rss_mib": [round(before[0], 1), round(after[0], 1)],
        "peak_mib": round(after[1], 1),
    }
    return out


# -- 4. node spoofing, 5. dedupe ---------------------------------------------------------------------------
def _node_samples(t: Target, node: str) -> int:
    status, body, _ = t.get(f"/api/v1/top?since=1h&query=%7Bnode%3D%22{node}%22%7D")
    return json.loads(body)["total"] if status == 200 else -status


def attack_node(t: Target) -> dict:
    out = {}
    for node in ("victim", "victim "):
        got = t.push([make_batch(1, node=node, count=9)], node_cert="mallory")
        out[repr(node)] = got if isinstance(got, str) else f"ACKED: stored under node {node!r}"
    out["victim's samples written by mallory"] = _node_samples(t, "victim")
    return out


def attack_dedupe(t: Target) -> dict:
    stolen = "5ee0c0ffee5ee0c0ffee5ee0c0ffee00"
    pre = t.push(
        [make_batch(s, agent_id=stolen, node="mallory", count=1) for s in range(1, 6)], node_cert="mallory"
    )
    real = t.push(
        [make_batch(s, agent_id=stolen, node="victim2", count=400) for s in range(1, 6)], node_cert="victim2"
    )
    dups = t.metrics().get("fleetprof_ingest_duplicate_batches_total", 0)
    logged = sum("as a duplicate" in line for line in t.log.read_text(errors="replace").splitlines())
    return {
        "attacker pre-sent": pre,
        "victim's 5 batches acknowledged": real,
        "victim's samples stored (of 2,000)": _node_samples(t, "victim2"),
        "duplicates dropped": int(dups),
        "duplicate log lines": logged,
    }


ATTACKS = {
    "1": attack_slowloris,
    "2": attack_refused,
    "3": attack_labels,
    "4": attack_node,
    "5": attack_dedupe,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="memory,data-dir,tls")
    ap.add_argument("--attacks", default="1,2,3,4,5")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="fleetprof-attacks-") as tmp:
        for variant in args.variants.split(","):
            t = Target(variant, Path(tmp))
            try:
                results[variant] = {"start_rss_mib": round(t.rss()[0], 1)}
                for key in args.attacks.split(","):
                    name = ATTACKS[key].__name__
                    t0 = time.monotonic()
                    results[variant][name] = ATTACKS[key](t)
                    results[variant][name + "_s"] = round(time.monotonic() - t0, 1)
                    print(f"{variant} {name}: {json.dumps(results[variant][name], indent=1)}", flush=True)
            finally:
                t.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
