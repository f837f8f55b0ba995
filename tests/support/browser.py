"""Headless Chromium driven over the DevTools protocol on a pipe (stdlib only), for end-to-end UI tests.

Chromium's --remote-debugging-pipe reads commands from fd 3 and writes replies and events to fd 4, each
message one JSON object ending in a NUL byte. That needs no WebSocket client and no chromedriver, and
binds no port.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# How long a reply or an awaited event may take before the browser is taken for hung. A guard against a
# hang, not a measure of speed: a busy machine (the image build and the qemu guest beside the parallel
# phase) kept Chromium from answering its first call within 10 s in CI, so it is generous.
DEFAULT_TIMEOUT_S = 90.0

# A quiet, self-contained browser: no GPU, no network of its own (updates, sync, QUIC probes), and a
# fresh profile per launch so no state leaks between runs.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--mute-audio",
    "--remote-debugging-pipe",
    "--window-size=1280,900",
)


def _lift_fd(fd: int) -> int:
    """The same pipe end moved to a descriptor of 10 or more, clear of the 3 and 4 the browser needs."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class BrowserError(RuntimeError):
    """The browser failed, answered a command with an error, or a page did not reach the state waited for."""


class Chromium:
    """One browser process; open pages with new_page(). Use as a context manager so it always stops."""

    def __init__(self, binary: str = CHROMIUM, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._profile = tempfile.mkdtemp(prefix="fleetprof-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Lifted clear of 3 and 4 so moving them onto fds 3 and 4 cannot clobber one with the other.
        to_browser_r, from_browser_w = _lift_fd(to_browser_r), _lift_fd(from_browser_w)
        # The browser wants the pipe on fds 3 and 4 exactly; bash (dash takes one-digit fds only) moves
        # them there, which avoids a preexec_fn, unsafe in a process that already runs gRPC threads.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        args = [*FLAGS, f"--user-data-dir={self._profile}", "about:blank"]
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                ["/bin/bash", "-c", script, binary, *args],
                pass_fds=(to_browser_r, from_browser_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,  # its own process group, so every helper process can be stopped
            )
        finally:
            os.close(to_browser_r)
            os.close(from_browser_w)
        self._lock = threading.Condition()
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="chromium-devtools", daemon=True)
        self._reader.start()
        try:
            self.call("Browser.getVersion")  # proves the pipe works before any test relies on it
        except BrowserError:
            self.close()
            raise

    # -- protocol ------------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._lock:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result; raises BrowserError on a protocol error."""
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        except OSError as err:
            raise BrowserError(f"{method}: browser pipe closed ({err}){self._stderr_tail()}") from err
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    why = "browser exited" if self._closed else f"no reply in {self.timeout_s} s"
                    raise BrowserError(f"{method}: {why}{self._stderr_tail()}")
                self._lock.wait(left)
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}")
        return reply.get("result", {})

    def events(self, session: str, start: int = 0) -> tuple[list[dict], int]:
        """Events for one page session from index `start` of the whole event log, and the log's length."""
        with self._lock:
            end = len(self._events)
            return [e for e in self._events[start:end] if e.get("sessionId") == session], end

    def wait_event(self, session: str, method: str, start: int) -> dict:
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while True:
                for event in self._events[start:]:
                    if event.get("sessionId") == session and event.get("method") == method:
                        return event
                start = len(self._events)
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise BrowserError(f"no {method} event within {self.timeout_s} s")
                self._lock.wait(left)

    def wait_event_any(self, session: str, methods: tuple[str, ...], start: int) -> dict:
        """The first event at or after index `start` of the log for `session` with one of `methods`, with
        its index as "_index"; waits without a deadline until one comes or the browser closes."""
        with self._lock:
            while True:
                for i in range(start, len(self._events)):
                    event = self._events[i]
                    if event.get("sessionId") == session and event.get("method") in methods:
                        return {**event, "_index": i}
                start = len(self._events)
                if self._closed:
                    raise BrowserError("browser closed")
                self._lock.wait(1.0)

    def event_count(self) -> int:
        with self._lock:
            return len(self._events)

    def _stderr_tail(self) -> str:
        try:
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"\nchromium stderr:\n{tail}" if tail else ""

    # -- pages ---------------------------------------------------------------------------------------
    def new_page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session, self.event_count())
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=session)
        return page

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.call("Browser.close")
        except BrowserError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        # Helpers (renderer, zygote, crashpad) share the browser's process group; end any left behind.
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._proc.poll() is None:
            self._proc.wait(timeout=5)
        os.close(self._to_browser)
        self._reader.join(timeout=5)
        os.close(self._from_browser)
        self._stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Page:
    """One tab: navigate, evaluate JavaScript, click and type with real input events, take screenshots."""

    def __init__(self, browser: Chromium, target: str, session: str, first_event: int):
        self.browser = browser
        self.target = target
        self.session = session
        self._first_event = first_event

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.browser.call(method, params, self.session)

    def goto(self, url: str) -> None:
        """Navigate and wait for the load event (deferred scripts have run by then)."""
        mark = self.browser.event_count()
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"cannot load {url}: {result['errorText']}")
        self.browser.wait_event(self.session, "Page.loadEventFired", mark)

    def reload(self) -> None:
        """Reload the page and wait for the new document's load event (an evaluate right after
        location.reload() can still meet the old document, or the new one half parsed)."""
        mark = self.browser.event_count()
        self.call("Page.reload", {})
        self.browser.wait_event(self.session, "Page.loadEventFired", mark)

    def evaluate(self, expression: str) -> Any:
        """The expression's value (JSON-able), awaiting it when it is a promise; page exceptions raise."""
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"page threw evaluating {expression!r}: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float | None = None) -> Any:
        """Poll until the expression is truthy and return its value."""
        deadline = time.monotonic() + (timeout_s or self.browser.timeout_s)
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.05)
        raise BrowserError(f"still falsy after waiting: {expression!r} (last value {value!r})")

    def _centre(self, css: str) -> tuple[float, float]:
        box = self.evaluate(
            f"""(() => {{
              const e = document.querySelector({json.dumps(css)});
              if (!e) return null;
              e.scrollIntoView({{block: 'center', inline: 'center'}});
              const r = e.getBoundingClientRect();
              return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height];
            }})()"""
        )
        if not box:
            raise BrowserError(f"nothing matches {css!r}")
        if box[2] <= 0 or box[3] <= 0:
            raise BrowserError(f"{css!r} is not visible (size {box[2]}x{box[3]})")
        return box[0], box[1]

    def click(self, css: str) -> None:
        """A real left click at the element's centre, as a user's mouse would deliver it."""
        x, y = self._centre(css)
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}
            )

    def drag(self, start: tuple[float, float], end: tuple[float, float], moves: int = 8) -> None:
        """A left-button drag from `start` to `end` (viewport pixels) through `moves` pointer moves, as a
        user's mouse delivers it: press, moves with the button held, release."""
        (x0, y0), (x1, y1) = start, end
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x0, "y": y0})
        self.call(
            "Input.dispatchMouseEvent",
            {"type": "mousePressed", "x": x0, "y": y0, "button": "left", "buttons": 1, "clickCount": 1},
        )
        for i in range(1, moves + 1):
            x, y = x0 + (x1 - x0) * i / moves, y0 + (y1 - y0) * i / moves
            self.call(
                "Input.dispatchMouseEvent",
                {"type": "mouseMoved", "x": x, "y": y, "button": "left", "buttons": 1},
            )
        self.call(
            "Input.dispatchMouseEvent",
            {"type": "mouseReleased", "x": x1, "y": y1, "button": "left", "buttons": 0, "clickCount": 1},
        )

    def type_into(self, css: str, text: str) -> None:
        """Replace an input's text as if typed: focus it, select all, insert (fires input events)."""
        self.click(css)
        self.evaluate(f"document.querySelector({json.dumps(css)}).select()")
        self.call("Input.insertText", {"text": text})

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def answer_logins(self, username: str, password: str) -> list[str]:
        """From now on, answer every HTTP login prompt (a 401 with `WWW-Authenticate: Basic`) as a person
        typing `username` and `password` would. Returns the list of URLs that prompted, filled as they do.
        Through the Fetch domain, which pauses every request: a thread lets each one go on."""
        prompted: list[str] = []
        self.call("Fetch.enable", {"handleAuthRequests": True, "patterns": [{"urlPattern": "*"}]})

        def answer() -> None:
            seen = self._first_event
            while True:
                try:
                    event = self.browser.wait_event_any(
                        self.session, ("Fetch.requestPaused", "Fetch.authRequired"), seen
                    )
                except BrowserError:
                    return  # page or browser closed
                seen = event["_index"] + 1
                params = event["params"]
                try:
                    if event["method"] == "Fetch.authRequired":
                        prompted.append(params["request"]["url"])
                        response = {
                            "response": "ProvideCredentials",
                            "username": username,
                            "password": password,
                        }
                        self.call(
                            "Fetch.continueWithAuth",
                            {"requestId": params["requestId"], "authChallengeResponse": response},
                        )
                    else:
                        self.call("Fetch.continueRequest", {"requestId": params["requestId"]})
                except BrowserError:
                    continue  # the request went away (navigation, page closed)

        threading.Thread(target=answer, name="browser-logins", daemon=True).start()
        return prompted

    def errors(self, include_network: bool = True) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries since the page was opened."""
        events, _ = self.browser.events(self.session, self._first_event)
        out = []
        for e in events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append(
                    "console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
                )
            elif e["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                network = p["entry"].get("source") == "network"
                # The browser asks every origin for /favicon.ico on its own; a 404 there is not the page's.
                if network and p["entry"].get("url", "").endswith("/favicon.ico"):
                    continue
                if include_network or not network:
                    where = f" [{p['entry']['url']}]" if p["entry"].get("url") else ""
                    out.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')}{where}")
        return out

    def close(self) -> None:
        try:
            self.browser.call("Target.closeTarget", {"targetId": self.target})
        except BrowserError:
            pass
