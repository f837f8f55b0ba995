"""Tests for collector.query.timerange: durations, times and from/until/since ranges."""

from __future__ import annotations

import pytest

from fleetprof.collector.query.timerange import TimeRangeError, parse_duration, parse_time, resolve_range

NOW = 1_795_860_000.0  # 2026-11-28T10:00:00Z


# --- parse_duration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("2d", 172800.0),
        ("1w", 604800.0),
        ("1y", 365 * 86400.0),
        ("500ms", 0.5),
        ("1m500ms", 60.5),
        ("1y2w3d4h5m6s7ms", 365 * 86400 + 14 * 86400 + 3 * 86400 + 4 * 3600 + 5 * 60 + 6 + 0.007),
        ("0s", 0.0),
        ("90m", 5400.0),
        ("0", 0.0),
        ("45", 45.0),
        ("1.5", 1.5),
        (".25", 0.25),
        ("10.", 10.0),
        (" 5m ", 300.0),
    ],
)
def test_parse_duration_reads_prometheus_units_and_plain_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    ["-5m", "-3", "m", "5x", "1.5h", "30m1h", "1h1h", "5 m", "1h 30m", "inf", "nan", "1e3", "ms", "s5"],
)
def test_parse_duration_rejects_malformed_text_and_quotes_it(text: str) -> None:
    with pytest.raises(TimeRangeError) as caught:
        parse_duration(text)
    assert f'"{text}"' in str(caught.value)


@pytest.mark.parametrize("text", ["", "   "])
def test_parse_duration_rejects_empty_text(text: str) -> None:
    with pytest.raises(TimeRangeError, match="empty duration"):
        parse_duration(text)


def test_parse_duration_says_negative_durations_are_not_allowed() -> None:
    with pytest.raises(TimeRangeError, match="cannot be negative"):
        parse_duration("-5m")


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "y", "9" * 400 + "ms"])
def test_parse_duration_rejects_numbers_too_large_for_a_float(text: str) -> None:
    with pytest.raises(TimeRangeError, match="too large"):
        parse_duration(text)


# Found by tests/collector/test_fuzz_query.py: past Python's 4300-digit limit, int() raised a bare ValueError
# that the API answered with a 500.
@pytest.mark.parametrize("text", ["9" * 5_000 + "s", "9" * 5_000 + "h", "1h" + "9" * 5_000 + "ms"])
def test_parse_duration_rejects_more_digits_than_int_reads(text: str) -> None:
    with pytest.raises(TimeRangeError, match="too large"):
        parse_duration(text)
    with pytest.raises(TimeRangeError, match='bad "since"'):
        resolve_range(None, None, text, NOW)
    with pytest.raises(TimeRangeError, match='bad "from"'):
        resolve_range("now-" + text, None, None, NOW)


def test_time_range_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_duration("soon")


# --- parse_time ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1732250000", 1732250000.0),
        ("1732250000.5", 1732250000.5),
        ("1732250000500", 1732250000.5),  # Grafana's milliseconds
        ("1732250000500.25", 1732250000.50025),
        ("99999999999", 99999999999.0),  # just under the milliseconds threshold: still seconds
        ("100000000001", 100000000.001),  # just over: milliseconds
        ("0", 0.0),
        ("now", NOW),
        (" now ", NOW),
        ("now-5m", NOW - 300),
        ("now+1m", NOW + 60),
        ("now-1h30m", NOW - 5400),
        ("now - 90", NOW - 90),
        ("now-0s", NOW),
        ("2026-11-22T10:00:00Z", 1795341600.0),
        ("2026-11-22t10:00:00z", 1795341600.0),
        ("2026-11-22 10:00:00Z", 1795341600.0),
        ("2026-11-22T10:00:00.25Z", 1795341600.25),
        ("2026-11-22T10:00:00.123456789Z", 1795341600.123456789),
        ("2026-11-22T12:00:00+02:00", 1795341600.0),
        ("2026-11-22T04:30:00-05:30", 1795341600.0),
        ("2026-11-22T10:00:00+00:00", 1795341600.0),
        ("2024-02-29T00:00:00Z", 1709164800.0),
    ],
)
def test_parse_time_reads_unix_relative_and_rfc3339_forms(text: str, expected: float) -> None:
    assert parse_time(text, NOW) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "yesterday",
        "now-",
        "now-5x",
        "now-1.5h",
        "now*2",
        "-1732250000",
        "2026-11-22T10:00:00",  # no offset: ambiguous
        "2026-11-22",
        "2026-11-22T10:00Z",
        "2026-13-01T00:00:00Z",
        "2026-02-30T00:00:00Z",
        "2026-11-22T24:00:00Z",
        "2026-12-31T23:59:60Z",
        "2026-11-22T10:00:00+24:00",
        "2026-11-22T10:00:00+0200",
        "20261122T100000Z",
        "1e12",
        "inf",
        "9" * 400,
    ],
)
def test_parse_time_rejects_malformed_text_and_quotes_it(text: str) -> None:
    with pytest.raises(TimeRangeError) as caught:
        parse_time(text, NOW)
    assert f'"{text}"' in str(caught.value)


def test_parse_time_explains_a_bad_relative_offset() -> None:
    with pytest.raises(TimeRangeError, match=r'invalid time "now-5x": invalid duration "5x"'):
        parse_time("now-5x", NOW)


def test_parse_time_lists_accepted_forms() -> None:
    with pytest.raises(TimeRangeError, match="RFC 3339"):
        parse_time("tomorrow", NOW)


# --- resolve_range -------------------------------------------------------------------------------


def test_no_parameters_give_the_default_window_ending_now() -> None:
    assert resolve_range(None, None, None, NOW) == (NOW - 300, NOW)


def test_default_window_is_configurable() -> None:
    assert resolve_range(None, None, None, NOW, default_since=60) == (NOW - 60, NOW)


def test_since_gives_a_window_ending_now() -> None:
    assert resolve_range(None, None, "15m", NOW) == (NOW - 900, NOW)


def test_since_with_until_gives_a_window_ending_at_until() -> None:
    assert resolve_range(None, "now-1h", "5m", NOW) == (NOW - 3600 - 300, NOW - 3600)


def test_from_alone_runs_until_now() -> None:
    assert resolve_range("now-2h", None, None, NOW) == (NOW - 7200, NOW)


def test_from_and_until_give_a_fixed_range() -> None:
    assert resolve_range("2026-11-22T10:00:00Z", "1795345200000", None, NOW) == (1795341600.0, 1795345200.0)


def test_until_alone_ends_the_default_window_there() -> None:
    assert resolve_range(None, "now-1d", None, NOW) == (NOW - 86400 - 300, NOW - 86400)


def test_equal_from_and_until_is_an_empty_but_valid_range() -> None:
    assert resolve_range("now", "now", None, NOW) == (NOW, NOW)


def test_from_after_until_names_both_with_resolved_times() -> None:
    with pytest.raises(TimeRangeError) as caught:
        resolve_range("2026-11-22T11:00:00Z", "2026-11-22T10:00:00Z", None, NOW)
    assert str(caught.value) == '"from" (2026-11-22T11:00:00Z) is after "until" (2026-11-22T10:00:00Z)'


def test_from_in_the_future_without_until_is_after_now() -> None:
    with pytest.raises(TimeRangeError) as caught:
        resolve_range("now+1h", None, None, NOW)
    assert str(caught.value) == (
        '"from" (now+1h = 2026-11-28T11:00:00Z) is after "until" (now = 2026-11-28T10:00:00Z)'
    )


def test_from_after_until_shows_what_unix_milliseconds_resolved_to() -> None:
    with pytest.raises(TimeRangeError, match=r'"from" \(1795345200000 = 2026-11-22T11:00:00Z\)'):
        resolve_range("1795345200000", "2026-11-22T10:00:00Z", None, NOW)


def test_since_together_with_from_is_rejected() -> None:
    with pytest.raises(TimeRangeError, match=r'"since" and "from" cannot be used together'):
        resolve_range("now-1h", None, "5m", NOW)


@pytest.mark.parametrize(
    ("from_", "until", "since", "name", "bad"),
    [
        ("soon", None, None, "from", "soon"),
        (None, "later", None, "until", "later"),
        (None, None, "a while", "since", "a while"),
        (None, None, "", "since", ""),
        ("", None, None, "from", ""),
    ],
)
def test_bad_parameter_errors_name_the_parameter_and_its_text(
    from_: str | None, until: str | None, since: str | None, name: str, bad: str
) -> None:
    with pytest.raises(TimeRangeError) as caught:
        resolve_range(from_, until, since, NOW)
    message = str(caught.value)
    assert message.startswith(f'bad "{name}": ')
    assert bad == "" or f'"{bad}"' in message


@pytest.mark.parametrize("default_since", [-1.0, float("nan"), float("inf")])
def test_unusable_default_window_is_a_programming_error(default_since: float) -> None:
    with pytest.raises(ValueError, match="default_since"):
        resolve_range(None, None, None, NOW, default_since=default_since)
