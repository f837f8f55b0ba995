"""Keeps a PodCache in step with the API server: list this node's pods, then watch them, forever."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetprof.agent.kube.client import ApiStatusError, KubeClient, KubeConnectionError
from fleetprof.agent.kube.config import KubeConfig
from fleetprof.agent.kube.pods import PodCache

log = logging.getLogger(__name__)

PODS_PATH = "/api/v1/pods"
# The watch socket waits this much longer than timeoutSeconds before it calls the peer dead.
_READ_SLACK_S = 30.0


@dataclass
class WatcherStats:
    """Counters for self-metrics; written by the watcher thread only."""

    lists: int = 0  # complete list requests (all pages), the first included
    relists: int = 0  # lists after the first: the watch's resourceVersion had expired
    watch_restarts: int = 0  # watch requests after the first
    errors: int = 0  # failed requests, ERROR events other than 410, unparsable pods
    events: int = 0  # ADDED, MODIFIED and DELETED events applied
    bookmarks: int = 0


class _Gone(Exception):
    """The resourceVersion we watch from is older than the API server keeps: list again."""


class _WatchErrorEvent(Exception):
    """The server ended a watch with an ERROR event other than 410."""


class PodWatcher:
    """List-then-watch of the pods on one node, on a daemon thread, never giving up.

    - The list (`fieldSelector=spec.nodeName=<node>`, paged by `limit`) replaces the cache content
      and gives the resourceVersion to watch from; `synced()` turns true after the first one.
    - The watch applies events and follows every resourceVersion it sees, bookmarks included, so a
      watch that ends (the server's timeoutSeconds) or drops is resumed where it stopped, without a
      list, after `backoff[0]`.
    - 410 Gone (an ERROR event or the watch request's status) means that resourceVersion is no
      longer kept: list again at once.
    - Anything else that fails backs off exponentially from backoff[0] to backoff[1], with jitter
      so that a fleet of agents does not return to a recovering API server in step.
    Connection trouble is logged when it starts, when its kind changes and when it ends, not per retry.
    """

    def __init__(
        self,
        config: KubeConfig,
        node_name: str,
        cache: PodCache,
        backoff: tuple[float, float] = (0.5, 30.0),
        timeout_s: int = 300,
        *,
        page_limit: int = 500,
        jitter: Callable[[], float] = random.random,
    ):
        if not node_name:
            raise ValueError("the node name is empty (set it from the downward API: spec.nodeName)")
        self._client = KubeClient(config)
        self._node = node_name
        self._cache = cache
        self._backoff = backoff
        self._timeout_s = timeout_s
        self._page_limit = page_limit
        self._jitter = jitter
        self._selector = f"spec.nodeName={node_name}"
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._rv: str | None = None  # None: a list is needed before the next watch
        self._failures = 0
        self._problem: str | None = None  # the kind of trouble last logged, None while healthy
        self._watched = False
        self.stats = WatcherStats()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("PodWatcher already started")
        self._thread = threading.Thread(target=self._run, name="pod-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._client.close()  # unblocks a watch read
        if self._thread is not None:
            self._thread.join(timeout_s)

    def synced(self) -> bool:
        """True once the first list has filled the cache."""
        return self._synced.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            delay = self._backoff[0]
            try:
                if self._rv is None:
                    self._list()
                self._watch()
            except _Gone as e:
                log.debug("pod watch: %s; listing again", e)
                self._rv = None
                delay = 0.0
            except ApiStatusError as e:
                if e.status == 410 and self._rv is not None:
                    log.debug("pod watch: %s; listing again", e)
                    self._rv = None
                    delay = 0.0
                else:
                    delay = self._failed(f"HTTP {e.status}", f"{e}{_hint(e.status)}")
            except (KubeConnectionError, _WatchErrorEvent) as e:
                delay = self._failed(type(e).__name__, str(e))
            except Exception as e:  # a bug must not end pod metadata for the agent's lifetime
                log.exception("pod watcher: unexpected error")
                delay = self._failed(type(e).__name__, repr(e), logged=True)
            if self._stop.is_set():
                break
            if delay > 0:
                self._stop.wait(delay)

    def _list(self) -> None:
        items: list[Any] = []
        params = {"fieldSelector": self._selector, "limit": str(self._page_limit)}
        while True:
            page = self._client.get_json(PODS_PATH, params)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params = {**params, "continue": meta["continue"]}
        rv = meta.get("resourceVersion")
        if not rv:
            raise KubeConnectionError("the pod list has no metadata.resourceVersion")
        self._cache.replace_all(items)
        self.stats.lists += 1
        if self._synced.is_set():
            self.stats.relists += 1
        else:
            log.info("pod metadata: %d pods on node %s", len(items), self._node)
            self._synced.set()
        self._rv = rv
        self._recovered()

    def _watch(self) -> None:
        params = {
            "fieldSelector": self._selector,
            "watch": "true",
            "resourceVersion": self._rv or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._timeout_s),
        }
        if self._watched:
            self.stats.watch_restarts += 1
        self._watched = True
        stream = self._client.watch(PODS_PATH, params, self._timeout_s + _READ_SLACK_S)
        with stream:
            try:
                for event in stream:
                    self._handle(event)
                    self._recovered()
                self._recovered()
            except KubeConnectionError as e:
                # The watch was established; resuming from the last resourceVersion loses nothing.
                if not self._stop.is_set():
                    log.debug("pod watch dropped (%s); resuming at resourceVersion %s", e, self._rv)

    def _handle(self, event: dict) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            try:
                self._cache.apply(kind, obj)
            except (AttributeError, TypeError, ValueError) as e:
                self.stats.errors += 1
                log.warning("pod watch: skipped a %s event with a malformed pod: %r", kind, e)
            else:
                self.stats.events += 1
        elif kind == "BOOKMARK":
            self.stats.bookmarks += 1
        elif kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == 410:
                raise _Gone(message or "resource version expired")
            raise _WatchErrorEvent(f"watch ERROR event (code {code}): {message}")
        else:
            log.debug("pod watch: ignored an event of type %r", kind)
            return
        rv = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
        if rv:
            self._rv = rv

    def _failed(self, kind: str, message: str, logged: bool = False) -> float:
        if self._stop.is_set():
            return 0.0  # stop() broke the request; nothing failed
        self.stats.errors += 1
        self._failures += 1
        if not logged and kind != self._problem:
            log.warning("pod metadata: %s; retrying with backoff", message)
        elif not logged:
            log.debug("pod metadata: still failing: %s", message)
        self._problem = kind
        base, cap = self._backoff
        delay = min(cap, base * 2 ** min(self._failures - 1, 30))
        return delay * (0.5 + 0.5 * self._jitter())

    def _recovered(self) -> None:
        if self._problem is not None:
            log.info("pod metadata: API server reachable again after %d failures", self._failures)
        self._problem = None
        self._failures = 0


def _hint(status: int) -> str:
    if status == 401:
        return " (the API token was rejected)"
    if status == 403:
        return " (the agent's service account needs get, list and watch on pods)"
    return ""
