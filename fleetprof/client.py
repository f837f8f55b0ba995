"""HTTP client for the collector's query API, used by the query commands (top, flame)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class QueryError(Exception):
    """The collector could not be reached, or refused the query; the message says which and why."""


def fetch(base_url: str, path: str, params: dict[str, str | None], timeout_s: float = 30.0) -> bytes:
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{base_url.rstrip('/')}{path}?{query}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace")[:500] or err.reason
        raise QueryError(f"the collector refused the query ({err.code}): {message}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise QueryError(f"cannot reach the collector at {base_url}: {reason}") from None


def fetch_json(base_url: str, path: str, params: dict[str, str | None]) -> dict:
    return json.loads(fetch(base_url, path, params))
