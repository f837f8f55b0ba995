"""The HTTP server shared by the agent and the collector cannot be taken offline by its clients: a request
must arrive whole within its deadline however it trickles, one address holds a bounded share of the
connections, the longest-waiting connection makes room for a new one, /healthz and /metrics answer while
every query slot is taken, and a query past its budget gets a 503. Real sockets; the deadlines are the
server's own, set small here, never measured against a wall clock (waits are generous upper bounds)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from fleetprof.httpserve import HttpLimits, HttpServer, Request, Response, json_response
from tests.conftest import free_port, wait_until

TOKEN = "api-0a9f3e"


class Served:
    def __init__(self, limits: HttpLimits, tokens: bool = False) -> None:
        self.release = threading.Event()
        self.running = 0  # /slow handlers started

        def slow(_: Request) -> Response:
            self.running += 1
            self.release.wait(30)
            return json_response({"slow": True})

        routes = {
            "/slow": slow,
            "/fast": lambda _: json_response({"fast": True}),
            "/big": lambda _: Response(b"x" * 5000, "text/plain"),
            "/healthz": lambda _: json_response({"status": "ok"}),
            "/metrics": lambda _: Response(b"up 1\n", "text/plain"),
        }

        class Accepts:
            def accepts(self, token: str) -> bool:
                return token == TOKEN

        self.srv = HttpServer(
            "127.0.0.1", free_port(), routes, limits=limits, tokens=Accepts() if tokens else None
        )
        self.srv.start()

    def stop(self) -> None:
        self.release.set()
        self.srv.stop()

    def get(self, path: str, source: str = "127.0.0.1", token: bool = False) -> tuple[int, bytes]:
        """GET from the client address `source` (any of 127.0.0.0/8 reaches a server on 127.0.0.1)."""
        with socket.create_connection(
            ("127.0.0.1", self.srv.port), timeout=20, source_address=(source, 0)
        ) as s:
            auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
            return _read_answer(s)


def _read_answer(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    marker = request.node.get_closest_marker("limits")
    limits = HttpLimits(**(marker.kwargs if marker else {}))
    s = Served(limits, tokens=bool(marker and marker.args))
    yield s
    s.stop()


@pytest.mark.limits(budget_s=0.3)
def test_a_query_past_its_budget_gets_a_503_and_the_server_keeps_answering(served: Served) -> None:
    status, body = served.get("/slow")
    assert status == 503 and "ran past its 0.3 s budget" in json.loads(body)["error"]
    assert served.get("/fast") == (200, b'{"fast":true}')


@pytest.mark.limits(request_deadline_s=0.5)
def test_a_client_that_stops_sending_mid_request_gets_a_408_and_is_closed(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.srv.port), timeout=20) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        status, body = _read_answer(s)  # the answer, then the end of the connection
    assert status == 408 and "within 0.5 s" in json.loads(body)["error"]
    assert served.get("/fast")[0] == 200


@pytest.mark.limits(request_deadline_s=1.0, idle_timeout_s=60)
def test_a_request_trickled_a_byte_at_a_time_is_cut_off_at_its_deadline(served: Served) -> None:
    """What the old server's read timeout (silence between reads) let through: a byte every 0.2 s kept a
    connection for good. The deadline counts from the first byte, whatever arrives after it."""
    with socket.create_connection(("127.0.0.1", served.srv.port), timeout=20) as s:
        sent = 0
        request = b"GET /fast HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
        try:
            for byte in request:  # 1,000+ bytes at 0.2 s each would take 200 s
                s.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.2)
        except OSError:  # closed under us: the deadline passed
            pass
        assert sent < 200, "the server kept reading a trickled request"
        assert _read_answer(s)[0] == 408
    wait_until(lambda: served.srv.connections == 0, 10, "the slot to be freed")
    assert served.srv.stats["request_timeouts"] == 1


@pytest.mark.limits(max_per_address=2)
def test_one_address_gets_a_bounded_share_of_the_connections(served: Served) -> None:
    held = [socket.create_connection(("127.0.0.1", served.srv.port)) for _ in range(2)]
    try:
        wait_until(lambda: served.srv.connections == 2, 10, "both connections to be accepted")
        status, body = served.get("/fast")  # a third from 127.0.0.1
        assert status == 503 and "too many connections" in json.loads(body)["error"]
        assert served.get("/fast", source="127.0.0.2") == (200, b'{"fast":true}')
    finally:
        for s in held:
            s.close()
    wait_until(
        lambda: served.get("/fast")[0] == 200, 10, "the address's slots to be free once its clients left"
    )
    assert served.srv.stats["refused_per_address"] >= 1


@pytest.mark.limits(max_connections=3, max_per_address=10, request_deadline_s=60, idle_timeout_s=60)
def test_a_new_connection_closes_the_one_that_waited_longest(served: Served) -> None:
    idle = [socket.create_connection(("127.0.0.1", served.srv.port)) for _ in range(3)]
    try:
        wait_until(lambda: served.srv.connections == 3, 10, "the three connections to be accepted")
        assert served.get("/fast", source="127.0.0.2") == (200, b'{"fast":true}')  # a fourth: room was made
        idle[0].settimeout(20)
        assert idle[0].recv(1024) == b"" and served.srv.stats["evicted"] == 1  # the oldest, closed
        idle[1].setblocking(False)
        with pytest.raises(BlockingIOError):  # the others still open, waiting for their requests
            idle[1].recv(1024)
    finally:
        for s in idle:
            s.close()


@pytest.mark.limits(max_connections=2, max_per_address=10, budget_s=30)
def test_when_every_connection_runs_a_query_a_new_one_gets_a_503(served: Served) -> None:
    running = [threading.Thread(target=served.get, args=("/slow",)) for _ in range(2)]
    for t in running:
        t.start()
    try:
        wait_until(lambda: served.running == 2, 10, "both queries to run")
        status, body = served.get("/fast", source="127.0.0.2")
        assert status == 503 and "too many connections" in json.loads(body)["error"]
    finally:
        served.release.set()
        for t in running:
            t.join(30)
    assert served.get("/fast")[0] == 200


@pytest.mark.limits(query_workers=1, query_queue=0, budget_s=30)
def test_healthz_and_metrics_answer_while_every_query_slot_is_taken(served: Served) -> None:
    running = threading.Thread(target=served.get, args=("/slow",))
    running.start()
    try:
        wait_until(lambda: served.running == 1, 10, "the query to run")
        status, body = served.get("/fast")
        assert status == 503 and "too many queries" in json.loads(body)["error"]
        assert served.get("/healthz") == (200, b'{"status":"ok"}')
        assert served.get("/metrics") == (200, b"up 1\n")
    finally:
        served.release.set()
        running.join(30)
    assert served.get("/fast")[0] == 200


@pytest.mark.limits(max_response_bytes=4096)
def test_an_answer_over_the_response_bound_is_refused_by_name(served: Served) -> None:
    status, body = served.get("/big")
    assert status == 422 and "5000 bytes, over the 4096" in json.loads(body)["error"]


def test_keep_alive_and_pipelined_requests_are_answered_in_order(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.srv.port), timeout=20) as s:
        first = b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(first + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, body = _read_answer(s)
    assert status == 200
    assert body.startswith(b'{"fast":true}HTTP/1.1 200 OK') and body.endswith(b'{"status":"ok"}')
    with urllib.request.urlopen(f"http://127.0.0.1:{served.srv.port}/fast", timeout=20) as r:
        assert r.read() == b'{"fast":true}'


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /" + b"q" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /fast HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
        (b"DELETE /fast HTTP/1.1\r\n\r\n", 501),
        (b"GET /fast HTTP/2.0\r\n\r\n", 505),
        (b"nonsense\r\n\r\n", 400),
        (b"POST /fast HTTP/1.1\r\n\r\n", 411),
    ],
    ids=["long-line", "101-headers", "delete", "http2", "garbage", "post-without-length"],
)
def test_bad_requests_get_a_clear_4xx_or_5xx(served: Served, request_bytes: bytes, status: int) -> None:
    with socket.create_connection(("127.0.0.1", served.srv.port), timeout=20) as s:
        s.sendall(request_bytes)
        got, body = _read_answer(s)
    assert got == status and json.loads(body)["error"]


@pytest.mark.limits(
    TOKEN, max_connections=256, max_per_address=16, request_deadline_s=3.0, idle_timeout_s=3.0, budget_s=30
)
def test_seventy_slowloris_connections_leave_the_api_and_healthz_answering(served: Served) -> None:
    """The run of 2026-11-27, with the deadline scaled from 10 s to 3 s: 70 connections that each send one
    header byte every second. Before: connections 65-70 got 503 at once, a query with the token and /healthz
    got 503 for as long as the trickle went on, and all 64 slots stayed held. Now one address holds at most
    16 (the rest get 503 at once), a query from elsewhere and /healthz answer, and the held slots are freed
    at the deadline."""
    slow = []
    for _ in range(70):
        s = socket.socket()
        s.settimeout(10)
        s.connect(("127.0.0.1", served.srv.port))
        slow.append(s)
    stop = threading.Event()
    outcome: dict[str, int] = {"answered": 0, "408": 0, "503": 0}

    def trickle(s: socket.socket) -> None:
        request = b"GET /api/v1/top HTTP/1.1\r\nHost: collector\r\nX-Padding: " + b"p" * 100
        try:
            for byte in request:
                if stop.is_set():
                    return
                s.sendall(bytes([byte]))
                if stop.wait(1.0):
                    return
        except OSError:
            pass
        finally:
            try:
                status, _ = _read_answer(s)
                outcome[str(status)] = outcome.get(str(status), 0) + 1
            except (OSError, ValueError, IndexError):
                pass
            outcome["answered"] += 1

    threads = [threading.Thread(target=trickle, args=(s,)) for s in slow]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: served.srv.stats.get("refused_per_address", 0) == 54, 20, "54 refusals at once")
        assert served.srv.stats["accepted"] == 16
        # While the trickle goes on: the API (with its token) and /healthz answer, from other addresses.
        assert served.get("/fast", source="127.0.0.2", token=True) == (200, b'{"fast":true}')
        assert served.get("/healthz", source="127.0.0.3") == (200, b'{"status":"ok"}')
        assert served.get("/fast", source="127.0.0.2")[0] == 401  # still behind the token
        # The 16 held slots are freed at the deadline (3 s from their first byte), each with a 408.
        wait_until(lambda: served.srv.stats.get("request_timeouts", 0) >= 16, 30, "the held slots' deadline")
        wait_until(lambda: served.srv.connections == 0, 30, "every slot to be free")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for s in slow:
            s.close()
    assert outcome["503"] == 54 and outcome["408"] == 16
