"""debuginfod servers for the tests: elfutils' real one (Debian's `debuginfod` package) serving a directory,
and a hostile one of our own that answers with what a broken or malicious server could send.

elfutils' debuginfod 0.188 cannot be told which address to listen on: it listens on every interface. It
runs here in a network namespace of its own (unshare --net, with only its loopback up), so nothing
outside reaches it; a relay in the test process listens on 127.0.0.1 (a free port) and opens each
connection to it from a thread that has entered that namespace (setns changes the calling thread's).
"""

from __future__ import annotations

import ctypes
import http.server
import os
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_PORT_INSIDE = 8002  # debuginfod's default; its namespace holds nothing else

# Run inside the new namespace before debuginfod: bring the loopback up (SIOCGIFFLAGS, SIOCSIFFLAGS | IFF_UP).
_LOOPBACK_UP = r"""
import fcntl, os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
s.close()
os.execvp(sys.argv[1], sys.argv[1:])
"""


class _Relay:
    """127.0.0.1:port here -> 127.0.0.1:inside_port in the network namespace at `netns`."""

    def __init__(self, netns: str, inside_port: int) -> None:
        self._ns = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        self._inside_port = inside_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="debuginfod-relay", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        # This thread only, and it ends with the connection: no other code runs in the namespace.
        if _libc.setns(self._ns, _CLONE_NEWNET) != 0:
            client.close()
            raise OSError(ctypes.get_errno(), "setns into debuginfod's network namespace")
        try:
            upstream = socket.create_connection(("127.0.0.1", self._inside_port), timeout=10)
        except OSError:
            client.close()
            return
        with client, upstream, selectors.DefaultSelector() as sel:
            sel.register(client, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, client)
            while True:
                for key, _ in sel.select():
                    try:
                        data = key.fileobj.recv(1 << 16)
                        if data:
                            key.data.sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        return  # either side closed: the client never half-closes an HTTP exchange

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=10)
        os.close(self._ns)


class Debuginfod:
    """elfutils' debuginfod serving the ELF files under `directory`; its URL is `url`. Use as a context
    manager, or stop()."""

    def __init__(self, directory: Path, work: Path) -> None:
        if shutil.which("debuginfod") is None:
            raise AssertionError("Debian's debuginfod is not installed: run scripts/setup.sh --test")
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "debuginfod.log"
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    "unshare",
                    "--net",
                    "--",
                    sys.executable,
                    "-c",
                    _LOOPBACK_UP,
                    "debuginfod",
                    "-F",
                    "-p",
                    str(_PORT_INSIDE),
                    "-d",
                    str(work / "index.sqlite"),
                    "-t",
                    "0",  # scan once, at the start
                    "-g",
                    "0",
                    str(directory),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._relay = self._relay_when_up()
        except BaseException:
            self._kill()
            raise
        self.url = f"http://127.0.0.1:{self._relay.port}"

    def _relay_when_up(self) -> _Relay:
        """The relay, once debuginfod runs in its own namespace (unshare and the helper exec into it)."""
        deadline = time.monotonic() + 30
        own = os.stat("/proc/self/ns/net").st_ino
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                raise AssertionError(f"debuginfod exited with {code}: {self.log.read_text()}")
            try:
                exe = os.readlink(f"/proc/{self._proc.pid}/exe")
                ns = os.stat(f"/proc/{self._proc.pid}/ns/net").st_ino
            except OSError:
                exe, ns = "", own
            if exe.endswith("/debuginfod") and ns != own:
                return _Relay(f"/proc/{self._proc.pid}/ns/net", _PORT_INSIDE)
            time.sleep(0.05)
        raise AssertionError("debuginfod did not start in its namespace within 30 s")

    def wait_serving(self, build_id: str, timeout: float = 60.0) -> bytes:
        """The debug file the server answers for `build_id`, once it has indexed it (it scans at start)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/buildid/{build_id}/debuginfo", timeout=10) as r:
                    return r.read()
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    tail = self.log.read_text()[-2000:]
                    raise AssertionError(
                        f"debuginfod did not serve {build_id} within {timeout} s: {tail}"
                    ) from None
                time.sleep(0.2)

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def stop(self) -> None:
        self._relay.close()
        self._kill()

    def __enter__(self) -> Debuginfod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- a hostile server --------------------------------------------------------------------------------------

HUGE_DECLARED = "huge_declared"  # Content-Length of 64 GiB, then zeros for as long as the client reads
HUGE_CHUNKED = "huge_chunked"  # no length, chunked zeros without end
TRICKLE = "trickle"  # a plausible length, one byte every 50 ms
SILENT = "silent"  # accepts the request and says nothing
FILE = "file"  # the bytes of `body` (an ELF file of another build, or not ELF at all)
REDIRECT = "redirect"  # 302 to `body` (a URL base) + the path asked for; with body b"", to itself: a loop
MODES = (HUGE_DECLARED, HUGE_CHUNKED, TRICKLE, SILENT, FILE, REDIRECT)


class HostileServer:
    """An HTTP server on 127.0.0.1 (a free port) answering every GET as `mode` says (settable between
    requests). `sent` counts the body bytes it wrote, `requests` the paths it was asked for."""

    def __init__(self, mode: str = FILE, body: bytes = b"") -> None:
        self.mode = mode
        self.body = body
        self.sent = 0
        self.requests: list[str] = []
        self._stop = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # http.server's name
                server.requests.append(self.path)
                try:
                    server._answer(self)
                except OSError:
                    pass  # the client left: what a bounded client does

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hostile", daemon=True)
        self._thread.start()

    def _write(self, handler: http.server.BaseHTTPRequestHandler, data: bytes) -> None:
        handler.wfile.write(data)
        handler.wfile.flush()
        self.sent += len(data)

    def _answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        zeros = bytes(1 << 16)
        if self.mode == SILENT:
            self._stop.wait(120)
            return
        if self.mode == REDIRECT:
            h.send_response(302)
            h.send_header("Location", self.body.decode() + h.path)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(200)
        if self.mode == FILE:
            h.send_header("Content-Length", str(len(self.body)))
            h.end_headers()
            self._write(h, self.body)
        elif self.mode == HUGE_DECLARED:
            h.send_header("Content-Length", str(64 << 30))
            h.end_headers()
            while not self._stop.is_set():
                self._write(h, zeros)
        elif self.mode == HUGE_CHUNKED:
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            while not self._stop.is_set():
                self._write(h, b"%x\r\n" % len(zeros) + zeros + b"\r\n")
        elif self.mode == TRICKLE:
            h.send_header("Content-Length", str(1 << 20))
            h.end_headers()
            while not self._stop.is_set():
                self._write(h, b"\x7f")
                time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
