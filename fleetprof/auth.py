"""Bearer tokens kept in files: read again when the file changes, compared in constant time.

One file format for every side. Each non-empty line not starting with `#` is a token. A server accepts
any of them; a client sends the first. Rotation without downtime is then: add the new token as a second
line on the servers, give the clients the new token, then remove the old line. Files are re-read when
their identity or mtime changes (a Kubernetes Secret volume swaps a symlink, so the inode changes), checked
with one stat per use, so a rotated Secret takes effect without a restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import threading

log = logging.getLogger(__name__)


class TokenFileError(ValueError):
    """A token file that cannot be used at start: missing, unreadable, or without a token."""


def _read_tokens(path: str) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        text = f.read(64 * 1024)  # a token file is a few lines; never read a huge file someone swapped in
    return tuple(t for line in text.splitlines() if (t := line.strip()) and not t.startswith("#"))


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class TokenFile:
    """The tokens in `path`, kept current. Raises TokenFileError when the file is unusable at start; a
    later unreadable or empty version keeps the tokens read before (said once in the log), so a botched
    rotation does not lock every agent out."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        try:
            st = os.stat(path)
            tokens = _read_tokens(path)
        except (OSError, UnicodeDecodeError) as err:
            raise TokenFileError(f"cannot read token file {path}: {err}") from None
        if not tokens:
            raise TokenFileError(f"token file {path} holds no token (one per line)")
        self._stamp = _stamp(st)
        self._set(tokens)
        self._complained: object = None  # what was last complained about: said once, not per request

    def _set(self, tokens: tuple[str, ...]) -> None:
        self._tokens = tokens
        # Compared as digests: equal length, so the comparison time says nothing about the token's length.
        self._digests = tuple(hashlib.sha256(t.encode()).digest() for t in tokens)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as err:
            self._complain("gone", f"token file {self.path} is gone ({err}); keeping the tokens read before")
            return
        stamp = _stamp(st)
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                tokens = _read_tokens(self.path)
            except (OSError, UnicodeDecodeError) as err:
                self._complain(stamp, f"cannot read token file {self.path} ({err}); keeping the old tokens")
                return
            if not tokens:
                self._complain(stamp, f"token file {self.path} is now empty; keeping the old tokens")
                return
            self._stamp = stamp
            self._set(tokens)
            log.info("token file %s changed: %d token(s) now accepted", self.path, len(tokens))

    def _complain(self, what: object, message: str) -> None:
        if what != self._complained:
            log.warning("%s", message)
        self._complained = what

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the file's tokens; every token is compared, in constant time."""
        self._refresh()
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok

    def current(self) -> str:
        """The token a client sends: the file's first."""
        self._refresh()
        return self._tokens[0]


def presented_token(authorization: str) -> str | None:
    """The token in an Authorization header: `Bearer TOKEN`, or `Basic` with the token as the password
    (what a browser sends after its login prompt; the user name is ignored). None when there is none."""
    scheme, _, value = authorization.strip().partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip() or None
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None
