"""A debuginfod client: separate debug files fetched by build id from the servers the operator names
($DEBUGINFOD_URLS or --debuginfod-url), kept in a bounded on-disk cache, fetched on a thread of its own.

Why the agent asks, and not the collector (peers such as Parca symbolize centrally):
  * the agent holds what a lookup needs, the file's build id; the wire carries frame names, not addresses
    and build ids, so symbolizing at the collector would change the wire's contract and make the store
    keep addresses;
  * the chart's NetworkPolicy leaves the agent's egress open (it reaches the collector and the API
    server) and gives the collector none but ClickHouse's;
  * a node keeps the debug files of what runs on it only. The price: each node fetches its own copy (a
    debuginfod in the cluster, federating the distributions' servers, answers them from its own cache).

Rules this file keeps (an answer is hostile input, as a tenant's file is):
  * nothing waits on the network but the fetch thread: the symbolizer queues build ids (at most
    MAX_QUEUED; more are dropped, counted, and asked for again later) and is called back on an arrival;
  * one attempt at one server (its redirects included, at most MAX_REDIRECTS) takes at most `timeout_s`
    from its connect to the last byte, however slowly the bytes come:
    a watchdog shuts the socket at the deadline. A server that says nothing is left after
    `connect_timeout_s` (each read's timeout);
  * one answer holds at most `max_answer_bytes`: refused on its Content-Length before the body is read,
    or as soon as the body passes the cap;
  * an answer is kept only if it is an ELF file (elf.py reads it, with its caps) with the build id asked
    for and a .symtab;
  * the cache holds at most `max_cache_bytes` of debug files, least recently used out first;
  * a build id no server gave (not found, or a bad answer) is not asked for again for `negative_ttl_s`:
    the mark is a file in the cache, so an agent restarted meanwhile does not ask either;
  * every attempt's outcome is counted (OUTCOMES), and so is every lookup (LOOKUPS).
"""

from __future__ import annotations

import http.client
import logging
import os
import queue
import re
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetprof import __version__
from fleetprof.agent.process.rootfs import open_file
from fleetprof.agent.symbols.elf import ElfError, ElfFile, has_symtab

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "/var/cache/fleetprof/debuginfod"
DEFAULT_CACHE_BYTES = 1 << 30
# A debug file with full DWARF is tens to hundreds of MiB; the agent reads only its .symtab.
DEFAULT_MAX_ANSWER_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = 60.0  # a server may unpack a distribution's package before its first answer
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# What elfutils' own client waits before asking again about a build id a server did not have
# (its cache_miss_s).
DEFAULT_NEGATIVE_TTL_S = 600.0
MAX_REDIRECTS = 3  # per server and build id
_REDIRECTS = (301, 302, 303, 307, 308)
MAX_QUEUED = 4096  # build ids waiting: a node maps a few thousand distinct files at most
_READ_STEP = 1 << 20

# The outcome of one attempt at one server.
OK = "ok"
NOT_FOUND = "not_found"  # the server answered 404
TOO_LARGE = "too_large"  # over max_answer_bytes (declared or sent)
TIMEOUT = "timeout"  # past timeout_s, or silent for connect_timeout_s
WRONG_BUILD_ID = "wrong_build_id"  # an ELF file of another build
NOT_ELF = "not_elf"  # not an ELF file elf.py reads
NO_SYMBOLS = "no_symbols"  # the right build's file, without a .symtab
ERROR = "error"  # refused connection, another HTTP status, a cut-short body, an encoding we did not ask for
OUTCOMES = (OK, NOT_FOUND, TOO_LARGE, TIMEOUT, WRONG_BUILD_ID, NOT_ELF, NO_SYMBOLS, ERROR)
# What became of a lookup: found in the cache, known missing (within its TTL), queued for the fetch
# thread, or dropped (the queue was full).
CACHE_HIT = "cache_hit"
KNOWN_MISSING = "known_missing"
QUEUED = "queued"
DROPPED = "dropped"
LOOKUPS = (CACHE_HIT, KNOWN_MISSING, QUEUED, DROPPED)

_BUILD_ID = re.compile(r"[0-9a-f]{8,128}")
_TEMP_PREFIX = ".part-"
_DEBUG_SUFFIX = ".debug"
_MISSING_SUFFIX = ".missing"


def parse_urls(text: str) -> tuple[str, ...]:
    """The servers of a $DEBUGINFOD_URLS-style list (separated by spaces); ValueError names a bad one."""
    urls = tuple(text.split())
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"debuginfod server {url!r}: expected http://HOST[:PORT][/PATH] or https://...")
        try:
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as err:
            raise ValueError(f"debuginfod server {url!r}: {err}") from None
    return urls


@dataclass(frozen=True)
class DebuginfodConfig:
    urls: tuple[str, ...]
    cache_dir: str = DEFAULT_CACHE_DIR
    max_cache_bytes: int = DEFAULT_CACHE_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("debuginfod needs at least one server URL")
        if self.max_cache_bytes < 1 or self.max_answer_bytes < 1 or self.timeout_s <= 0:
            raise ValueError("debuginfod cache size, answer cap and timeout must be positive")
        if self.max_answer_bytes > self.max_cache_bytes:
            # A kept answer would push every other file out, then the cache over its bound.
            raise ValueError("a debuginfod answer may not be larger than the whole cache")


class DebugFileCache:
    """Debug files by build id in one directory (BUILD_ID.debug), with marks for build ids no server had
    (BUILD_ID.missing, holding the time the mark expires) and downloads in progress (.part-*). Files are
    used least-recently-first out: a hit touches the file's mtime, eviction goes by mtime. Each touch sets
    a time later than the last one this cache set: a filesystem's clock ticks coarsely (ext4 by the jiffy),
    and two uses in one tick must still be told apart."""

    def __init__(
        self, directory: str, max_bytes: int, negative_ttl_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"the debuginfod cache {directory}: {e.strerror}") from None
        self.directory = directory
        self._max_bytes = max_bytes
        self._negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._bytes = 0
        self._last_touch_ns = 0
        for entry in os.scandir(directory):
            if entry.name.startswith(_TEMP_PREFIX):  # a download an earlier agent did not finish
                _unlink(entry.path)
        self._evict(keep=None)

    def _path(self, build_id: str, suffix: str) -> str:
        return os.path.join(self.directory, build_id + suffix)

    def get(self, build_id: str) -> str | None:
        """The cached debug file's path, or None; a hit counts as a use (it moves to the back of the line)."""
        path = self._path(build_id, _DEBUG_SUFFIX)
        try:
            self._touch(path)
        except FileNotFoundError:
            return None
        return path

    def _touch(self, path: str) -> None:
        with self._lock:
            # A microsecond apart: every filesystem we run on keeps at least that.
            now = max(int(self._clock() * 1e9), self._last_touch_ns + 1000)
            self._last_touch_ns = now
        os.utime(path, ns=(now, now))

    def missing(self, build_id: str) -> bool:
        """Whether a mark says no server had the build id, and it has not expired."""
        path = self._path(build_id, _MISSING_SUFFIX)
        try:
            with open(path, "rb") as f:
                expires = float(f.read(64) or 0)
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            expires = 0.0
        if self._clock() < expires:
            return True
        _unlink(path)
        return False

    def mark_missing(self, build_id: str) -> None:
        path = self._path(build_id, _MISSING_SUFFIX)
        with open(path, "w") as f:
            f.write(repr(self._clock() + self._negative_ttl_s))

    def new_part(self) -> tuple[int, str]:
        """A new file for a download in progress: (its descriptor, its path)."""
        return tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.directory)

    def put(self, build_id: str, part: str) -> str:
        """Keep a checked download as the build id's debug file; older files go while over the cap."""
        path = self._path(build_id, _DEBUG_SUFFIX)
        os.replace(part, path)
        self._touch(path)
        _unlink(self._path(build_id, _MISSING_SUFFIX))
        self._evict(keep=path)
        return path

    @property
    def nbytes(self) -> int:
        """Bytes of debug files in the cache, as of the last insertion."""
        return self._bytes

    def _evict(self, keep: str | None) -> None:
        with self._lock:
            files = []
            for entry in os.scandir(self.directory):
                if entry.name.endswith(_DEBUG_SUFFIX) and entry.is_file(follow_symlinks=False):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime_ns, entry.path, st.st_size))
            total = sum(size for _m, _p, size in files)
            for _mtime, path, size in sorted(files):
                if total <= self._max_bytes:
                    break
                if path != keep:
                    _unlink(path)
                    total -= size
            self._bytes = total


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shut(sock: socket.socket) -> None:
    """The watchdog: end whatever read or write the fetch thread is blocked in (it sees end of file)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class DebuginfodClient:
    """Blocking fetches from the configured servers in turn, through a DebugFileCache (the fetch thread's)."""

    def __init__(
        self, config: DebuginfodConfig, cache: DebugFileCache, count: Callable[[str], None] | None = None
    ) -> None:
        self._config = config
        self._cache = cache
        self._count = count or (lambda outcome: None)
        # abort(): the socket of the attempt in progress is shut, and no further server is asked.
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def abort(self) -> None:
        """End the fetch in progress now (from another thread), and every later one at once: an agent
        that stops does not wait out a slow server's timeout."""
        self._aborted.set()
        with self._lock:
            if self._sock is not None:
                _shut(self._sock)

    def fetch(self, build_id: str) -> str | None:
        """The path of the build id's debug file, from the cache or the first server that has a good one;
        None (and a mark that keeps it from being asked again for a while) when none has."""
        if not _BUILD_ID.fullmatch(build_id):
            raise ValueError(f"not a build id: {build_id!r}")
        cached = self._cache.get(build_id)
        if cached is not None:
            return cached
        for url in self._config.urls:
            if self._aborted.is_set():
                return None  # not marked missing: no server said so
            outcome, path = self._attempt(url, build_id)
            if self._aborted.is_set():
                return None  # cut by abort(): whatever the attempt saw says nothing of the server
            self._count(outcome)
            if path is not None:
                return path
            if outcome != NOT_FOUND:
                log.info("debuginfod %s: no debug file for %s (%s)", url, build_id, outcome)
        self._cache.mark_missing(build_id)
        return None

    def _attempt(self, url: str, build_id: str) -> tuple[str, str | None]:
        """One server's answer for the build id, following up to MAX_REDIRECTS redirects (as elfutils'
        client does: a server may send its clients to a mirror), all within one timeout_s."""
        parts = urllib.parse.urlsplit(url)
        target = urllib.parse.urlunsplit(
            (parts.scheme, parts.netloc, f"{parts.path.rstrip('/')}/buildid/{build_id}/debuginfo", "", "")
        )
        deadline = time.monotonic() + self._config.timeout_s
        for _hop in range(MAX_REDIRECTS + 1):
            outcome, path, location = self._get(target, build_id, deadline)
            if location is None:
                return outcome, path
            target = urllib.parse.urljoin(target, location)
            if urllib.parse.urlsplit(target).scheme not in ("http", "https") or self._aborted.is_set():
                return ERROR, None
        return ERROR, None  # a redirect loop, or a chain longer than any real mirror's

    def _get(self, url: str, build_id: str, deadline: float) -> tuple[str, str | None, str | None]:
        """GET `url`: (outcome, the kept file's path, None), or (ERROR, None, where a redirect points)."""
        cfg = self._config
        parts = urllib.parse.urlsplit(url)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        timeout = max(0.001, min(cfg.connect_timeout_s, deadline - time.monotonic()))
        try:
            if parts.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    parts.hostname or "", parts.port, timeout=timeout, context=ssl.create_default_context()
                )
            else:
                conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        except ValueError:  # a redirect to a port out of range
            return ERROR, None, None
        watchdog: threading.Timer | None = None
        part: str | None = None
        try:
            conn.connect()
            assert conn.sock is not None
            with self._lock:
                self._sock = conn.sock
            if self._aborted.is_set():
                return ERROR, None, None
            # The socket itself, not conn.sock: the connection hands it to the response and forgets it.
            watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn.sock,))
            watchdog.daemon = True
            watchdog.start()
            conn.request(
                "GET",
                target,
                headers={"User-Agent": f"fleetprof-agent/{__version__}", "Accept-Encoding": "identity"},
            )
            response = conn.getresponse()
            if response.status == 404:
                return NOT_FOUND, None, None
            if response.status in _REDIRECTS and response.getheader("Location"):
                return ERROR, None, response.getheader("Location")
            if response.status != 200:
                return ERROR, None, None
            if (response.getheader("Content-Encoding") or "identity").lower() != "identity":
                return ERROR, None, None
            declared = response.length
            if declared is not None and declared > cfg.max_answer_bytes:
                return TOO_LARGE, None, None
            fd, part = self._cache.new_part()
            with os.fdopen(fd, "wb") as out:
                got = 0
                while chunk := response.read1(min(_READ_STEP, cfg.max_answer_bytes + 1 - got)):
                    got += len(chunk)
                    if got > cfg.max_answer_bytes:
                        return TOO_LARGE, None, None
                    out.write(chunk)
            if time.monotonic() >= deadline:
                return TIMEOUT, None, None  # the watchdog cut it: what came is a short body
            if declared is not None and got != declared:
                return ERROR, None, None
            outcome = _checked(part, build_id)
            if outcome != OK:
                return outcome, None, None
            path, part = self._cache.put(build_id, part), None
            return OK, path, None
        except TimeoutError:
            return TIMEOUT, None, None
        except (OSError, http.client.HTTPException, ValueError):
            return (TIMEOUT if time.monotonic() >= deadline else ERROR), None, None
        finally:
            with self._lock:
                self._sock = None
            if watchdog is not None:
                watchdog.cancel()
            conn.close()
            if part is not None:
                _unlink(part)


def _checked(path: str, build_id: str) -> str:
    """OK if the file at `path` is an ELF file of `build_id` with a .symtab, else why not."""
    try:
        with ElfFile(open_file(path)) as elf:
            if elf.build_id != build_id:
                return WRONG_BUILD_ID
            return OK if has_symtab(elf) else NO_SYMBOLS
    except (ElfError, OSError):
        return NOT_ELF


Arrival = Callable[[str, str], None]
"""Called on the fetch thread with (build id, path of its debug file) when one arrived."""


class Debuginfod:
    """The symbolizer's face of debuginfod: `cached()` (no network) and `request()` (queued); `start()` and
    `stop()` own the fetch thread. Also a Prometheus collector of its counts."""

    def __init__(self, config: DebuginfodConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.cache = DebugFileCache(config.cache_dir, config.max_cache_bytes, config.negative_ttl_s, clock)
        self._client = DebuginfodClient(config, self.cache, self._add)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOMES + LOOKUPS, 0)
        self._pending: set[str] = set()
        self._queue: queue.SimpleQueue[tuple[str, Arrival] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _add(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def cached(self, build_id: str) -> str | None:
        """The build id's debug file if the cache has it (no network)."""
        if not _BUILD_ID.fullmatch(build_id):
            return None
        path = self.cache.get(build_id)
        if path is not None:
            self._add(CACHE_HIT)
        return path

    def request(self, build_id: str, on_arrival: Arrival) -> None:
        """Ask the servers for the build id's debug file on the fetch thread, unless it is asked for already
        or known missing; `on_arrival` is called if one comes."""
        if not _BUILD_ID.fullmatch(build_id):
            return
        if self.cache.missing(build_id):
            self._add(KNOWN_MISSING)
            return
        with self._lock:
            if build_id in self._pending:
                return
            if len(self._pending) >= MAX_QUEUED:
                self._counts[DROPPED] += 1
                return
            self._pending.add(build_id)
            self._counts[QUEUED] += 1
        self._queue.put((build_id, on_arrival))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="debuginfod", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop now: the fetch in progress is cut (its build id is asked for again by the next agent); one
        still connecting takes up to connect_timeout_s."""
        if self._thread is not None:
            self._client.abort()
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            build_id, on_arrival = item
            try:
                path = self._client.fetch(build_id)
                if path is not None:
                    on_arrival(build_id, path)
            except Exception:  # one bad answer or a full disk must not end the fetching
                log.exception("debuginfod: fetching the debug file of %s failed", build_id)
            finally:
                with self._lock:
                    self._pending.discard(build_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
        out["cache_bytes"] = self.cache.nbytes
        return out

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        attempts = CounterMetricFamily(
            "fleetprof_agent_debuginfod_requests",
            "Requests to debuginfod servers, by outcome (agent/symbols/debuginfod.py OUTCOMES)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            attempts.add_metric([outcome], stats[outcome])
        yield attempts
        lookups = CounterMetricFamily(
            "fleetprof_agent_debuginfod_lookups",
            "Debug files looked up by build id: found in the cache, known missing, queued or dropped",
            labels=["result"],
        )
        for result in LOOKUPS:
            lookups.add_metric([result], stats[result])
        yield lookups
        yield GaugeMetricFamily(
            "fleetprof_agent_debuginfod_cache_bytes",
            "Bytes of debug files in the cache",
            value=stats["cache_bytes"],
        )
