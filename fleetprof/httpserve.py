"""A small threaded HTTP server with a route table, shared by the agent and the collector."""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

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
    headers: dict[str, str] = field(default_factory=dict)

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


class HttpServer:
    """Routes GET requests by exact path or by prefix (longest first); runs on a daemon thread."""

    def __init__(
        self, host: str, port: int, routes: dict[str, Handler], prefixes: dict[str, Handler] | None = None
    ):
        self._routes = routes
        self._prefixes = sorted((prefixes or {}).items(), key=lambda kv: -len(kv[0]))
        server = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server._dispatch(self)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("%s %s", self.address_string(), fmt % args)

        self._httpd = ThreadingHTTPServer((host, port), _H)
        self._httpd.daemon_threads = True
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
        self._wake_r.close()
        self._wake_w.close()

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        req = Request(path, query, {k.lower(): v for k, v in h.headers.items()})
        handler = self._routes.get(path)
        if handler is None:
            handler = next((fn for prefix, fn in self._prefixes if path.startswith(prefix)), None)
        try:
            if handler is None:
                raise HttpError(404, f"no such endpoint: {path}")
            resp = handler(req)
        except HttpError as err:
            resp = json_response({"error": err.message}, err.status)
        except Exception as exc:  # a bug in a handler must not take the server down
            log.exception("handler for %s failed", path)
            resp = json_response({"error": f"internal error: {exc}"}, 500)
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
