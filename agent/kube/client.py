"""The two requests the agent makes of the API server: a JSON GET and a line-delimited watch stream.

Why not the `kubernetes` PyPI client: it is tens of megabytes of generated models for every API
group, takes seconds and tens of megabytes of memory to import, and pulls in its own HTTP stack —
in a per-node agent with a 150 MB memory budget that needs exactly one list and one watch of one
resource. Those two requests over `http.client` are a page of code we can read and test.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from collections.abc import Iterator, Mapping
from urllib.parse import urlencode, urlsplit

from fleetprof.agent.kube.config import KubeConfig, KubeConfigError

log = logging.getLogger(__name__)

# A Pod object is bounded by etcd's 1.5 MiB request limit; a longer line means a broken stream.
MAX_LINE_BYTES = 8 * 1024 * 1024
_MAX_ERROR_BODY = 64 * 1024
_USER_AGENT = "fleetprof-agent"


class KubeError(Exception):
    """A request to the API server failed."""


class ApiStatusError(KubeError):
    """The API server answered with a non-2xx status; `status` is the HTTP code."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class KubeConnectionError(KubeError):
    """The connection failed or broke, or the server sent something that is not the API's JSON."""


class KubeClient:
    """GET requests to one API server with bearer-token auth; one connection per request.

    A 401 makes the client read the token file again and retry once: bound service-account
    tokens are rotated on disk, and an agent that runs for weeks outlives many of them.
    `close()` ends the request in flight from another thread, to end a blocked watch read.
    """

    def __init__(self, config: KubeConfig, connect_timeout_s: float = 10.0):
        url = urlsplit(config.server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise KubeConfigError(f"API server address {config.server!r} is not an http(s) URL")
        self._config = config
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")  # API servers behind a proxy may live under a path
        self._ssl = config.ssl_context() if self._https else None
        self._connect_timeout_s = connect_timeout_s
        self._token = config.token or config.read_token_file()
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight: http.client.HTTPConnection | None = None

    def get_json(self, path: str, params: Mapping[str, str], timeout_s: float = 30.0) -> dict:
        """GET path?params and decode the JSON object it returns."""
        conn, resp = self._open(path, params, timeout_s)
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise KubeConnectionError(f"reading {path}: {e!r}") from e
        finally:
            self._close(conn)
        return _decode(body, path)

    def watch(self, path: str, params: Mapping[str, str], read_timeout_s: float) -> WatchStream:
        """Open a watch: returns once the server has answered 2xx; iterate the result for events.

        `read_timeout_s` bounds the wait for the next line, so a peer that vanished without a FIN
        is noticed.
        """
        conn, resp = self._open(path, params, read_timeout_s)
        return WatchStream(self, conn, resp, path)

    def close(self) -> None:
        """End the request in flight, if any, and refuse new ones (safe from any thread)."""
        with self._lock:
            self._closed = True
            conn = self._in_flight
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            except OSError:
                pass

    def _open(
        self, path: str, params: Mapping[str, str], timeout_s: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        target = f"{self._prefix}{path}?{urlencode(params)}" if params else f"{self._prefix}{path}"
        retried = False
        while True:
            conn, resp = self._send(target, timeout_s)
            if resp.status == 401 and not retried and self._reread_token():
                self._close(conn)
                retried = True
                continue
            if 200 <= resp.status < 300:
                return conn, resp
            try:
                message = _status_message(resp.read(_MAX_ERROR_BODY), resp.reason)
            except (OSError, http.client.HTTPException):
                message = resp.reason
            finally:
                self._close(conn)
            raise ApiStatusError(resp.status, message)

    def _send(
        self, target: str, timeout_s: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._connect_timeout_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._connect_timeout_s)
        headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            conn.connect()
            with self._lock:
                if self._closed:
                    raise KubeConnectionError("the client is closed")
                self._in_flight = conn
            conn.sock.settimeout(timeout_s)  # connecting is bounded separately from reading
            conn.request("GET", target, headers=headers)
            return conn, conn.getresponse()
        except KubeConnectionError:
            self._close(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._close(conn)
            raise KubeConnectionError(f"GET {target}: {e!r}") from e

    def _reread_token(self) -> bool:
        """Read the token file again; True if it now holds a different token worth retrying with."""
        try:
            token = self._config.read_token_file()
        except KubeConfigError as e:
            log.warning("%s", e)
            return False
        if not token or token == self._token:
            return False
        self._token = token
        log.info("API token was rejected; retrying with the token now in %s", self._config.token_file)
        return True

    def _close(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._in_flight is conn:
                self._in_flight = None
        conn.close()


class WatchStream:
    """The events of one open watch, one JSON object per line of a chunked response.

    Iteration ends when the server ends the stream (its timeoutSeconds ran out). A stream cut in
    the middle raises KubeConnectionError; a partial last line is never yielded.
    """

    def __init__(
        self, client: KubeClient, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, what: str
    ):
        self._client = client
        self._conn = conn
        self._resp = resp
        self._what = what

    def __iter__(self) -> Iterator[dict]:
        try:
            while True:
                try:
                    line = self._resp.readline(MAX_LINE_BYTES)
                except (OSError, http.client.HTTPException, ValueError) as e:
                    raise KubeConnectionError(f"watch stream broken: {e!r}") from e
                if not line:
                    return
                if len(line) >= MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise KubeConnectionError(f"watch event longer than {MAX_LINE_BYTES} bytes")
                # The apiserver ends every event with a newline; the unterminated tail of a cut
                # stream fails to decode and raises like any other break.
                if line.strip():
                    yield _decode(line, self._what)
        finally:
            self.close()

    def close(self) -> None:
        self._client._close(self._conn)

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(body: bytes, what: str) -> dict:
    try:
        value = json.loads(body)
    except ValueError as e:
        raise KubeConnectionError(f"{what}: response is not JSON ({e})") from e
    if not isinstance(value, dict):
        raise KubeConnectionError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _status_message(body: bytes, reason: str) -> str:
    """The `message` of a metav1.Status body, else the HTTP reason phrase."""
    try:
        status = json.loads(body)
    except ValueError:
        return reason
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return reason
