"""Parse PromQL-style label selector text such as {namespace="ml", pod=~"trainer-.*"} into a Selector."""

from __future__ import annotations

from types import MappingProxyType

from fleetprof.collector.model.selector import LABEL_NAME, Matcher, Selector, SelectorError, quoted_operators

_WHITESPACE = " \t\r\n"
# Two-character operators first, so "=~" is not read as "=" followed by a stray "~".
_OPERATOR_TOKENS = ("=~", "!=", "!~", "=")
_SIMPLE_ESCAPES = MappingProxyType(
    {"a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "\\": 0x5C}
)
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCTAL_DIGITS = frozenset("01234567")
# \x and octal escapes give raw bytes (Go semantics), \u and \U give code points.
_ESCAPE_LENGTHS = MappingProxyType({"x": 2, "u": 4, "U": 8})


def parse_selector(text: str) -> Selector:
    """Parse ``{name op "value", ...}``; empty or whitespace-only text selects everything."""
    return _Parser(text).parse()


class _Parser:
    """Hand-written parser over one selector text; its only state is the cursor."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> Selector:
        self._skip_space()
        if self._at_end():
            return Selector()
        if LABEL_NAME.match(self.text, self.pos):
            raise SelectorError(
                'a metric name before "{" is not supported; write only the braces, e.g. {pod="x"}',
                self.pos,
            )
        if self.text[self.pos] != "{":
            raise self._expected('"{"')
        self.pos += 1
        matchers: list[Matcher] = []
        while True:
            self._skip_space()
            if self._at_end():
                raise SelectorError('missing closing "}"', self.pos)
            if self.text[self.pos] == "}":
                self.pos += 1
                break
            matchers.append(self._matcher())
            self._skip_space()
            if self._at_end():
                raise SelectorError('missing closing "}"', self.pos)
            if self.text[self.pos] == ",":
                self.pos += 1  # a trailing comma before "}" is allowed, as in PromQL
            elif self.text[self.pos] != "}":
                raise self._expected(f'"," or "}}" after the value of label "{matchers[-1].name}"')
        self._skip_space()
        if not self._at_end():
            raise SelectorError(f'unexpected text after "}}": {self.text[self.pos :]!r}', self.pos)
        return Selector(tuple(matchers))

    def _matcher(self) -> Matcher:
        name_match = LABEL_NAME.match(self.text, self.pos)
        if name_match is None:
            raise self._expected('label name or "}"')
        name = name_match.group()
        self.pos = name_match.end()
        self._skip_space()
        op = next((token for token in _OPERATOR_TOKENS if self.text.startswith(token, self.pos)), None)
        if op is None:
            raise self._expected(f'{quoted_operators()} after label name "{name}"')
        self.pos += len(op)
        self._skip_space()
        value_start = self.pos
        value = self._string(f'a quoted value after "{name}{op}"')
        try:
            return Matcher(name, op, value)
        except SelectorError as err:
            raise SelectorError(err.reason, value_start) from None

    def _string(self, what: str) -> str:
        if self._at_end() or self.text[self.pos] not in "\"'`":
            raise self._expected(what)
        start = self.pos
        quote_char = self.text[start]
        self.pos += 1
        if quote_char == "`":
            end = self.text.find("`", self.pos)
            if end < 0:
                raise SelectorError("unterminated raw string (missing closing `)", start)
            self.pos = end + 1
            return self.text[start + 1 : end]
        return self._interpreted_string(quote_char, start)

    def _interpreted_string(self, quote_char: str, start: int) -> str:
        # Build bytes, since Go's \x and octal escapes are bytes that may form UTF-8 together.
        out = bytearray()
        while True:
            if self._at_end() or self.text[self.pos] == "\n":
                raise SelectorError(f"unterminated string (missing closing {quote_char})", start)
            char = self.text[self.pos]
            if char == quote_char:
                self.pos += 1
                break
            if char == "\\":
                self._escape(quote_char, start, out)
            else:
                out += char.encode("utf-8", "surrogatepass")
                self.pos += 1
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            raise SelectorError(
                "string is not valid UTF-8 (check its \\x and octal escapes)", start
            ) from None

    def _escape(self, quote_char: str, string_start: int, out: bytearray) -> None:
        escape_start = self.pos
        self.pos += 1
        if self._at_end():
            raise SelectorError(f"unterminated string (missing closing {quote_char})", string_start)
        kind = self.text[self.pos]
        self.pos += 1
        if kind == quote_char:
            out += kind.encode()
        elif kind in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[kind])
        elif kind in _ESCAPE_LENGTHS:
            digits = self.text[self.pos : self.pos + _ESCAPE_LENGTHS[kind]]
            if len(digits) != _ESCAPE_LENGTHS[kind] or not set(digits) <= _HEX_DIGITS:
                raise SelectorError(
                    f"\\{kind} needs exactly {_ESCAPE_LENGTHS[kind]} hex digits", escape_start
                )
            self.pos += len(digits)
            number = int(digits, 16)
            if kind == "x":
                out.append(number)
            elif number > 0x10FFFF or 0xD800 <= number <= 0xDFFF:
                raise SelectorError(f"\\{kind}{digits} is not a valid Unicode code point", escape_start)
            else:
                out += chr(number).encode("utf-8")
        elif kind in _OCTAL_DIGITS:
            digits = self.text[self.pos - 1 : self.pos + 2]
            if len(digits) != 3 or not set(digits) <= _OCTAL_DIGITS or int(digits, 8) > 0xFF:
                raise SelectorError("octal escape needs exactly 3 digits, at most \\377", escape_start)
            self.pos += 2
            out.append(int(digits, 8))
        else:
            raise SelectorError(f"unknown escape sequence \\{kind}", escape_start)

    def _expected(self, what: str) -> SelectorError:
        found = "end of text" if self._at_end() else repr(self.text[self.pos])
        return SelectorError(f"expected {what}, found {found}", self.pos)

    def _skip_space(self) -> None:
        while not self._at_end() and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def _at_end(self) -> bool:
        return self.pos >= len(self.text)
