"""The HTTP server shared by the agent and the collector cannot be stalled by a client: a query past its
budget gets a 503, connections beyond the limit get a 503 at once, and a client that stops sending is cut
off (timings here are limits the server enforces, never measured against a wall clock)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from fleetprof.httpserve import HttpServer, Request, Response, json_response
from tests.conftest import free_port, wait_until


@pytest.fixture(params=[0.5], ids=["read-timeout-0.5s"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[HttpServer, threading.Event]]:
    release = threading.Event()

    def slow(_: Request) -> Response:
        release.wait(30)
        return json_response({"slow": True})

    routes = {"/slow": slow, "/fast": lambda _: json_response({"fast": True})}
    srv = HttpServer(
        "127.0.0.1", free_port(), routes, max_connections=3, read_timeout_s=request.param, budget_s=0.3
    )
    srv.start()
    yield srv, release
    release.set()
    srv.stop()


def get(srv: HttpServer, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_query_past_its_budget_gets_a_503_and_the_server_keeps_answering(server) -> None:  # noqa: ANN001
    srv, release = server
    status, body = get(srv, "/slow")
    assert status == 503 and "ran past its 0.3 s budget" in body["error"]
    assert get(srv, "/fast") == (200, {"fast": True})
    release.set()


@pytest.mark.parametrize("server", [60.0], ids=["read-timeout-60s"], indirect=True)
def test_connections_beyond_the_limit_get_a_503_at_once(server) -> None:  # noqa: ANN001
    srv, _ = server
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
    try:
        # The three idle connections hold every slot (the read timeout is far off); a fourth client is told
        # the server is busy rather than left waiting.
        status, body = get(srv, "/fast")
        assert status == 503 and "too many connections" in body["error"]
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: get(srv, "/fast")[0] == 200, 10, "the slots to be free once the idle clients left")


def test_a_client_that_stops_sending_mid_request_is_cut_off(server) -> None:  # noqa: ANN001
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        s.settimeout(20)
        assert s.recv(1024) == b""  # closed by the server after its read timeout
    assert get(srv, "/fast") == (200, {"fast": True})
