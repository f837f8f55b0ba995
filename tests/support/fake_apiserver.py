"""A real HTTP(S) server on 127.0.0.1 that answers the agent's two pod requests as the API server does.

It serves `GET /api/v1/pods` as a PodList (fieldSelector spec.nodeName, limit/continue paging) and,
with `watch=true`, a chunked stream of watch events that the test scripts: `push(event)`,
`end_watch()` (the server's timeoutSeconds ran out), `drop_watch()` (the connection breaks in the
middle of an event). Every request is recorded. Nothing else of the API is here.
"""

from __future__ import annotations

import json
import queue
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# ---------------------------------------------------------------- API objects in their real JSON shape


def container_id(seed: int) -> str:
    return f"{seed:064x}"


def make_pod(
    name: str,
    uid: str,
    node: str = "node-a",
    namespace: str = "default",
    resource_version: str = "100",
    labels: dict[str, str] | None = None,
    owner: tuple[str, str] | None = None,
    containers: dict[str, str] | None = None,
    init_containers: dict[str, str] | None = None,
    previous: dict[str, str] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    """A Pod as the API server returns it.

    containers and init_containers: name -> 64-hex id; previous: name -> the id before a restart.
    """
    containers = containers or {}
    init_containers = init_containers or {}
    previous = previous or {}
    owner_refs = []
    if owner:
        kind, owner_name = owner
        api = {"Job": "batch/v1", "Node": "v1"}.get(kind, "apps/v1")
        owner_refs.append(
            {
                "apiVersion": api,
                "kind": kind,
                "name": owner_name,
                "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{kind}/{owner_name}")),
                "controller": True,
                "blockOwnerDeletion": True,
            }
        )

    def status_of(cname: str, cid: str, init: bool) -> dict[str, Any]:
        state: dict[str, Any] = (
            {"terminated": {"exitCode": 0, "reason": "Completed", "containerID": f"containerd://{cid}"}}
            if init
            else {"running": {"startedAt": "2024-05-01T10:00:00Z"}}
        )
        last: dict[str, Any] = {}
        if cname in previous:
            last = {
                "terminated": {
                    "exitCode": 137,
                    "reason": "OOMKilled",
                    "containerID": f"containerd://{previous[cname]}",
                }
            }
        return {
            "name": cname,
            "state": state,
            "lastState": last,
            "ready": not init,
            "restartCount": 1 if cname in previous else 0,
            "image": f"registry.example.com/{cname}:1.0",
            "imageID": f"registry.example.com/{cname}@sha256:{'ab' * 32}",
            "containerID": f"containerd://{cid}",
            "started": not init,
        }

    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "generateName": name.rsplit("-", 1)[0] + "-",
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": resource_version,
            "creationTimestamp": "2024-05-01T09:59:58Z",
            "labels": labels or {},
            "ownerReferences": owner_refs,
        },
        "spec": {
            "nodeName": node,
            "initContainers": [
                {"name": n, "image": f"registry.example.com/{n}:1.0"} for n in init_containers
            ],
            "containers": [{"name": n, "image": f"registry.example.com/{n}:1.0"} for n in containers],
            "restartPolicy": "Always",
            "serviceAccountName": "default",
        },
        "status": {
            "phase": phase,
            "hostIP": "10.0.0.7",
            "podIP": "10.244.1.23",
            "startTime": "2024-05-01T09:59:58Z",
            "initContainerStatuses": [status_of(n, c, True) for n, c in init_containers.items()],
            "containerStatuses": [status_of(n, c, False) for n, c in containers.items()],
        },
    }


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def bookmark(resource_version: str) -> dict[str, Any]:
    return event(
        "BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": resource_version}}
    )


def expired(old: str, current: str) -> dict[str, Any]:
    return event("ERROR", status_object(410, "Expired", f"too old resource version: {old} ({current})"))


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    path: str
    query: str  # raw, still percent-encoded
    params: dict[str, str]
    headers: dict[str, str]

    @property
    def is_watch(self) -> bool:
        return self.params.get("watch") == "true"


_END = object()
_DROP = object()


class FakeApiServer:
    def __init__(
        self,
        pods: Iterable[dict[str, Any]] = (),
        resource_version: str = "100",
        page_size: int | None = None,
        accept_tokens: Iterable[str] | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self._lock = threading.Lock()
        self._pods = list(pods)
        self._rv = resource_version
        self._page_size = page_size
        self._accept = set(accept_tokens) if accept_tokens is not None else None
        self._next_watch_status: list[tuple[int, str, str]] = []
        self._actions: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self.requests: list[Seen] = []
        self.on_unauthorized: Callable[[], None] | None = None
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        scheme = "http"
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    # ---- what the test scripts
    def set_pods(self, pods: Iterable[dict[str, Any]], resource_version: str) -> None:
        """Change the state a list returns (without telling any watch)."""
        with self._lock:
            self._pods = list(pods)
            self._rv = resource_version

    def push(self, *events: dict[str, Any]) -> None:
        """Send events on the current watch (or the next one, if none is open)."""
        for e in events:
            self._actions.put(e)

    def end_watch(self) -> None:
        """End the watch cleanly, as the API server does when timeoutSeconds runs out."""
        self._actions.put(_END)

    def drop_watch(self) -> None:
        """Break the watch connection in the middle of an event (no terminating chunk)."""
        self._actions.put(_DROP)

    def fail_next_watch(self, code: int, reason: str, message: str) -> None:
        """Answer the next watch request with this status instead of a stream."""
        with self._lock:
            self._next_watch_status.append((code, reason, message))

    # ---- what the test inspects
    def lists(self) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if not r.is_watch]

    def watches(self) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.is_watch]


def _handler_for(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # the stdlib's name
            pass

        def do_GET(self) -> None:  # the stdlib's name
            url = urlsplit(self.path)
            seen = Seen(url.path, url.query, dict(parse_qsl(url.query)), dict(self.headers.items()))
            with server._lock:
                server.requests.append(seen)
            self.close_connection = True
            if url.path != "/api/v1/pods":
                self._json(404, status_object(404, "NotFound", f"the server could not find {url.path}"))
                return
            token = seen.headers.get("Authorization", "").removeprefix("Bearer ")
            if server._accept is not None and token not in server._accept:
                if server.on_unauthorized:
                    server.on_unauthorized()
                self._json(401, status_object(401, "Unauthorized", "Unauthorized"))
                return
            if seen.is_watch:
                self._watch()
            else:
                self._list(seen.params)

        def _list(self, params: dict[str, str]) -> None:
            node = params.get("fieldSelector", "").removeprefix("spec.nodeName=")
            with server._lock:
                pods = [p for p in server._pods if p["spec"]["nodeName"] == node]
                rv = server._rv
            start = int(params.get("continue") or 0)
            size = int(params.get("limit") or len(pods) or 1)
            if server._page_size:
                size = min(size, server._page_size)
            page = pods[start : start + size]
            meta: dict[str, Any] = {"resourceVersion": rv}
            if start + size < len(pods):
                meta["continue"] = str(start + size)
                meta["remainingItemCount"] = len(pods) - start - size
            self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

        def _watch(self) -> None:
            with server._lock:
                failure = server._next_watch_status.pop(0) if server._next_watch_status else None
            if failure:
                self._json(failure[0], status_object(*failure))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            try:
                while not server._closing.is_set():
                    try:
                        action = server._actions.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if action is _END:
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    if action is _DROP:
                        line = json.dumps(bookmark("999999")).encode() + b"\n"
                        self.wfile.write(b"%x\r\n" % len(line) + line[: len(line) // 2])
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    # Two chunks per event: a reader must join lines across chunk boundaries.
                    line = json.dumps(action).encode() + b"\n"
                    half = len(line) // 2
                    for part in (line[:half], line[half:]):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
            except OSError:
                return

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
