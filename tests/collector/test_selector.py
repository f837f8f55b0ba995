"""Tests for collector.query.selector: parsing, matching and printing PromQL-style label selectors."""

from __future__ import annotations

import random

import pytest

from fleetprof.collector.model.selector import Matcher, Selector, SelectorError, quote
from fleetprof.collector.query.selector import parse_selector


def _triples(selector: Selector) -> list[tuple[str, str, str]]:
    return [(m.name, m.op, m.value) for m in selector.matchers]


# --- what parses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\t\n", "{}", " { } ", "{\n}"])
def test_empty_forms_select_everything(text: str) -> None:
    selector = parse_selector(text)
    assert selector.matchers == ()
    assert selector.matches({}) and selector.matches({"pod": "x"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{pod="a"}', [("pod", "=", "a")]),
        ('{pod!="a"}', [("pod", "!=", "a")]),
        ('{pod=~"a.*"}', [("pod", "=~", "a.*")]),
        ('{pod!~"a.*"}', [("pod", "!~", "a.*")]),
        ('{namespace="ml",pod=~"trainer-.*"}', [("namespace", "=", "ml"), ("pod", "=~", "trainer-.*")]),
        ('{ namespace = "ml" , pod =~ "t" }', [("namespace", "=", "ml"), ("pod", "=~", "t")]),
        ('{\n  a="1",\n  b="2",\n}', [("a", "=", "1"), ("b", "=", "2")]),
        ('{a="1",}', [("a", "=", "1")]),
        ('{a="1" , }', [("a", "=", "1")]),
        ('  {a="1"}  ', [("a", "=", "1")]),
        ('{_x9="1", __name__="cpu"}', [("_x9", "=", "1"), ("__name__", "=", "cpu")]),
        ('{a=""}', [("a", "=", "")]),
        ('{a="1", a="2"}', [("a", "=", "1"), ("a", "=", "2")]),
        ('{a="}{,=~"}', [("a", "=", "}{,=~")]),
    ],
)
def test_well_formed_selectors_parse_into_matchers_in_order(text: str, expected: list) -> None:
    assert _triples(parse_selector(text)) == expected


@pytest.mark.parametrize(
    ("literal", "value"),
    [
        (r'"a\"b"', 'a"b'),
        (r'"a\\b"', "a\\b"),
        (r'"a\nb"', "a\nb"),
        (r'"a\tb"', "a\tb"),
        (r'"\r\a\b\f\v"', "\r\a\b\f\v"),
        (r'"\u00e9"', "é"),
        (r'"\U0001F600"', "\U0001f600"),
        (r'"\x41"', "A"),
        (r'"\101"', "A"),
        (r'"\xc3\xa9"', "é"),  # \x escapes are bytes, which together may spell UTF-8 (Go semantics)
        (r'"\303\251"', "é"),
        ('"é 漢字"', "é 漢字"),
        (r"'it\'s'", "it's"),
        (r"'a\nb'", "a\nb"),
        ("'a\"b'", 'a"b'),
        ('"a\'b"', "a'b"),
        (r"`raw\n\d+`", r"raw\n\d+"),
        ("`multi\nline`", "multi\nline"),
        ("`has \"quotes\" and 'ticks'`", "has \"quotes\" and 'ticks'"),
        ("``", ""),
    ],
)
def test_string_literals_follow_go_escaping_rules(literal: str, value: str) -> None:
    assert parse_selector("{a=" + literal + "}").matchers[0].value == value


# --- what does not parse, and where --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "position", "fragment"),
    [
        ('{namespace="x", pod}', 19, 'expected "=", "!=", "=~" or "!~" after label name "pod"'),
        ('{pod "x"}', 5, 'expected "=", "!=", "=~" or "!~" after label name "pod"'),
        ('{pod=="x"}', 5, 'expected a quoted value after "pod="'),
        ("{pod=x}", 5, 'expected a quoted value after "pod="'),
        ("{pod=}", 5, 'expected a quoted value after "pod="'),
        ('{pod~"x"}', 4, 'after label name "pod"'),
        ('{pod<>"x"}', 4, 'after label name "pod"'),
        ('{a="1"', 6, 'missing closing "}"'),
        ('{a="1",', 7, 'missing closing "}"'),
        ("{", 1, 'missing closing "}"'),
        ('{a="1" b="2"}', 7, 'expected "," or "}" after the value of label "a"'),
        ('{a="1"} junk', 8, 'unexpected text after "}"'),
        ('{a="1"}}', 7, 'unexpected text after "}"'),
        ('{a="1"},{b="2"}', 7, 'unexpected text after "}"'),
        ('cpu{a="1"}', 0, "a metric name before"),
        ("cpu", 0, "a metric name before"),
        ('  node_cpu{a="1"}', 2, "a metric name before"),
        ('a="1"', 0, "a metric name before"),
        ('(a="1")', 0, 'expected "{"'),
        ("{,}", 1, 'expected label name or "}"'),
        ('{a="1",,}', 7, 'expected label name or "}"'),
        ('{9a="1"}', 1, 'expected label name or "}"'),
        ('{"a"="1"}', 1, 'expected label name or "}"'),
        ('{a-b="1"}', 2, 'after label name "a"'),
        ('{a="unterminated}', 3, 'unterminated string (missing closing ")'),
        ("{a='unterminated}", 3, "unterminated string (missing closing ')"),
        ("{a=`unterminated}", 3, "unterminated raw string"),
        ('{a="line\nbreak"}', 3, "unterminated string"),
        ('{a="ends in backslash\\', 3, "unterminated string"),
        (r'{a="\q"}', 4, r"unknown escape sequence \q"),
        (r"{a='\"'}", 4, r"unknown escape sequence \""),
        (r'{a="\'"}', 4, r"unknown escape sequence \'"),
        (r'{a="\x4"}', 4, r"\x needs exactly 2 hex digits"),
        (r'{a="\xzz"}', 4, r"\x needs exactly 2 hex digits"),
        (r'{a="\u12"}', 4, r"\u needs exactly 4 hex digits"),
        (r'{a="\U0011FFFF"}', 4, "not a valid Unicode code point"),
        (r'{a="\uD800"}', 4, "not a valid Unicode code point"),
        (r'{a="\400"}', 4, "octal escape"),
        (r'{a="\12"}', 4, "octal escape"),
        (r'{a="\xff"}', 3, "not valid UTF-8"),
        ('{pod=~"a("}', 6, 'invalid regex "a(" for label "pod": missing ): a('),
        ('{x="1", pod!~"[z-a]"}', 13, 'invalid regex "[z-a]" for label "pod"'),
        (r'{pod=~"(a)\\1"}', 6, "invalid escape sequence: \\1 (regexes use RE2 syntax"),
        ('{pod=~"(?=a)"}', 6, "invalid perl operator: (?="),
    ],
)
def test_malformed_selectors_raise_with_reason_and_position(text: str, position: int, fragment: str) -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    assert caught.value.position == position
    message = str(caught.value)
    assert message.startswith(f"bad selector at position {position}: ")
    assert fragment in message


def test_error_names_what_was_found_instead() -> None:
    with pytest.raises(SelectorError, match=r"found end of text"):
        parse_selector("{pod")
    with pytest.raises(SelectorError, match=r"found '\+'"):
        parse_selector('{pod+"x"}')


def test_selector_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_selector("{")


# --- matching ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "labels", "selected"),
    [
        ('{pod="a"}', {"pod": "a"}, True),
        ('{pod="a"}', {"pod": "ab"}, False),
        ('{pod!="a"}', {"pod": "b"}, True),
        ('{pod!="a"}', {"pod": "a"}, False),
        ('{pod!="a"}', {}, True),
        ('{pod=""}', {}, True),
        ('{pod=""}', {"pod": "x"}, False),
        ('{pod!=""}', {}, False),
        ('{pod!=""}', {"pod": "x"}, True),
        ('{pod=~"train.*"}', {"pod": "trainer-0"}, True),
        ('{pod=~"train"}', {"pod": "trainer-0"}, False),  # anchored: must match the whole value
        ('{pod=~"rain.*"}', {"pod": "trainer-0"}, False),
        ('{pod=~"a|b"}', {"pod": "b"}, True),
        ('{pod=~"a|b"}', {"pod": "ab"}, False),  # anchoring wraps the alternation, not one branch
        ('{pod=~".*"}', {}, True),
        ('{pod=~".+"}', {}, False),
        ('{pod!~".+"}', {}, True),
        ('{pod!~"train.*"}', {"pod": "trainer-0"}, False),
        ('{pod!~"train.*"}', {"pod": "loader"}, True),
        ('{pod=~"a.b"}', {"pod": "a\nb"}, True),  # "." matches newline, as in Prometheus
        ('{ns="ml", pod=~"t.*"}', {"ns": "ml", "pod": "t1"}, True),
        ('{ns="ml", pod=~"t.*"}', {"ns": "web", "pod": "t1"}, False),
        ('{a="1", a!="1"}', {"a": "1"}, False),
    ],
)
def test_selector_matches_label_sets_with_promql_semantics(text: str, labels: dict, selected: bool) -> None:
    assert parse_selector(text).matches(labels) is selected


def test_matcher_can_be_built_directly_and_compiles_its_regex() -> None:
    matcher = Matcher("pod", "=~", "x|y")
    assert matcher.matches("y") and not matcher.matches("xy")
    assert matcher.regex is not None


@pytest.mark.parametrize(
    ("name", "op", "value", "fragment"),
    [
        ("pod", "==", "x", 'invalid operator "=="'),
        ("1pod", "=", "x", 'invalid label name "1pod"'),
        ("", "=", "x", 'invalid label name ""'),
        ("pod", "=~", "(", 'invalid regex "(" for label "pod"'),
    ],
)
def test_invalid_direct_matchers_raise_selector_error_without_position(
    name: str, op: str, value: str, fragment: str
) -> None:
    with pytest.raises(SelectorError) as caught:
        Matcher(name, op, value)
    assert caught.value.position is None
    assert str(caught.value).startswith("bad selector: ")
    assert fragment in str(caught.value)


def test_equal_matchers_compare_and_hash_alike_regardless_of_compiled_regex() -> None:
    assert Matcher("a", "=~", "x.*") == Matcher("a", "=~", "x.*")
    assert hash(parse_selector('{a=~"x.*"}')) == hash(parse_selector("{ a =~ `x.*` }"))
    assert Matcher("a", "=~", "x") != Matcher("a", "!~", "x")


# --- printing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("", "{}"),
        ('{ pod = "a" }', '{pod="a"}'),
        ("{a='1',b=`2`,}", '{a="1", b="2"}'),
        ('{a=~"x.*",b!~"y",c!="z"}', '{a=~"x.*", b!~"y", c!="z"}'),
        (r'{a="q\"b\\s\nt\tr\r"}', r'{a="q\"b\\s\nt\tr\r"}'),
        (r'{a="\x01\x7f"}', r'{a="\x01\x7f"}'),
        (r"{a=`\d+`}", r'{a="\\d+"}'),
        (r'{a="\u00e9"}', '{a="é"}'),
    ],
)
def test_str_prints_canonical_text(text: str, canonical: str) -> None:
    assert str(parse_selector(text)) == canonical


@pytest.mark.parametrize(
    "text",
    [
        '{pod="a"}',
        "{a='it\\'s', b=`C:\\path`}",
        '{a="\\u0000\\x1f tab\\t nl\\n quote\\" backslash\\\\"}',
        '{a=~"^(x|y)$\\\\.*", b!~"[\\"]"}',
        '{a="漢字 é 😀"}',
    ],
)
def test_str_round_trips_through_parse(text: str) -> None:
    selector = parse_selector(text)
    assert parse_selector(str(selector)) == selector


def test_str_round_trips_random_values() -> None:
    # Fixed seed: deterministic, but covers control characters, quotes and backslashes together.
    rng = random.Random(1234)
    alphabet = [
        '"',
        "'",
        "`",
        "\\",
        "\n",
        "\t",
        "\r",
        "\x00",
        "\x7f",
        "{",
        "}",
        ",",
        "=",
        "~",
        "a",
        "é",
        "😀",
    ]
    for _ in range(300):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        selector = Selector((Matcher("v", "=", value), Matcher("w", "!=", value)))
        assert parse_selector(str(selector)) == selector


def test_quote_escapes_only_what_it_must() -> None:
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert quote("plain é") == '"plain é"'


def test_a_regex_that_backtracks_exponentially_elsewhere_is_answered_at_once() -> None:
    # Python's re would try ~2**62 ways to split the a's before saying no; RE2 reads the value once. The
    # test finishing at all is the check (no clock asserted).
    selector = parse_selector('{node=~"(a+)+b"}')
    assert not selector.matches({"node": "a" * 62})
    assert selector.matches({"node": "a" * 61 + "b"})
