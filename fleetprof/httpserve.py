"""A small threaded HTTP server with a route table, shared by the agent and the collector.

Bounded so that no client can stall it: at most `max_connections` connections are served at once (more get
a 503 at once), a connection that sends nothing for `read_timeout_s` is closed, and a handler that runs past
`budget_s` is answered with a 503 naming the budget (it finishes in the background, on a bounded pool).

Optionally over TLS (the handshake runs on the connection's own thread, under the read timeout, so a slow
or plaintext client costs only its own slot), and behind a token: every path but the public ones (/healthz)
then needs `Authorization: Bearer TOKEN`, or Basic with the token as password (a browser's login prompt)."""

from __future__ import annotations

import json
import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from fleetprof.auth import presented_token

log = logging.getLogger(__name__)


class HttpError(Exception):
    """Raised by a handler to answer with `status` and a JSON body {"error": message}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    path: str
    query: dict[str, str]
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    method: str = "GET"
    body: bytes = b""

    def param(self, name: str, default: str | None = None) -> str | None:
        """A query parameter; an empty value counts as absent."""
        v = self.query.get(name)
        return v if v not in (None, "") else default


@dataclass
class Response:
    body: bytes
    content_type: str = "application/json"
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")).encode(), "application/json", status)


def text_response(text: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(text.encode(), content_type)


Handler = Callable[[Request], Response]
# How a POST route answers an error of the server's own (401, 404, 413, 503, 500): status, message.
ErrorShape = Callable[[int, str], Response]


def _json_error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


class Tokens(Protocol):
    def accepts(self, token: str) -> bool: ...


class Tls(Protocol):
    def http_context(self) -> ssl.SSLContext: ...


_CHALLENGE = 'Basic realm="fleetprof", charset="UTF-8", Bearer realm="fleetprof"'


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: 59\r\n\r\n{"error":"too many connections at once; retry in a moment"}'
)


# A body over the limit is still read, and dropped, up to this many times the limit, so the error reaches
# the client: closing on unread bytes resets the connection, and the client may lose the answer with it.
_DRAIN = 16


def _discard(stream: object, n: int) -> None:
    while n > 0:
        got = stream.read(min(n, 1 << 16))  # type: ignore[attr-defined]
        if not got:
            return
        n -= len(got)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `limit` of them: the one over gets a 503 and is closed."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type, limit: int, tls: Tls | None, timeout_s: float
    ):
        self._slots = threading.BoundedSemaphore(limit)
        self._tls = tls
        self._handshake_timeout_s = timeout_s
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001
        if self._tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(self._handshake_timeout_s)
        try:
            conn = self._tls.http_context().wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as err:  # a plaintext client, a bad certificate, a timeout
            log.debug("TLS handshake with %s failed: %s", client_address, err)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


class HttpServer:
    """Routes GET requests by exact path or by prefix (longest first); runs on a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Handler],
        prefixes: dict[str, Handler] | None = None,
        max_connections: int = 64,
        read_timeout_s: float = 15.0,
        budget_s: float = 30.0,
        tls: Tls | None = None,
        tokens: Tokens | None = None,
        public: frozenset[str] = frozenset({"/healthz"}),
        post_prefixes: dict[str, tuple[Handler | None, ErrorShape]] | None = None,
        max_body_bytes: int = 1 << 20,
    ):
        self._routes = routes
        # POST is served only under these prefixes (RPC endpoints), each with its own error shape.
        self._post = sorted((post_prefixes or {}).items(), key=lambda kv: -len(kv[0]))
        self._max_body = max_body_bytes
        self._tokens = tokens
        self._public = public
        self.unauthorized = 0  # requests refused for a missing or wrong token (self-metric)
        self._prefixes = sorted((prefixes or {}).items(), key=lambda kv: -len(kv[0]))
        self._budget_s = budget_s
        self._workers = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"http-work:{port}")
        server = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout_s  # a client that stops sending mid-request (or idles) is dropped

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server._dispatch(self)

            def do_POST(self) -> None:  # noqa: N802
                server._dispatch_post(self)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("%s %s", self.address_string(), fmt % args)

        self._httpd = _BoundedServer((host, port), _H, max_connections, tls, read_timeout_s)
        self._httpd.timeout = 0  # handle_request() after select() said readable: never block in it
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=f"http:{port}", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        """Accept until `stop()`. Unlike socketserver's serve_forever (which polls for its shutdown flag
        twice a second), this sleeps until a connection or the stop signal arrives: an idle server
        never wakes."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._httpd, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj is self._wake_r for key, _ in ready):
                    return
                self._httpd.handle_request()  # readable: accepts at once, handled on its own thread

    def stop(self) -> None:
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join()
        self._httpd.server_close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()

    def _request(self, h: BaseHTTPRequestHandler, method: str) -> Request:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        headers = {k.lower(): v for k, v in h.headers.items()}
        return Request(unquote(parts.path), query, headers, method)

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        req = self._request(h, "GET")
        handler = self._routes.get(req.path)
        if handler is None:
            handler = next((fn for prefix, fn in self._prefixes if req.path.startswith(prefix)), None)
        self._send(h, self._answer(req, handler, _json_error))

    def _dispatch_post(self, h: BaseHTTPRequestHandler) -> None:
        req = self._request(h, "POST")
        handler, shape = next(
            ((fn, shape) for prefix, (fn, shape) in self._post if req.path.startswith(prefix)),
            (None, _json_error),
        )
        try:
            req.body = self._read_body(h)  # under the connection's read timeout
        except HttpError as err:
            h.close_connection = True  # the rest of the body is unread: the connection cannot go on
            self._send(h, shape(err.status, err.message))
            return
        except (OSError, ValueError):
            h.close_connection = True
            return
        self._send(h, self._answer(req, handler, shape))

    def _read_body(self, h: BaseHTTPRequestHandler) -> bytes:
        """The request body, by Content-Length or chunked (what streaming clients such as Node's send
        over HTTP/1.1), at most max_body_bytes."""
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(h)
        length = h.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise HttpError(411, "a POST needs a Content-Length or a chunked body")
        if int(length) > self._max_body:
            if int(length) <= _DRAIN * self._max_body:
                _discard(h.rfile, int(length))
            raise HttpError(413, f"a request body may have at most {self._max_body} bytes, not {length}")
        return h.rfile.read(int(length))

    def _read_chunked(self, h: BaseHTTPRequestHandler) -> bytes:
        body = bytearray()
        over = 0  # bytes past the limit, read and dropped
        while True:
            line = h.rfile.readline(1024)
            digits = line.split(b";")[0].strip()
            if not digits or digits.strip(b"0123456789abcdefABCDEF"):
                raise HttpError(400, f"bad chunk size line {line[:40]!r}")
            size = int(digits, 16)
            too_big = HttpError(413, f"a request body may have at most {self._max_body} bytes")
            if size == 0:
                while h.rfile.readline(1024).strip():  # trailers, up to the blank line
                    pass
                if over:
                    raise too_big
                return bytes(body)
            if over or len(body) + size > self._max_body:
                over += size
                if over > _DRAIN * self._max_body:
                    raise too_big
                _discard(h.rfile, size)
            else:
                body += h.rfile.read(size)
            h.rfile.readline(3)  # the chunk's CRLF

    def _answer(self, req: Request, handler: Handler | None, shape: ErrorShape) -> Response:
        try:
            if not self._authorized(req):
                self.unauthorized += 1
                resp = shape(401, "this endpoint needs the API token (Authorization: Bearer)")
                resp.headers["WWW-Authenticate"] = _CHALLENGE
                return resp
            if handler is None:
                raise HttpError(404, f"no such endpoint: {req.method} {req.path}")
            return self._workers.submit(handler, req).result(timeout=self._budget_s)
        except FutureTimeout:
            budget = f"{self._budget_s:g} s"
            message = (
                f"the query ran past its {budget} budget: ask for a shorter range or a narrower selector"
            )
            return shape(503, message)
        except HttpError as err:
            return shape(err.status, err.message)
        except Exception as exc:  # a bug in a handler must not take the server down
            log.exception("handler for %s failed", req.path)
            return shape(500, f"internal error: {exc}")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, resp: Response) -> None:
        try:
            h.send_response(resp.status)
            h.send_header("Content-Type", resp.content_type)
            h.send_header("Content-Length", str(len(resp.body)))
            h.send_header("Cache-Control", "no-store")
            for k, v in resp.headers.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(resp.body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _authorized(self, req: Request) -> bool:
        if self._tokens is None or req.path in self._public:
            return True
        token = presented_token(req.headers.get("authorization", ""))
        return token is not None and self._tokens.accepts(token)
