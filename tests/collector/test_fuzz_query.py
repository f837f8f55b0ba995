"""Fuzzing the query side: the selector parser and the time parameters in-process, and every HTTP route's
parameters against a real collector holding real batches.

A selector text parses (and prints back to text that parses to the same selector, and matches any label value
at once: RE2) or raises SelectorError with a position inside the text; a time or duration parses to a finite
number or raises TimeRangeError; an HTTP request is answered, within a client timeout, with 200 and a body
in its format (strict JSON, well-formed SVG, folded text, gzip) or with a 4xx and a JSON error, never a 5xx.
A call that does not return within HANG_S is a hang, and a failure. Derandomized: the same corpus each run
(~15 s). The big run, random seeds, 10,000 examples per test (~2 min on 2 cores):

    FLEETPROF_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest tests/collector/test_fuzz_query.py
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import sys
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2, types_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.validate import MAX_LABEL_BYTES, MAX_STACK_DEPTH
from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.model.selector import Selector, SelectorError
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.query.timerange import TimeRangeError, parse_duration, parse_time, resolve_range
from fleetprof.collector.render.pprof import to_pprof
from fleetprof.collector.render.tree import parse_folded, to_folded, to_json, tree_json_text
from fleetprof.collector.serve.connect import CODE_STATUS
from fleetprof.collector.serve.http import DIFF_FORMATS, FORMATS
from tests.conftest import RunningCollector, http_get, start_collector
from tests.support.gpu_batches import gpu_batch
from tests.support.wire import BatchBuilder, hist, push, with_syscalls

EXAMPLES = int(os.environ.get("FLEETPROF_FUZZ_EXAMPLES", "0"))
HANG_S = 20.0  # far beyond any answer here; the HTTP server's own budget is 30 s and answers 503 past it
HTTP_TIMEOUT_S = 60.0


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or examples,
        derandomize=not EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def in_time(fn: Callable[..., object], *args: object) -> object:
    """fn(*args), raising what it raises; a call still running after HANG_S fails the test (a hang)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as err:  # re-raised in the caller's thread
            out["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive(), f"{getattr(fn, '__name__', fn)}{str(args)[:300]} hangs"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


# --- selectors ------------------------------------------------------------------------------------------

NAMES = st.one_of(
    st.sampled_from(
        ["pod", "namespace", "node", "comm", "gpu_state", "__name__", "_", "a9", "9a", "a-b", "é", ""]
    ),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True),
)
OPERATORS = st.sampled_from(["=", "!=", "=~", "!~", "==", "~", "!", "=!", "~=", "", "=~~"])
REGEXES = [
    "(a+)+b",  # exponential backtracking in a backtracking engine
    "(a|a)*c",
    "(.*)*x",
    "^(a+)+$",
    "(x+x+)+y",
    "a{1000}",
    "a{1001}",
    "((a{30}){30}){30}",
    "(a)\\1",  # backreference: not RE2
    "(?=a)",  # lookaround: not RE2
    "(?<=a)b",
    "(?P<n>a)(?P<n>b)",
    "\\p{Greek}+",
    "\\pX",
    "\\C+",
    "[",
    "(",
    "*",
    "a**",
    "\\",
    "[[:alpha:]]",
    "[[:nope:]]",
    "(?i)POD",
    "(?z)",
    "\\Q.*\\E",
    "\\x{110000}",
    "[z-a]",
    "(" * 1100 + ")" * 1100,
    "(?:" * 300 + "a" + ")*" * 300,
    "\\b\\B^$",
    ".*",
    "",
]
ESCAPES = [
    '\\"',
    "\\'",
    "\\\\",
    "\\n",
    "\\a\\b\\f\\r\\t\\v",
    "\\x41",
    "\\xff",  # a byte that is not UTF-8 on its own
    "\\xc3\\xa9",
    "\\u00e9",
    "\\ud800",
    "\\U0010FFFF",
    "\\U00110000",
    "\\101",
    "\\400",
    "\\0",
    "\\q",
    "\\x4",
    "\\u12",
    "\\",
]


@st.composite
def literals(draw: st.DrawFn) -> str:
    """A quoted value: interpreted (escapes, good and bad), raw, sometimes unterminated or spanning lines."""
    quote_char = draw(st.sampled_from(['"', '"', "'", "`"]))
    pieces = draw(
        st.lists(
            st.one_of(st.sampled_from(REGEXES), st.sampled_from(ESCAPES), st.text(max_size=8)),
            max_size=4,
        )
    )
    body = "".join(pieces)
    close = draw(st.sampled_from([quote_char, quote_char, quote_char, "", "\n" + quote_char]))
    return quote_char + body + close


@st.composite
def selector_texts(draw: st.DrawFn) -> str:
    """Valid grammar pieces mixed with junk: names, operators, values, separators, braces and stray text."""
    space = st.sampled_from(["", "", " ", "\t", "\n", "\r\n", "\u00a0"])
    matchers = [
        draw(NAMES) + draw(space) + draw(OPERATORS) + draw(space) + draw(literals())
        for _ in range(draw(st.integers(0, 4)))
    ]
    sep = draw(st.sampled_from([",", ",", ", ", ";", "", ",,"]))
    text = (
        draw(st.sampled_from(["", "", "cpu", " ", "{{"]))
        + draw(st.sampled_from(["{", "{", "{", "(", ""]))
        + sep.join(matchers)
        + draw(st.sampled_from(["", "", ","]))
        + draw(st.sampled_from(["}", "}", "}", "", "}}", "} x"]))
    )
    junk = draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.text(max_size=3)), max_size=2))
    for at, piece in junk:
        at %= len(text) + 1
        text = text[:at] + piece + text[at:]
    return text


# Label values as ingest lets them be (at most MAX_LABEL_BYTES); "a..." against (a+)+b is the classic.
ADVERSARIAL_VALUES = ["a" * 40 + "!", "x" * 40, "", "é" * 20, "\n" * 5, "\x00", "a" * MAX_LABEL_BYTES]


def parsed_or_refused(text: str) -> Selector | None:
    """parse_selector(text), checked; None when it raised SelectorError (checked too)."""
    try:
        selector = in_time(parse_selector, text)
    except SelectorError as err:
        assert str(err).startswith("bad selector"), str(err)
        assert err.position is None or 0 <= err.position <= len(text), (err.position, len(text))
        return None
    assert isinstance(selector, Selector)
    assert in_time(parse_selector, str(selector)) == selector, f"{selector} does not read back"
    in_time(_match_all, selector)
    return selector


def _match_all(selector: Selector) -> None:
    for matcher in selector.matchers:
        for value in ADVERSARIAL_VALUES:
            matcher.matches(value)


@fuzz_settings(1500)
@given(selector_texts())
def test_structured_selectors_parse_or_raise_selector_error(text: str) -> None:
    parsed_or_refused(text)


@fuzz_settings(800)
@given(st.text())
def test_arbitrary_text_parses_or_raises_selector_error(text: str) -> None:
    parsed_or_refused(text)


@pytest.mark.parametrize(
    "text",
    [
        '{a="' + "x" * 1_000_000 + '"}',
        "{" + ",".join(f'l{i}="{i}"' for i in range(5_000)) + "}",
        '{a=~"' + "(" * 3_000 + ")" * 3_000 + '"}',
        '{a=~"' + "a{1000}" * 200 + '"}',
        '{a="' + "\\\\" * 200_000 + '"}',
        '{a="' + "\\xff" * 10_000 + '"}',
        "{" * 100_000,
        " " * 1_000_000,
        '{a=~"' + "(a+)+" * 300 + 'b"}',
    ],
    ids=[
        "1MB value",
        "5k matchers",
        "3k nested groups",
        "huge repeat",
        "escapes",
        "bad utf8",
        "braces",
        "space",
        "nested plus",
    ],
)
def test_huge_selectors_parse_or_raise_selector_error_at_once(text: str) -> None:
    parsed_or_refused(text)


# --- times and durations --------------------------------------------------------------------------------

TIMES = [
    "now",
    "now-5m",
    "now+1m",
    "now - 5m",
    "1767225600",
    "1767225600000",
    "1767225600.5",
    "0",
    ".5",
    "2026-01-01T00:00:00Z",
    "2026-01-01 00:00:00+05:30",
    "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00+23:59",
    "9999-12-31T23:59:59-23:59",
    "2026-02-30T00:00:00Z",
    "2026-01-01T00:00:60Z",
    "2026-01-01T24:00:00Z",
    "2026-01-01T00:00:00+24:00",
    "now-400y",
    "now+100000000y",
    "9" * 400,
    "9" * 5_000,
    "now-" + "9" * 5_000 + "s",
    "now-" + "9" * 400 + "y",
    "1e400",
    "inf",
    "nan",
    "-5",
    "١٢٣",
    "",
    " ",
    "\x00",
]
DURATIONS = [
    "5m",
    "1h30m",
    "0",
    "0s",
    "500ms",
    "1.5",
    ".5",
    "1e3",
    "-5m",
    "5M",
    "1h1h",
    "30m1h",
    "9" * 400 + "y",
    "9" * 5_000 + "s",
    "9" * 5_000 + "ms",
    "9" * 5_000,
    "1y1w1d1h1m1s1ms",
    "",
    "\u0665m",
]
time_texts = st.one_of(st.sampled_from(TIMES), st.text(max_size=12), st.integers().map(str))
duration_texts = st.one_of(st.sampled_from(DURATIONS), st.text(max_size=8), st.integers().map(str))
NOW = 1_767_225_600.0


def finite_or_refused(fn: Callable[..., float], *args: object) -> None:
    try:
        value = in_time(fn, *args)
    except TimeRangeError as err:
        assert str(err), fn
        return
    values = value if isinstance(value, tuple) else (value,)
    assert all(isinstance(v, float | int) and abs(v) < float("inf") for v in values), (args, value)


@fuzz_settings(1500)
@given(time_texts, duration_texts)
def test_times_and_durations_parse_or_raise_time_range_error(time_text: str, duration_text: str) -> None:
    finite_or_refused(parse_time, time_text, NOW)
    finite_or_refused(parse_duration, duration_text)


@fuzz_settings(1500)
@given(st.none() | time_texts, st.none() | time_texts, st.none() | duration_texts)
def test_time_ranges_resolve_or_raise_time_range_error(
    from_: str | None, until: str | None, since: str | None
) -> None:
    finite_or_refused(resolve_range, from_, until, since, NOW)


# --- HTTP query parameters ------------------------------------------------------------------------------

ODD_NAMES = ["</script><script>alert(1)</script>", "]]><x/>", "a;b c", "tab\there", "\x01\x7f", "ünï 🔥", ""]


def _fed_collector() -> RunningCollector:
    """A collector holding a few real batches: several pods and stacks, odd frame names, syscalls, GPUs."""
    col = RunningCollector(start_collector())
    b = BatchBuilder(frequency_hz=99)
    web = b.process(10, "web", {"namespace": "prod", "pod": "web-0", "container": "app"})
    job = b.process(11, "job", {"namespace": "batch", "pod": "job-1"})
    for i, name in enumerate(ODD_NAMES):
        b.sample(web, b.stack([("main", "app"), (name, "libodd.so")]), 3 + i, (pb.GPU_STATE_IDLE, 0)[i % 2])
    b.sample(job, b.stack([(f"f{i}", "libdeep.so") for i in range(300)], kernel_start=290), 50)
    b.sample(job, b.stack([]), 2)
    batch = with_syscalls(b.build(), [("read", 100, 10, 10 * 3_000, hist(b11=10))])
    with pytest.MonkeyPatch.context() as mp:
        gpu = gpu_batch(mp)
    assert push(col.grpc_target, [batch]) == [1]
    assert push(col.grpc_target, [gpu]) == [1]
    return col


@pytest.fixture(scope="module")
def fed_collector() -> Iterator[RunningCollector]:
    col = _fed_collector()
    yield col
    col.collector.stop()


ROUTES = [
    "/api/v1/profile",
    "/api/v1/top",
    "/api/v1/diff",
    "/api/v1/labels",
    "/api/v1/syscalls",
    "/api/v1/gpus",
    "/api/v1/series",
    "/metrics",
    "/healthz",
    "/",
    "/ui",
    "/ui/",
]
label_paths = st.one_of(
    st.sampled_from(["pod", "node", "", "a/b", "..", "%2F", "x" * 300]), st.text(max_size=10)
).map(lambda name: f"/api/v1/labels/{urllib.parse.quote(name, safe='')}/values")
odd_paths = st.sampled_from(
    [
        "/ui/app.js",
        "/ui/../main.py",
        "/ui/.env",
        "/app.css",
        "/app.x",
        "/api/v1/labels/pod",
        "/api/v1/nope",
        "//",
    ]
)


EXTREME_TIMES = ["0", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59-23:59", "now-400y", "now+100000000y"]
EXTREME_TIMES += ["9" * 300, "now-" + "9" * 300 + "y", "1767225600000"]
_SELECTORS = (
    ["{}", '{namespace="prod"}', '{pod=~"web-.*"}', '{comm!~"(a+)+b"}'],
    ['{a="]]>"}', '{pod=~"' + "(a+)+" * 50 + 'b"}', '{__name__=""}', '{a=~"\\C"}'],
    selector_texts(),
)
_DURATIONS = (["5m", "10m", "1h"], ["0", "500ms", "2h", "9" * 300, "9" * 300 + "y", "1y"], duration_texts)
_TIMES = (["now-10m", "now", "now-1h"], EXTREME_TIMES, time_texts)
_INTS = (
    ["5", "50", "1"],
    ["0", "-1", "10000", "10001", "1000000", "1000001", "9" * 5_000, "1_000", " 5 ", "٣", "5.0"],
    st.one_of(st.integers().map(str), st.text(max_size=5)),
)
_CHOICE_JUNK = st.text(max_size=6)
# Per parameter: (good values, odd but valid ones, junk).
PARAMETERS = {
    "query": _SELECTORS,
    "query2": _SELECTORS,
    "since": _DURATIONS,
    "since2": _DURATIONS,
    "from": _TIMES,
    "until": _TIMES,
    "from2": _TIMES,
    "until2": _TIMES,
    "limit": _INTS,
    "max_nodes": _INTS,
    "functions": _INTS,
    "by": (
        ["namespace,pod", "node", "syscall"],
        ["pod,syscall", ",", "a,,b", "9x", "pod,pod", "gpu_state", " pod , node ", "nope"],
        st.text(max_size=10),
    ),
    "sort": (["self", "total", "time", "count"], ["SELF", ""], _CHOICE_JUNK),
    "format": (list(FORMATS), ["JSON", "svg "], _CHOICE_JUNK),
    "gpu": (["idle", "busy"], ["none", ""], _CHOICE_JUNK),
    "gpu2": (["idle", "busy"], ["none"], _CHOICE_JUNK),
}


@st.composite
def queries(draw: st.DrawFn) -> dict[str, str]:
    """A few good parameters, then one or two of any parameter made odd or junk: most requests get past
    the good ones to the code that reads the bad one."""
    names = sorted(PARAMETERS)
    query = {
        n: draw(st.sampled_from(PARAMETERS[n][0])) for n in draw(st.lists(st.sampled_from(names), max_size=4))
    }
    for name in draw(st.lists(st.sampled_from(names), max_size=2)):
        _, odd, junk = PARAMETERS[name]
        query[name] = draw(st.one_of(st.sampled_from(odd), junk))
    return query


paths = st.one_of(
    st.sampled_from(["pod", "node", "", "a/b", "..", "%2F", "x" * 300]), st.text(max_size=10)
).map(lambda name: f"/api/v1/labels/{urllib.parse.quote(name, safe='')}/values")
odd_paths = st.sampled_from(
    [
        "/ui/app.js",
        "/ui/../main.py",
        "/ui/.env",
        "/app.css",
        "/app.x",
        "/api/v1/labels/pod",
        "/api/v1/nope",
        "//",
    ]
)


def _mostly(valid: list[str], odd: list[str], junk: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A parameter's value: usually a good one, so a request gets past the other parameters to the code
    that uses it; else an odd but valid one, or junk."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(valid), st.sampled_from(odd), junk)


EXTREME_TIMES = ["0", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59-23:59", "now-400y", "now+100000000y"]
EXTREME_TIMES += ["9" * 300, "now-" + "9" * 300 + "y", "1767225600000"]
selectors = _mostly(
    ["{}", '{namespace="prod"}', '{pod=~"web-.*"}', '{comm!~"(a+)+b"}'],
    ['{a="]]>"}', '{pod=~"' + "(a+)+" * 50 + 'b"}', '{__name__=""}', '{a=~"\\C"}'],
    selector_texts(),
)
durations = _mostly(
    ["5m", "10m", "1h"], ["0", "500ms", "2h", "9" * 300, "9" * 300 + "y", "1y"], duration_texts
)
times = _mostly(["now-10m", "now", "now-1h"], EXTREME_TIMES, time_texts)
ints = _mostly(
    ["5", "50", "1"],
    ["0", "-1", "10000", "10001", "1000000", "1000001", "9" * 5_000, "1_000", " 5 ", "٣", "5.0"],
    st.one_of(st.integers().map(str), st.text(max_size=5)),
)
label_lists = _mostly(
    ["namespace,pod", "node", "syscall"],
    ["pod,syscall", ",", "a,,b", "9x", "pod,pod", "gpu_state", " pod , node ", "nope"],
    st.text(max_size=10),
)
params = st.fixed_dictionaries(
    {},
    optional={
        "query": selectors,
        "query2": selectors,
        "since": durations,
        "since2": durations,
        "from": times,
        "until": times,
        "from2": times,
        "until2": times,
        "limit": ints,
        "max_nodes": ints,
        "functions": ints,
        "step": _mostly(
            ["10", "15", "60.5"], ["0", "-1", "nan", "inf", "1e-300", "1e300", "0.001"], st.text(max_size=6)
        ),
        "by": label_lists,
        "sort": _mostly(["self", "total", "time", "count"], ["SELF", ""], st.text(max_size=6)),
        "format": _mostly(list(FORMATS), ["JSON", "svg "], st.text(max_size=6)),
        "gpu": _mostly(["idle", "busy"], ["none", ""], st.text(max_size=6)),
        "gpu2": _mostly(["idle", "busy"], ["none"], st.text(max_size=6)),
    },
)
# Mostly the query routes; a tenth each the label-values prefix route and paths no route serves.
paths = st.integers(0, 9).flatmap(
    lambda k: label_paths if k == 0 else odd_paths if k == 1 else st.sampled_from(ROUTES[:7] * 3 + ROUTES)
)


def _get(port: int, url: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def _strict_json(body: bytes) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(body, parse_constant=refuse)


def check_answer(status: int, content_type: str, body: bytes, what: str) -> None:
    """A 4xx with a JSON error, or a 200 with a body its content type can be read as."""
    assert status < 500, f"{status} for {what}: {body[:1000]!r}"
    if status >= 400:
        assert content_type == "application/json", f"{status} {content_type} for {what}"
        error = _strict_json(body)["error"]
        assert isinstance(error, str) and error, what
        return
    assert status == 200, f"{status} for {what}"
    if content_type == "application/json":
        _strict_json(body)
    elif content_type == "image/svg+xml":
        ET.fromstring(body)
    elif content_type.startswith("text/plain") and what.startswith("GET /api/v1/profile?"):
        parse_folded(body.decode())
    elif content_type == "application/octet-stream":
        gzip.decompress(body)


@fuzz_settings(1500)
@given(paths, queries())
def test_every_route_answers_fuzzed_parameters_with_200_or_a_json_4xx(
    fed_collector: RunningCollector, path: str, query: dict[str, str]
) -> None:
    url = f"{path}?{urllib.parse.urlencode(query)}" if query else path
    what = f"GET {url[:2000]}"
    # No answer within HTTP_TIMEOUT_S raises (TimeoutError): a hang fails the test.
    status, content_type, body = _get(fed_collector.collector.http_port, url)
    event(f"{status} {path if path in ROUTES else 'other'}")  # --hypothesis-show-statistics
    check_answer(status, content_type, body, what)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "bounds",
    [(f, u) for f in EXTREME_TIMES[:5] for u in ("now", "9999-12-31T23:59:59Z", "now+100000000y")],
)
def test_every_format_answers_extreme_time_ranges(
    fed_collector: RunningCollector, fmt: str, bounds: tuple[str, str]
) -> None:
    for path in ("/api/v1/profile", "/api/v1/diff"):
        if path.endswith("diff") and fmt not in DIFF_FORMATS:
            continue
        query = {"format": fmt, "from": bounds[0], "until": bounds[1], "query2": '{namespace="prod"}'}
        url = f"{path}?{urllib.parse.urlencode(query)}"
        check_answer(*_get(fed_collector.collector.http_port, url), f"GET {url}")


# -- Grafana's Pyroscope API (Connect RPCs) -----------------------------------------------------------
CONNECT_METHODS = {
    "ProfileTypes": querier_pb2.ProfileTypesRequest,
    "LabelNames": types_pb2.LabelNamesRequest,
    "LabelValues": types_pb2.LabelValuesRequest,
    "Series": querier_pb2.SeriesRequest,
    "SelectMergeStacktraces": querier_pb2.SelectMergeStacktracesRequest,
    "SelectMergeProfile": querier_pb2.SelectMergeProfileRequest,
    "SelectSeries": querier_pb2.SelectSeriesRequest,
    "GetProfileStats": types_pb2.GetProfileStatsRequest,
}
_MS = st.one_of(
    st.sampled_from([0, 1, 1000, 4000, int(NOW * 1000), int(NOW * 1000) - 600_000, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
_TYPE_IDS = _mostly(
    ["process_cpu:cpu:nanoseconds:cpu:nanoseconds", "process_cpu:samples:count:cpu:nanoseconds"],
    ["", "memory:alloc_space:bytes:space:bytes", "::::"],
    st.text(max_size=20),
)
_NAMES = _mostly(
    ["pod", "service_name", "__profile_type__"], ["", "__name__", "x" * 300], st.text(max_size=8)
)
# Field values by name, for whichever request message has the field.
CONNECT_FIELDS = {
    "start": _MS,
    "end": _MS,
    "label_selector": selectors,
    "profile_typeID": _TYPE_IDS,
    "max_nodes": st.one_of(
        st.sampled_from([0, 1, 8192, 1_000_000, 1_000_001, -1]), st.integers(-(2**63), 2**63 - 1)
    ),
    "step": st.one_of(st.sampled_from([0.0, 15.0, -1.0, 1e-300, 1e300]), st.floats()),
    "limit": st.one_of(st.sampled_from([0, 1, -1]), st.integers(-(2**63), 2**63 - 1)),
    "aggregation": st.sampled_from([0, 1, 7]),
    "format": st.sampled_from([0, 1, 2, 99]),
    "name": _NAMES,
    "matchers": st.lists(selectors, max_size=3),
    "label_names": st.lists(_NAMES, max_size=3),
    "group_by": st.lists(_NAMES, max_size=3),
}


@st.composite
def connect_calls(draw: st.DrawFn) -> tuple[str, bytes, str, str]:
    """(method, body, content type, description): a request message with fuzzed fields, as proto or JSON,
    sometimes cut or replaced by random bytes."""
    method = draw(st.sampled_from([*CONNECT_METHODS, "Diff", "Nope"]))
    cls = CONNECT_METHODS.get(method, querier_pb2.ProfileTypesRequest)
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if field.name in CONNECT_FIELDS and draw(st.booleans()):
            value = draw(CONNECT_FIELDS[field.name])
            if isinstance(value, list):
                getattr(msg, field.name).extend(value)
            else:
                setattr(msg, field.name, value)
    use_json = draw(st.booleans())
    body = json_format.MessageToJson(msg).encode() if use_json else msg.SerializeToString()
    damage = draw(st.integers(0, 9))
    if damage == 0:
        body = draw(st.binary(max_size=64))
    elif damage == 1 and body:
        body = body[: draw(st.integers(0, len(body) - 1))]
    ctype = "application/json" if use_json else "application/proto"
    return method, body, ctype, f"{method} {ctype} {msg!r:.500} damage={damage}"


@fuzz_settings(600)
@given(connect_calls())
def test_connect_methods_answer_fuzzed_requests_with_200_or_a_connect_error(
    fed_collector: RunningCollector, call: tuple[str, bytes, str, str]
) -> None:
    method, body, ctype, what = call
    conn = http.client.HTTPConnection("127.0.0.1", fed_collector.collector.http_port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request(
            "POST", f"/querier.v1.QuerierService/{method}", body=body, headers={"Content-Type": ctype}
        )
        resp = conn.getresponse()
        status, content_type, answer = resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()
    event(f"{status} {method}")
    assert status < 500 or (method == "Diff" and status == 501), f"{status} for {what}: {answer[:1000]!r}"
    if status != 200:
        assert content_type == "application/json", what
        err = _strict_json(answer)
        assert err["code"] in CODE_STATUS and err["message"], what
        assert CODE_STATUS[err["code"]] == status or status == 404, what
        return
    assert content_type == ctype, what
    if method in CONNECT_METHODS:
        out = {
            "SelectMergeProfile": profile_pb2.Profile,
            "ProfileTypes": querier_pb2.ProfileTypesResponse,
        }.get(method)
        if out is not None and ctype == "application/proto":
            out.FromString(answer)


# Found by the tests above; focused here, next to what found them.


@pytest.mark.parametrize(("start", "end"), [(-6.2e10, 0.0), (0.0, 3.2e15), (-1e300, 1e300)])
def test_pprof_writes_times_past_int64_nanoseconds_clamped(start: float, end: float) -> None:
    """A time before 1678 or after 2262 is past int64 nanoseconds: _varint looped for ever on one (from=
    0001-01-01T00:00:00Z&format=pprof held an HTTP worker for good); it is clamped to int64 now."""
    stacks = {(FrameKey("main"),): 5}
    profile = in_time(to_pprof, stacks, 19, start, end)
    assert gzip.decompress(profile)  # type: ignore[arg-type]


def test_folded_text_reads_back_names_holding_line_breaks_other_than_newline() -> None:
    r"""to_folded writes only "\n" between lines; names may hold \u2028, \x85, \x0b, \x1c, which
    str.splitlines also breaks at, so parse_folded lost such stacks (a symbol or a fuzzed frame name)."""
    name = "a\u2028b\x85c\x0bd\x1ce\u2029f"
    stacks = {(FrameKey("main"), FrameKey(name)): 5, (FrameKey("main"),): 2}
    assert parse_folded(to_folded(stacks)) == stacks


def test_a_profile_as_deep_as_ingest_allows_is_served_as_json(collector: RunningCollector) -> None:
    """json.dumps recursed into the call tree: a stack over ~500 frames (ingest takes 4096) made
    /api/v1/profile?format=json a 500 (found by tests/wire/test_fuzz_ingest.py); it is written iteratively."""
    b = BatchBuilder()
    frames = [(f"recurse_{i}", "app") for i in range(MAX_STACK_DEPTH)]
    b.sample(b.process(7, "deep"), b.stack(frames), 9)
    assert push(collector.grpc_target, [b.build()]) == [1]
    for max_nodes in ("2048", "1000000"):
        query = urllib.parse.urlencode({"since": "10m", "max_nodes": max_nodes})
        body = deep_json(http_get(f"{collector.url}/api/v1/profile?{query}"))
        node, depth = body["root"], 0
        while node["children"]:
            node, depth = node["children"][0], depth + 1
        assert (body["total"], node["self"]) == (9, 9)
        assert depth == min(MAX_STACK_DEPTH, int(max_nodes))


def deep_json(text: bytes) -> dict:
    """json.loads of a call tree as deep as the deepest stack: Python's decoder recurses too."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * MAX_STACK_DEPTH))
    try:
        return json.loads(text)
    finally:
        sys.setrecursionlimit(limit)


def test_tree_json_text_is_json_dumps_of_the_tree() -> None:
    stacks = {
        (FrameKey("main"), FrameKey('a;\u2028"')): 3,
        (FrameKey("main"), FrameKey("b", "m", True)): 1,
        (): 2,
    }
    body = {**to_json(stacks, 7, 99), "from": 1.5, "until": 2.0, "query": '{a="\\"}'}
    assert tree_json_text(body) == json.dumps(body, separators=(",", ":"))


def test_the_collector_still_answers_after_the_fuzzing(fed_collector: RunningCollector) -> None:
    """Run after the fuzz test (file order): no handler is left running or holding a worker."""
    for fmt in ("json", "svg", "pprof"):
        status, _, body = _get(fed_collector.collector.http_port, f"/api/v1/profile?format={fmt}&since=10m")
        assert status == 200, body[:500]
