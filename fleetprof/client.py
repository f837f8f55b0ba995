"""HTTP client for the collector's query API, used by the query commands (top, flame, ...)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass


class QueryError(Exception):
    """The collector could not be reached, or refused the query; the message says which and why."""


@dataclass(frozen=True)
class Credentials:
    """How the query commands reach a protected collector: a CA for https://, and the API token."""

    ca: str | None = None  # None: the system's CAs (https:// only)
    token: str | None = None

    def context(self, url: str) -> ssl.SSLContext | None:
        if not url.startswith("https:"):
            return None
        from fleetprof.tls import TlsError, client_http_context

        try:
            return client_http_context(self.ca)
        except TlsError as err:
            raise QueryError(str(err)) from None


def fetch(
    base_url: str,
    path: str,
    params: dict[str, str | None],
    timeout_s: float = 30.0,
    credentials: Credentials | None = None,
) -> bytes:
    credentials = credentials or Credentials()
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{base_url.rstrip('/')}{path}?{query}"
    headers = {"Authorization": f"Bearer {credentials.token}"} if credentials.token else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=credentials.context(url)) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace")[:500] or err.reason
        if err.code == 401:
            message += (
                ": give it with --token-file FILE or $FLEETPROF_TOKEN"
                if not credentials.token
                else ": the token given was refused"
            )
        raise QueryError(f"the collector refused the query ({err.code}): {message}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLError):
            reason = f"TLS failed ({reason}); is --ca the CA that signed the collector's certificate?"
        raise QueryError(f"cannot reach the collector at {base_url}: {reason}") from None


def fetch_json(
    base_url: str, path: str, params: dict[str, str | None], credentials: Credentials | None = None
) -> dict:
    return json.loads(fetch(base_url, path, params, credentials=credentials))
