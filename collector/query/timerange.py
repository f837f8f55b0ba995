"""Parse the times and durations of query parameters (since=5m, from=now-1h, until=<RFC 3339>)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

# Prometheus units, each at most once and largest first ("1h30m", not "30m1h"). A year is 365 days.
_DURATION = re.compile(
    r"(?:(?P<y>\d+)y)?(?:(?P<w>\d+)w)?(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?"
    r"(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?(?:(?P<ms>\d+)ms)?"
)
_UNIT_SECONDS = (("y", 365 * 86400), ("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60))
_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_RELATIVE = re.compile(r"now\s*(?P<sign>[+-])\s*(?P<duration>.+)")
_RFC3339 = re.compile(
    r"(?P<year>\d{4})-(?P<month>\d{2})-(?P<day>\d{2})[Tt ]"
    r"(?P<hour>\d{2}):(?P<minute>\d{2}):(?P<second>\d{2})(?P<fraction>\.\d+)?"
    r"(?:(?P<utc>[Zz])|(?P<sign>[+-])(?P<off_hour>\d{2}):(?P<off_minute>\d{2}))"
)
# Unix seconds above 1e11 would be past the year 5000, while 1e11 milliseconds is March 1973:
# any larger number is taken as milliseconds, which is what Grafana sends.
_MILLISECONDS_ABOVE = 1e11


class TimeRangeError(ValueError):
    """A time, duration or range in a query that cannot be used; the message quotes the input."""


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus-style duration ("30s", "1h30m", "500ms") or a plain number of seconds."""
    stripped = text.strip()
    if not stripped:
        raise TimeRangeError('empty duration: give seconds or units such as "30s", "5m" or "1h30m"')
    if _PLAIN_NUMBER.fullmatch(stripped):
        return _finite(float(stripped), text, "duration")
    match = _DURATION.fullmatch(stripped)
    # The all-optional pattern also matches "", so a match must have used at least one unit.
    if match is None or not any(match.groupdict().values()):
        hint = " (durations cannot be negative)" if stripped.startswith("-") else ""
        raise TimeRangeError(
            f'invalid duration "{text}"{hint}: give seconds or units such as "30s", "5m" or "1h30m" '
            "(y, w, d, h, m, s, ms; each once, largest first)"
        )
    try:
        # Whole seconds are summed as integers so "1h30m" is exact; only milliseconds need a fraction.
        seconds = sum(int(match.group(unit) or 0) * size for unit, size in _UNIT_SECONDS)
        seconds += int(match.group("s") or 0)
        total = seconds + int(match.group("ms") or 0) / 1000
    except (OverflowError, ValueError):  # past a float, or more digits than int() reads (4300)
        raise TimeRangeError(f'invalid duration "{text}": too large') from None
    return _finite(total, text, "duration")


def parse_time(text: str, now: float) -> float:
    """Unix seconds for a query time: unix seconds or milliseconds, "now", "now-5m", or RFC 3339.

    A plain number above 1e11 is read as unix milliseconds (Grafana's unit); anything smaller is
    seconds, so times from 1973 onward are read right in either unit.
    """
    stripped = text.strip()
    if stripped == "now":
        return now
    if _PLAIN_NUMBER.fullmatch(stripped):
        value = _finite(float(stripped), text, "time")
        return value / 1000.0 if value > _MILLISECONDS_ABOVE else value
    relative = _RELATIVE.fullmatch(stripped)
    if relative is not None:
        try:
            offset = parse_duration(relative.group("duration"))
        except TimeRangeError as err:
            raise TimeRangeError(f'invalid time "{text}": {err}') from None
        return now + offset if relative.group("sign") == "+" else now - offset
    moment = _RFC3339.fullmatch(stripped)
    if moment is not None:
        return _rfc3339_seconds(text, moment)
    raise TimeRangeError(
        f'invalid time "{text}": give unix seconds or milliseconds, "now", "now-5m", "now+1m", '
        'or RFC 3339 such as "2026-11-22T10:00:00Z"'
    )


def resolve_range(
    from_: str | None,
    until: str | None,
    since: str | None,
    now: float,
    default_since: float = 300.0,
) -> tuple[float, float]:
    """Turn the from/until/since query parameters into (start, end) unix seconds.

    The end is ``until``, else now. The start is ``from``, else ``since`` (or ``default_since``
    seconds) before the end, so since=5m alone is the last five minutes and with until=now-1h it
    is the five minutes before that. None means the parameter was not given; "" is an error.
    """
    if since is not None and from_ is not None:
        raise TimeRangeError(
            '"since" and "from" cannot be used together: use "since" for a window that ends at '
            '"until" (default now), or "from" and "until" for fixed ends'
        )
    if not (math.isfinite(default_since) and default_since >= 0):
        raise ValueError(f"default_since must be a non-negative number of seconds, got {default_since!r}")
    end = _parameter(parse_time, "until", until, now) if until is not None else now
    if from_ is not None:
        start = _parameter(parse_time, "from", from_, now)
    else:
        window = _parameter(parse_duration, "since", since) if since is not None else default_since
        start = end - window
    if start > end:
        raise TimeRangeError(
            f'"from" ({_describe(from_, start)}) is after "until" ({_describe(until or "now", end)})'
        )
    return start, end


def _finite(value: float, text: str, what: str) -> float:
    # float() turns a long enough digit string into inf rather than failing.
    if not math.isfinite(value):
        raise TimeRangeError(f'invalid {what} "{text}": too large')
    return value


def _parameter(parse: Callable[..., float], name: str, text: str, *args: float) -> float:
    try:
        return parse(text, *args)
    except TimeRangeError as err:
        raise TimeRangeError(f'bad "{name}": {err}') from None


def _rfc3339_seconds(text: str, moment: re.Match[str]) -> float:
    fields = moment.groupdict()
    if fields["utc"]:
        zone = UTC
    else:
        if int(fields["off_hour"]) > 23 or int(fields["off_minute"]) > 59:
            raise TimeRangeError(f'invalid time "{text}": timezone offset out of range')
        offset = timedelta(hours=int(fields["off_hour"]), minutes=int(fields["off_minute"]))
        zone = timezone(-offset if fields["sign"] == "-" else offset)
    try:
        whole = datetime(
            int(fields["year"]),
            int(fields["month"]),
            int(fields["day"]),
            int(fields["hour"]),
            int(fields["minute"]),
            int(fields["second"]),
            tzinfo=zone,
        )
    except ValueError as err:
        # Leap seconds (":60") land here too; Python's datetime cannot represent them.
        raise TimeRangeError(f'invalid time "{text}": {err}') from None
    # The fraction is added as a float so digits beyond microseconds are not silently cut.
    return whole.timestamp() + (float(fields["fraction"]) if fields["fraction"] else 0.0)


def _describe(text: str | None, seconds: float) -> str:
    # Show what a relative or numeric input resolved to, without repeating an RFC 3339 input.
    iso = _iso(seconds)
    return iso if text is None or text.strip() == iso else f"{text.strip()} = {iso}"


def _iso(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds, tz=UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{seconds} unix seconds"
