"""A small HTTP/1.1 server with a route table, shared by the agent and the collector, that no client can
take offline.

One thread owns every socket (a selector loop): it accepts, runs TLS handshakes, reads requests
(fleetprof/httprequest.py) and writes answers without ever blocking, so a connection waiting on a slow
client costs a socket and a buffer, not a thread. Handlers run on two bounded pools: the query pool, and
the light routes (/healthz, /metrics) that must answer even while every query slot is taken. What this
answers: on 2026-11-27, 70 connections sending one header byte every 5 s held all 64 threads of the old
thread-per-connection server for good (its read timeout counted only the silence between reads), and
/healthz answered 503, which in Kubernetes restarts the collector.

Limits (HttpLimits; each event counted in `stats`, exported as fleetprof_http_events_total):
- A request arrives whole (TLS handshake, request line, headers, body) within `request_deadline_s` of its
  first byte (of the connection's opening, for its first request), whatever the trickle: else 408 and
  the connection ends. A kept-alive connection waits `idle_timeout_s` for its next request.
- At most `max_per_address` connections from one client address (a 503 at once past it), and
  `max_connections` in all: past that, the connection that has waited longest for a request is closed to
  make room (a slow client is by then the oldest), else a 503.
- At most `query_workers` handlers run and `query_queue` wait (a 503 past it); a handler still running
  after `budget_s` gets its client a 503 naming the budget (it finishes in the background, on the pool).
- Request sizes as httprequest.py says; answers up to `max_response_bytes` (422: ask for less), taken by
  the client within `write_timeout_s`.

Optionally over TLS, and behind a token: every path but the public ones (/healthz) then needs
`Authorization: Bearer TOKEN`, or Basic with the token as password (a browser's login prompt).
"""

from __future__ import annotations

import heapq
import http
import itertools
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from fleetprof.auth import presented_token
from fleetprof.httprequest import Refused, Request, RequestReader

__all__ = ["HttpError", "HttpLimits", "HttpServer", "Request", "Response", "json_response", "text_response"]

log = logging.getLogger(__name__)


class HttpError(Exception):
    """Raised by a handler to answer with `status` and a JSON body {"error": message}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


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
# How a POST route answers an error of the server's own (401, 404, 408, 413, 422, 503, 500): status, message.
ErrorShape = Callable[[int, str], Response]


def _json_error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


class Tokens(Protocol):
    def accepts(self, token: str) -> bool: ...


class Tls(Protocol):
    def http_context(self) -> ssl.SSLContext: ...


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP server allows (the module's docstring); built once from the config and passed down."""

    max_connections: int = 512
    max_per_address: int = 64
    request_deadline_s: float = 10.0
    idle_timeout_s: float = 15.0
    write_timeout_s: float = 30.0
    max_request_line: int = 64 << 10
    max_header_bytes: int = 128 << 10
    max_body_bytes: int = 1 << 20
    max_response_bytes: int = 64 << 20
    query_workers: int = 8
    query_queue: int = 64
    light_workers: int = 2
    budget_s: float = 30.0


_CHALLENGE = 'Basic realm="fleetprof", charset="UTF-8", Bearer realm="fleetprof"'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: 59\r\n\r\n{"error":"too many connections at once; retry in a moment"}'
)
_RECV = 1 << 16
_SEND = 1 << 18
# After an answer that ends the connection, what the client still sends is read and dropped this long
# before the close: closing on unread bytes resets the connection, and the client loses the answer.
_LINGER_S = 2.0
# Refused connections (503 at once) linger too, up to this many at a time; past it one is closed at once,
# its request perhaps unread (a reset that may cost that client the 503, never the server its bound).
_REFUSED_LINGERING = 64

# Connection states: shaking hands (TLS), reading a request, waiting for its handler, writing the answer,
# lingering after a last answer.
_HANDSHAKE, _READ, _WAIT, _WRITE, _LINGER = "handshake", "read", "wait", "write", "linger"


class _Refused:
    """A connection refused with a 503: what its client still sends is read and dropped until it closes
    or _LINGER_S pass, so the close does not reset the connection before the client read the answer."""

    __slots__ = ("sock", "deadline", "closed")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.closed = sock, deadline, False


class _Conn:
    """One client connection, owned by the loop thread."""

    __slots__ = (
        "sock", "address", "reader", "state", "out", "sent", "deadline", "since", "started", "keep_alive",
        "shape", "token", "want_write", "continued", "registered", "closed",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, address: str, reader: RequestReader, state: str, now: float):
        self.sock = sock
        self.address = address
        self.reader = reader
        self.state = state
        self.out = memoryview(b"")
        self.sent = 0
        self.deadline = 0.0
        self.since = now  # when it began to wait for a request: the longest waiting is evicted first
        self.started = True  # the current request's deadline runs (from the opening, for the first)
        self.keep_alive = False
        self.shape: ErrorShape = _json_error
        self.token = 0  # bumped per answer, so a handler's late result for an earlier request is dropped
        self.want_write = False  # TLS must write before it can read on
        self.continued = False  # sent `100 Continue` for the current request
        self.registered = False  # with the selector
        self.closed = False


class HttpServer:
    """Routes GET requests by exact path or by prefix (longest first) and POST requests by prefix (RPC
    endpoints, each with its error shape); `light` paths run on a pool of their own. Serves on a daemon
    thread from start() to stop()."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Handler],
        prefixes: dict[str, Handler] | None = None,
        limits: HttpLimits | None = None,
        tls: Tls | None = None,
        tokens: Tokens | None = None,
        public: frozenset[str] = frozenset({"/healthz"}),
        post_prefixes: dict[str, tuple[Handler | None, ErrorShape]] | None = None,
        light: frozenset[str] = frozenset({"/healthz", "/metrics"}),
    ):
        self.limits = limits = limits or HttpLimits()
        self._routes = routes
        self._prefixes = sorted((prefixes or {}).items(), key=lambda kv: -len(kv[0]))
        self._post = sorted((post_prefixes or {}).items(), key=lambda kv: -len(kv[0]))
        self._tls = tls
        self._tokens = tokens
        self._public = public
        self._light = light
        self.unauthorized = 0  # requests refused for a missing or wrong token (self-metric)
        self.stats: dict[str, int] = {}  # events (fleetprof_http_events_total{event})
        self._stats_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        self._listener.setblocking(False)
        self._pools = {
            "query": ThreadPoolExecutor(limits.query_workers, thread_name_prefix=f"http-query:{port}"),
            "light": ThreadPoolExecutor(limits.light_workers, thread_name_prefix=f"http-light:{port}"),
        }
        self._workers = {"query": limits.query_workers, "light": limits.light_workers}
        self._running = {"query": 0, "light": 0}  # handlers running or queued, per pool (loop thread)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._done: deque[tuple[_Conn, int, str, Response]] = deque()  # handlers' answers, for the loop
        self._stopping = False
        self._conns: dict[int, _Conn] = {}
        self._per_address: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, _Conn]] = []  # a heap; entries superseded are skipped
        self._refused: deque[_Refused] = deque()  # lingering refusals, oldest first (one deadline each)
        self._seq = itertools.count()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name=f"http:{self.port}", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._wake()
            self._thread.join()
        for conn in list(self._conns.values()):
            self._close(conn)
        while self._refused:
            self._close_refused(self._refused.popleft())
        self._selector.close()
        self._listener.close()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()

    def _count(self, event: str) -> None:
        with self._stats_lock:
            self.stats[event] = self.stats.get(event, 0) + 1

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full: the loop is awake already
            pass

    # -- the loop ------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Until stop(): sleep until a socket is ready, a handler answered or a deadline came; never wait
        on one client."""
        sel = self._selector
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while not self._stopping:
            try:
                ready = sel.select(self._next_timeout())
            except InterruptedError:
                continue
            for key, _ in ready:
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_answers()
                elif isinstance(key.data, _Refused):
                    self._drain_refused(key.data)
                elif not key.data.closed:
                    self._ready(key.data)
            self._expire()

    def _next_timeout(self) -> float | None:
        while self._refused and self._refused[0].closed:
            self._refused.popleft()
        refused = self._refused[0].deadline if self._refused else None
        while self._deadlines:
            deadline, _, conn = self._deadlines[0]
            if conn.closed or conn.deadline != deadline:
                heapq.heappop(self._deadlines)  # superseded
                continue
            if refused is not None:
                deadline = min(deadline, refused)
            return max(0.0, deadline - time.monotonic())
        return max(0.0, refused - time.monotonic()) if refused is not None else None

    def _set_deadline(self, conn: _Conn, deadline: float) -> None:
        conn.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, next(self._seq), conn))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._refused and (self._refused[0].closed or self._refused[0].deadline <= now):
            self._close_refused(self._refused.popleft())
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._deadlines)
            if conn.closed or conn.deadline != deadline:
                continue
            if conn.state == _WAIT:
                self._count("over_budget")
                budget = f"{self.limits.budget_s:g} s"
                message = (
                    f"the query ran past its {budget} budget: ask for a shorter range or a narrower selector"
                )
                self._respond(conn, conn.shape(503, message))
            elif conn.state == _READ and conn.started:
                # A request begun and not finished in time: a slow client, or one trickling on purpose.
                self._count("request_timeouts")
                message = f"the request did not arrive whole within {self.limits.request_deadline_s:g} s"
                self._respond(conn, self._head_shape(conn.reader)(408, message), final=True)
            else:
                event = {_HANDSHAKE: "request_timeouts", _WRITE: "write_timeouts", _READ: "idle_closed"}
                if conn.state in event:
                    self._count(event[conn.state])
                self._close(conn)

    def _take_answers(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._done:
            conn, token, pool, resp = self._done.popleft()
            self._running[pool] -= 1
            if conn.closed or conn.token != token or conn.state != _WAIT:
                continue  # answered already (past its budget), or the client left
            self._respond(conn, resp)

    # -- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then the others get their turn
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors, or the like: said, and tried at the next wakeup
                log.warning("HTTP accept failed: %s", err)
                return
            sock.setblocking(False)
            host = str(address[0])
            if self._per_address.get(host, 0) >= self.limits.max_per_address:
                self._count("refused_per_address")
                self._refuse(sock)
            elif len(self._conns) >= self.limits.max_connections and not self._evict():
                self._count("refused_busy")
                self._refuse(sock)
            else:
                self._admit(sock, host)

    def _refuse(self, sock: socket.socket) -> None:
        """A 503 at once, without reading the request (none over TLS: the client has not shaken hands).
        The request may not have arrived yet: closing before it does would reset the connection and lose
        the answer, so the refused connection lingers (bounded) and what arrives is dropped."""
        try:
            sock.recv(_RECV)
        except OSError:
            pass
        if self._tls is not None or len(self._refused) >= _REFUSED_LINGERING:
            sock.close()
            return
        try:
            sock.send(_BUSY)
            sock.shutdown(socket.SHUT_WR)  # the answer, then the end
            refused = _Refused(sock, time.monotonic() + _LINGER_S)
            self._selector.register(sock, selectors.EVENT_READ, refused)
        except (OSError, ValueError, KeyError):
            sock.close()
            return
        self._refused.append(refused)

    def _drain_refused(self, refused: _Refused) -> None:
        """Drop what a refused client sends; close at its end (or an error)."""
        try:
            if refused.sock.recv(_RECV):  # one read a wakeup: a client that floods cannot hold the loop
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close_refused(refused)

    def _close_refused(self, refused: _Refused) -> None:
        if refused.closed:
            return
        refused.closed = True
        try:
            self._selector.unregister(refused.sock)
        except (KeyError, ValueError, OSError):
            pass
        refused.sock.close()

    def _evict(self) -> bool:
        """Close the connection that has waited longest for a request (answered and idle ones first), to
        make room."""
        waiting = [c for c in self._conns.values() if c.state in (_LINGER, _READ, _HANDSHAKE)]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: (c.state != _LINGER, c.started, c.since))
        self._count("evicted")
        self._close(victim)
        return True

    def _admit(self, sock: socket.socket, host: str) -> None:
        now = time.monotonic()
        state = _READ
        if self._tls is not None:
            try:
                sock = self._tls.http_context().wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            except (ssl.SSLError, OSError):
                sock.close()
                return
            state = _HANDSHAKE
        limits = self.limits
        reader = RequestReader(limits.max_request_line, limits.max_header_bytes, limits.max_body_bytes)
        conn = _Conn(sock, host, reader, state, now)
        self._conns[id(conn)] = conn
        self._per_address[host] = self._per_address.get(host, 0) + 1
        self._count("accepted")
        self._set_deadline(conn, now + limits.request_deadline_s)
        self._watch(conn)
        self._ready(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.token += 1
        if conn.registered:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
        try:
            conn.sock.close()
        except OSError:
            pass
        del self._conns[id(conn)]
        n = self._per_address[conn.address] - 1
        if n:
            self._per_address[conn.address] = n
        else:
            del self._per_address[conn.address]

    def _watch(self, conn: _Conn) -> None:
        """Wait for what the connection's state needs next: nothing while its handler runs (what the client
        sends meanwhile waits in the socket; a client that left is found when its answer is written)."""
        if conn.closed:
            return
        if conn.state == _WAIT:
            events = 0
        elif conn.state == _WRITE or conn.want_write:
            events = selectors.EVENT_WRITE
        else:
            events = selectors.EVENT_READ
        try:
            if not events:
                if conn.registered:
                    self._selector.unregister(conn.sock)
                    conn.registered = False
            elif conn.registered:
                self._selector.modify(conn.sock, events, conn)
            else:
                self._selector.register(conn.sock, events, conn)
                conn.registered = True
        except (KeyError, ValueError, OSError):
            self._close(conn)

    def _ready(self, conn: _Conn) -> None:
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _READ:
            self._read(conn)
        elif conn.state == _WRITE:
            self._write(conn)
        elif conn.state == _LINGER:
            alive = self._recv(conn)
            conn.reader.buffer.clear()
            if not alive:
                self._close(conn)

    def _handshake(self, conn: _Conn) -> None:
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            conn.want_write = False
            return self._watch(conn)
        except ssl.SSLWantWriteError:
            conn.want_write = True
            return self._watch(conn)
        except (ssl.SSLError, OSError) as err:  # a plaintext client, a bad certificate, a reset
            log.debug("TLS handshake with %s failed: %s", conn.address, err)
            self._count("handshake_failures")
            return self._close(conn)
        conn.want_write = False
        conn.state = _READ
        self._watch(conn)
        self._read(conn)

    def _recv(self, conn: _Conn) -> bool:
        """Read what has arrived into the connection's buffer; False when the client has gone."""
        buf = conn.reader.buffer
        cap = self.limits.max_header_bytes + self.limits.max_body_bytes + _RECV
        while len(buf) <= cap:  # past it: enough to decide on, the rest waits in the socket
            try:
                data = conn.sock.recv(_RECV)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                conn.want_write = False
                return True
            except ssl.SSLWantWriteError:
                conn.want_write = True
                return True
            except OSError:  # ssl.SSLError included
                return False
            if not data:
                return False
            buf += data
        return True

    # -- requests ---------------------------------------------------------------------------------------
    def _read(self, conn: _Conn) -> None:
        had = len(conn.reader.buffer)
        alive = self._recv(conn)
        if not conn.started and len(conn.reader.buffer) > had:
            conn.started = True  # a kept-alive connection's next request began: its deadline runs now
            self._set_deadline(conn, time.monotonic() + self.limits.request_deadline_s)
        try:
            request = conn.reader.next()
        except Refused as refused:
            self._count(refused.event)
            self._respond(conn, self._head_shape(conn.reader)(refused.status, refused.message), final=True)
            return
        if request is not None:
            return self._dispatch(conn, request)
        if not alive:
            return self._close(conn)
        if conn.reader.wants_continue() and not conn.continued and not conn.reader.buffer:
            conn.continued = True
            try:  # curl waits a second for this before it sends a body
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                pass
        self._watch(conn)

    def _shape(self, method: str, path: str) -> ErrorShape:
        """How the server's own errors answer a request: its POST route's shape, else JSON."""
        if method != "POST":
            return _json_error
        return next((shape for prefix, (_, shape) in self._post if path.startswith(prefix)), _json_error)

    def _head_shape(self, reader: RequestReader) -> ErrorShape:
        """The error shape for the request being read (JSON before its head has arrived)."""
        head = reader.head
        return _json_error if head is None else self._shape(head.method, head.target)

    def _dispatch(self, conn: _Conn, req: Request) -> None:
        """Answer at once (no token, no route, its pool full) or hand the request to its pool."""
        conn.state, conn.started, conn.continued = _WAIT, False, False
        conn.keep_alive = conn.reader.keep_alive
        conn.shape = shape = self._shape(req.method, req.path)
        self._set_deadline(conn, time.monotonic() + self.limits.budget_s)
        if not self._authorized(req):
            self.unauthorized += 1
            resp = shape(401, "this endpoint needs the API token (Authorization: Bearer)")
            resp.headers["WWW-Authenticate"] = _CHALLENGE
            return self._respond(conn, resp)
        handler = self._handler(req)
        if handler is None:
            return self._respond(conn, shape(404, f"no such endpoint: {req.method} {req.path}"))
        pool = "light" if req.path in self._light else "query"
        if self._running[pool] >= self._workers[pool] + self.limits.query_queue:
            self._count("queries_refused")
            return self._respond(conn, shape(503, "too many queries at once; retry in a moment"))
        try:
            future = self._pools[pool].submit(self._answer, req, handler, shape)
        except RuntimeError:  # stopping
            return self._close(conn)
        self._running[pool] += 1
        token = conn.token

        def done(f: Future) -> None:
            resp = shape(503, "the server is stopping") if f.cancelled() else f.result()
            self._done.append((conn, token, pool, resp))
            self._wake()

        future.add_done_callback(done)
        self._watch(conn)

    def _handler(self, req: Request) -> Handler | None:
        if req.method == "POST":
            return next((fn for prefix, (fn, _) in self._post if req.path.startswith(prefix)), None)
        handler = self._routes.get(req.path)
        if handler is None:
            handler = next((fn for prefix, fn in self._prefixes if req.path.startswith(prefix)), None)
        return handler

    def _answer(self, req: Request, handler: Handler, shape: ErrorShape) -> Response:
        """Run the handler (on its pool's thread); every failure becomes an answer."""
        try:
            resp = handler(req)
        except HttpError as err:
            return shape(err.status, err.message)
        except Exception as exc:  # a bug in a handler must not take the server down
            log.exception("handler for %s failed", req.path)
            return shape(500, f"internal error: {exc}")
        limit = self.limits.max_response_bytes
        if len(resp.body) > limit:
            self._count("too_large_answers")
            return shape(
                422,
                f"the answer is {len(resp.body)} bytes, over the {limit} an answer may have: ask for less (a "
                "narrower selector, a shorter range, a smaller limit or max_nodes)",
            )
        return resp

    def _authorized(self, req: Request) -> bool:
        if self._tokens is None or req.path in self._public:
            return True
        token = presented_token(req.headers.get("authorization", ""))
        return token is not None and self._tokens.accepts(token)

    # -- answers ----------------------------------------------------------------------------------------
    def _respond(self, conn: _Conn, resp: Response, final: bool = False) -> None:
        """Start writing `resp`; with `final` (or a client that asked to close), end the connection after."""
        if conn.closed:
            return
        conn.token += 1
        keep = conn.keep_alive and not final and not self._stopping
        lines = [
            f"HTTP/1.1 {resp.status} {_reason(resp.status)}",
            f"Content-Type: {resp.content_type}",
            f"Content-Length: {len(resp.body)}",
            "Cache-Control: no-store",
            *(f"{k}: {v}" for k, v in resp.headers.items()),
        ]
        if not keep:
            lines.append("Connection: close")
        conn.keep_alive = keep
        conn.out = memoryview(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + resp.body)
        conn.sent = 0
        conn.state = _WRITE
        self._set_deadline(conn, time.monotonic() + self.limits.write_timeout_s)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        out = conn.out
        while conn.sent < len(out):
            try:
                n = conn.sock.send(out[conn.sent : conn.sent + _SEND])
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return self._watch(conn)
            except OSError:  # the client left
                return self._close(conn)
            conn.sent += n
        conn.out = memoryview(b"")
        now = time.monotonic()
        if not conn.keep_alive:
            try:
                conn.sock.shutdown(socket.SHUT_WR)  # the answer first, then the end
            except OSError:
                return self._close(conn)
            conn.state = _LINGER
            self._set_deadline(conn, now + _LINGER_S)
            return self._watch(conn)
        # Kept alive: wait for the next request (one already buffered is taken at once).
        pending = bool(conn.reader.buffer)
        conn.state, conn.since, conn.started = _READ, now, pending
        limits = self.limits
        self._set_deadline(conn, now + (limits.request_deadline_s if pending else limits.idle_timeout_s))
        self._watch(conn)
        if pending:
            self._read(conn)


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""
