"""HTTP/1.1 requests read a piece at a time: bytes as they arrive in, a whole Request out, or a Refused
that names the status. Nothing here touches a socket, so the server's loop can feed it whatever a
non-blocking read returned, and a client that trickles its request costs a buffer, not a thread.

Bounds (the server's HttpLimits): a request line of `max_request_line` bytes (414), a head of
`max_header_bytes` and 100 headers (431), a body of `max_body_bytes` by Content-Length or chunked (what
streaming clients such as Node's send). A body over the limit is read and dropped up to DRAIN times the
limit before its 413, so the answer reaches the client: closing on unread bytes resets the connection,
and the client may lose the answer with it."""

from __future__ import annotations

import http.client
import io
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

DRAIN = 16
MAX_HEADERS = 100
_CHUNK_LINE = 1024


@dataclass
class Request:
    path: str
    query: dict[str, str]  # each parameter's last value
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    method: str = "GET"
    body: bytes = b""
    multi: dict[str, list[str]] = field(default_factory=dict)  # every value of each parameter

    def param(self, name: str, default: str | None = None) -> str | None:
        """A query parameter; an empty value counts as absent."""
        v = self.query.get(name)
        return v if v not in (None, "") else default

    def params(self, name: str) -> list[str]:
        """Every non-empty value of a repeated parameter (`match[]=…&match[]=…`)."""
        return [v for v in self.multi.get(name, ()) if v]


class Refused(Exception):
    """A request answered with `status` and then the connection closed (the rest of it is unread);
    `event` is the counted reason."""

    def __init__(self, status: int, message: str, event: str):
        super().__init__(message)
        self.status, self.message, self.event = status, message, event


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    headers: dict[str, str]
    keep_alive: bool


class RequestReader:
    """One connection's requests, in order: `buffer` takes the bytes read; `next()` returns the request
    they complete (consumed from the buffer), or None until they do."""

    def __init__(self, max_request_line: int, max_header_bytes: int, max_body_bytes: int) -> None:
        self._max_line = max_request_line
        self._max_head = max_header_bytes
        self._max_body = max_body_bytes
        self.buffer = bytearray()
        self.head: Head | None = None  # the current request's, once read
        self.keep_alive = False  # whether the client keeps the connection after the last request returned
        self._body = bytearray()
        self._chunk = ""  # a chunked body's state: "size", "data", "crlf", "trailers"; "" by length
        self._remaining = 0  # body bytes (or the chunk's) still to come
        self._over = 0  # body bytes past the limit, read and dropped

    def next(self) -> Request | None:
        if self.head is None:
            self.head = self._read_head()
            if self.head is None:
                return None
        body = self._read_body()
        if body is None:
            return None
        head, self.head = self.head, None
        self.keep_alive = head.keep_alive
        parts = urlsplit(head.target)
        multi = parse_qs(parts.query, keep_blank_values=True)
        query = {k: v[-1] for k, v in multi.items()}
        return Request(unquote(parts.path), query, head.headers, head.method, body, multi)

    def wants_continue(self) -> bool:
        """The client waits for `100 Continue` before it sends its body (curl does, a second)."""
        return self.head is not None and self.head.headers.get("expect", "").lower() == "100-continue"

    def _read_head(self) -> Head | None:
        buf = self.buffer
        end, size = buf.find(b"\r\n\r\n"), 4
        if end < 0:
            end, size = buf.find(b"\n\n"), 2
        if end < 0:
            line_end = buf.find(b"\n")
            if (line_end if line_end >= 0 else len(buf)) > self._max_line:
                raise Refused(414, f"the request line is over {self._max_line} bytes", "too_long")
            if len(buf) > self._max_head:
                raise Refused(431, f"the request head is over {self._max_head} bytes", "too_long")
            return None
        if buf.find(b"\n", 0, self._max_line + 1) < 0:
            raise Refused(414, f"the request line is over {self._max_line} bytes", "too_long")
        if end + size > self._max_head:
            raise Refused(431, f"the request head is over {self._max_head} bytes", "too_long")
        raw = bytes(buf[: end + size])
        del buf[: end + size]
        return self._parse_head(raw)

    def _parse_head(self, raw: bytes) -> Head:
        line, _, rest = raw.partition(b"\n")
        words = line.decode("latin-1").rstrip("\r").split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            if len(words) == 3 and words[2].startswith("HTTP/"):
                raise Refused(
                    505, f"HTTP version {words[2][:20]!r} is not served: use HTTP/1.1", "bad_requests"
                )
            raise Refused(400, f"bad request line {line[:80]!r}", "bad_requests")
        method, target, version = words
        try:
            message = http.client.parse_headers(io.BytesIO(rest))
        except (http.client.HTTPException, ValueError) as err:
            raise Refused(431, f"bad or too many request headers: {err}", "bad_requests") from None
        if len(message) > MAX_HEADERS:
            raise Refused(431, f"more than {MAX_HEADERS} request headers", "bad_requests")
        headers = {k.lower(): v for k, v in message.items()}
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
        head = Head(method, target, headers, keep_alive)
        if method not in ("GET", "POST"):
            raise Refused(501, f"method {method[:20]!r} is not served: use GET or POST", "bad_requests")
        self._body.clear()
        self._over = 0
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunk = "size"
            return head
        self._chunk = ""
        length = headers.get("content-length")
        if length is None or not length.strip().isdigit():
            if method == "POST":
                raise Refused(411, "a POST needs a Content-Length or a chunked body", "bad_requests")
            self._remaining = 0
            return head
        self._remaining = int(length)
        if self._remaining > DRAIN * self._max_body:  # too much even to drain: refused at once
            raise self._too_big(str(self._remaining))
        return head

    def _too_big(self, length: str | None = None) -> Refused:
        tail = f", not {length}" if length else ""
        return Refused(
            413, f"a request body may have at most {self._max_body} bytes{tail}", "too_large_bodies"
        )

    def _read_body(self) -> bytes | None:
        """The body once it has arrived whole (b"" for none); None while it has not. Bytes past the limit
        are dropped as they come, then answered with a 413."""
        buf = self.buffer
        if not self._chunk:
            if self._remaining > self._max_body:  # over: read and dropped, then refused
                take = min(self._remaining, len(buf))
                del buf[:take]
                self._remaining -= take
                if self._remaining:
                    return None
                raise self._too_big()
            if len(buf) < self._remaining:
                return None
            body = bytes(buf[: self._remaining])
            del buf[: self._remaining]
            self._remaining = 0
            return body
        while True:
            if self._chunk in ("size", "trailers"):
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > _CHUNK_LINE:
                        raise Refused(400, f"bad chunk size line {bytes(buf[:40])!r}", "bad_requests")
                    return None
                line = bytes(buf[: nl + 1])
                del buf[: nl + 1]
                if self._chunk == "trailers":
                    if line.strip():
                        continue
                    self._chunk = ""
                    if self._over:
                        raise self._too_big()
                    body, self._body = bytes(self._body), bytearray()
                    return body
                digits = line.split(b";")[0].strip()
                if not digits or digits.strip(b"0123456789abcdefABCDEF"):
                    raise Refused(400, f"bad chunk size line {line[:40]!r}", "bad_requests")
                size = int(digits, 16)
                if size == 0:
                    self._chunk = "trailers"
                    continue
                self._remaining, self._chunk = size, "data"
            if self._chunk == "data":
                take = min(self._remaining, len(buf))
                if self._over or len(self._body) + self._remaining > self._max_body:
                    self._over += take
                    if self._over > DRAIN * self._max_body:
                        raise self._too_big()
                else:
                    self._body += buf[:take]
                del buf[:take]
                self._remaining -= take
                if self._remaining:
                    return None
                self._chunk = "crlf"
            if self._chunk == "crlf":
                if buf[:1] == b"\n":
                    del buf[:1]
                elif len(buf) < 2:
                    return None
                elif buf[:2] == b"\r\n":
                    del buf[:2]
                else:
                    raise Refused(400, "a chunk does not end with CRLF", "bad_requests")
                self._chunk = "size"
