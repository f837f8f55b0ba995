"""Merged stacks as a pprof profile (the public profile.proto message), encoded by hand.

Only the wire format's two field kinds that profile.proto needs are written: varints (wire type 0) and
length-delimited bytes (wire type 2: strings, embedded messages, packed repeated integers). Field numbers
follow github.com/google/pprof/proto/profile.proto.
"""

from __future__ import annotations

import gzip

from fleetprof.collector.model.profile import FrameKey, Stacks
from fleetprof.collector.model.rows import period_ns
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import UNKNOWN_FRAME

KERNEL_FILE = "[kernel.kallsyms]"

# Profile fields
_SAMPLE_TYPE, _SAMPLE, _LOCATION, _FUNCTION, _STRING_TABLE = 1, 2, 4, 5, 6
_TIME_NANOS, _DURATION_NANOS, _PERIOD_TYPE, _PERIOD, _COMMENT, _DEFAULT_SAMPLE_TYPE = 9, 10, 11, 12, 13, 14
# Sample: location_id = 1 (leaf first), value = 2. Location: id = 1, line = 4. Line: function_id = 1.
# Function: id = 1, name = 2, system_name = 3, filename = 4. ValueType: type = 1, unit = 2.


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _int64(value: int) -> int:
    """`value` clamped to profile.proto's int64 (counts × period past 2**63)."""
    return min(max(value, _INT64_MIN), _INT64_MAX)


def _nanos(seconds: float) -> int:
    """Seconds as int64 nanoseconds, clamped: a time before 1678 or after 2262 (or a span longer) is past
    them, and a far enough one is infinite as a float."""
    ns = seconds * 1e9
    return _INT64_MAX if ns >= _INT64_MAX else _INT64_MIN if ns <= _INT64_MIN else int(ns)


def _varint(value: int) -> bytes:
    if not _INT64_MIN <= value < 1 << 64:
        raise ValueError(f"{value} does not fit a 64-bit varint")  # and would never end the loop below
    if value < 0:
        value += 1 << 64  # int64 negatives are ten-byte two's complement varints
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    """A varint field; zero is the default and is left out, as proto3 encoders do."""
    return _varint(number << 3) + _varint(value) if value else b""


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _packed(number: int, values: list[int]) -> bytes:
    return _bytes_field(number, b"".join(_varint(v) for v in values)) if values else b""


class _Strings:
    """The profile's string table; index 0 must be the empty string."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        return self.index.setdefault(text, len(self.index))


def pprof_message(
    stacks: Stacks,
    frequency_hz: int | None,
    start_s: float | None = None,
    end_s: float | None = None,
    comments: tuple[str, ...] = (),
    nanoseconds: str | None = None,
    names: Names = as_stored,
) -> bytes:
    """A profile.proto Profile, serialized: one sample per stack, values [samples, cpu nanoseconds].

    The period is one sampling interval (1e9 / frequency ns), so cpu = samples × period. Without a known
    frequency only the sample count is written. Kernel frames get the file "[kernel.kallsyms]". A function's
    name is the shown (demangled) one and its system_name the raw one, as the agent sent it.
    With `nanoseconds` (a sample type's name: "offcpu", "wall"), the counts are nanoseconds already and
    are written as the one sample type (`nanoseconds`, nanoseconds).
    """
    string = _Strings()
    if nanoseconds:
        period, value_types = 0, [(nanoseconds, "nanoseconds")]
    else:
        period = period_ns(frequency_hz)
        value_types = [("samples", "count")] + ([("cpu", "nanoseconds")] if period else [])
    out = bytearray()
    for kind, unit in value_types:
        out += _bytes_field(_SAMPLE_TYPE, _int_field(1, string(kind)) + _int_field(2, string(unit)))

    location_ids: dict[FrameKey, int] = {}
    functions = bytearray()
    locations = bytearray()

    def location_of(frame: FrameKey) -> int:
        loc = location_ids.get(frame)
        if loc is None:
            loc = location_ids[frame] = len(location_ids) + 1
            name = string(names(frame.function) or UNKNOWN_FRAME)
            system_name = string(frame.function or UNKNOWN_FRAME)
            filename = string(frame.module or (KERNEL_FILE if frame.kernel else ""))
            # Function and location ids are the same number: one function per distinct frame.
            function = (
                _int_field(1, loc)
                + _int_field(2, name)
                + _int_field(3, system_name)
                + _int_field(4, filename)
            )
            functions.extend(_bytes_field(_FUNCTION, function))
            line = _bytes_field(4, _int_field(1, loc))
            locations.extend(_bytes_field(_LOCATION, _int_field(1, loc) + line))
        return loc

    unknown = (FrameKey(UNKNOWN_FRAME),)
    for stack, count in stacks.items():
        if count <= 0:
            continue
        leaf_first = [location_of(f) for f in reversed(stack or unknown)]
        values = [count] + ([_int64(count * period)] if period else [])
        out += _bytes_field(_SAMPLE, _packed(1, leaf_first) + _packed(2, values))
    out += locations
    out += functions
    if start_s is not None:
        out += _int_field(_TIME_NANOS, _nanos(start_s))
        if end_s is not None:
            out += _int_field(_DURATION_NANOS, _nanos(end_s - start_s))
    kind, unit = value_types[-1]
    out += _bytes_field(_PERIOD_TYPE, _int_field(1, string(kind)) + _int_field(2, string(unit)))
    out += _int_field(_PERIOD, period or 1)
    comment_ids = [string(c) for c in comments]
    out += _packed(_COMMENT, comment_ids)
    out += _int_field(_DEFAULT_SAMPLE_TYPE, string(kind))
    # The string table goes last so every string used above is already in it.
    for text in string.index:
        out += _bytes_field(_STRING_TABLE, text.encode("utf-8", "replace"))
    return bytes(out)


def to_pprof(
    stacks: Stacks,
    frequency_hz: int | None,
    start_s: float | None = None,
    end_s: float | None = None,
    comments: tuple[str, ...] = (),
    nanoseconds: str | None = None,
    names: Names = as_stored,
) -> bytes:
    """pprof_message() gzipped: a profile.pb.gz as `go tool pprof` reads it."""
    message = pprof_message(stacks, frequency_hz, start_s, end_s, comments, nanoseconds, names)
    return gzip.compress(message, mtime=0)
