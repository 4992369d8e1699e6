"""The JSON codec (orjson where it agrees) reads, refuses and writes exactly what the stdlib did.

``stdlib_loads`` and ``stdlib_dumps`` are the codec as it was before orjson, kept here as the
reference; ``json.loads`` is the reference for an upstream's replies.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.json_codec import dumps, loads, loads_lenient
from multiplexer.core.jsonrpc import decode
from multiplexer.faces.v1.common import V1, HttpError
from providers.api_client import decode_body
from tests.fuzz_budget import examples


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def stdlib_loads(body: bytes | str) -> Any:
    if isinstance(body, str):
        if body.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", body, 0)
    else:
        body = body.decode(json.detect_encoding(body), "surrogatepass")
    return json.JSONDecoder(parse_float=_finite_float, parse_constant=_reject_constant).decode(body)


def stdlib_dumps(obj: Any) -> bytes:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def exact(value: Any) -> Any:
    """``value`` with every type, key order, float sign and NaN made comparable by ``==``."""
    if isinstance(value, dict):
        return ("dict", [(k, exact(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [exact(v) for v in value])
    if isinstance(value, float):
        return ("float", "nan" if value != value else value.hex())
    return (type(value).__name__, value)


def outcome(fn: Callable[[Any], Any], arg: Any) -> Any:
    """What ``fn(arg)`` gives: its value exactly, or its exception's type and message."""
    try:
        return ("ok", exact(fn(arg)))
    except (ValueError, TypeError, RecursionError) as e:
        return ("raises", type(e), str(e))


# -- reading ------------------------------------------------------------------------------------

TOKENS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"u", b"d800", b"dc00", b"00e9", b"0",
          b"1", b"-", b".", b"e", b"E", b"+", b"9" * 19, b"18446744073709551616", b"1e400", b"a",
          b" ", b"\t", b"\n", b"\x0b", b"\x0c", b"\x00", b"\x1f", b"\x7f", b"\xc3\xa9", b"\xed\xa0\x80",
          b"\xff", b"\xef\xbb\xbf", b"true", b"null", b"NaN", b"Infinity", b"/", b"n", b'"k"', b'"k":1']
json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | st.text(),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
    max_leaves=12,
).map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))
bodies = (st.binary(max_size=60) | st.lists(st.sampled_from(TOKENS), max_size=12).map(b"".join)
          | json_texts)


@given(body=bodies)
@settings(max_examples=examples(2000), deadline=None, suppress_health_check=list(HealthCheck))
def test_loads_reads_and_refuses_what_the_stdlib_did(body: bytes) -> None:
    assert outcome(loads, body) == outcome(stdlib_loads, body)
    assert outcome(loads_lenient, body) == outcome(json.loads, body)
    try:
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return
    assert outcome(loads, text) == outcome(stdlib_loads, text)
    assert outcome(loads_lenient, text) == outcome(json.loads, text)


EDGES: list[bytes | str | bytearray] = [
    b"NaN", b"[Infinity]", b'{"x": -Infinity}', b"1e400", b"[-1e400]", b"1e-400", b"-1e-400",
    b"18446744073709551615", b"18446744073709551616", b"-9223372036854775808",
    b"-9223372036854775809", b"123456789012345678901234567890", b"[1.5, 12345678901234567890]",
    b"9" * 5000, b"-0", b"-0.0", b"1E2", b'"\\ud800"', b'"\\udc00\\ud800x"', b'{"\\ud800": 1}',
    b'{"a": 1, "b": 2, "a": 3}', b'\xef\xbb\xbf{"b": 1}', "\ufeff{}", b'"\xed\xa0\x80"', b'"\xff"',
    '"é"'.encode("utf-16"), "[1]".encode("utf-32"), "[1]".encode("utf-16-le"), b"[1,]", b"", b" ",
    b'"a\x01"', b'"\\u0000"', b"[1] [2]", b"\x0c{}", b"01", b".5", b"1.", b"+1", bytearray(b"[3]"),
    '{"a": "é"}', '"\ud800"', "[1e400]",
]


@pytest.mark.parametrize("body", EDGES, ids=range(len(EDGES)))
def test_loads_reads_each_edge_as_the_stdlib_did(body: bytes | str) -> None:
    assert outcome(loads, body) == outcome(stdlib_loads, body)
    assert outcome(loads_lenient, body) == outcome(json.loads, body)


def test_the_stdlibs_answers_at_the_edges_are_pinned() -> None:
    assert loads(b"18446744073709551616") == 18446744073709551616
    assert type(loads(b"[-9223372036854775809]")[0]) is int
    assert loads(b'"\\ud800"') == "\ud800"
    assert list(loads(b'{"a": 1, "b": 2, "a": 3}').items()) == [("a", 3), ("b", 2)]
    assert loads(b'\xef\xbb\xbf{"b": 1}') == {"b": 1}
    for body, message in ((b"NaN", "NaN is not valid JSON"), (b"[1e400]", "number out of range"),
                          (b"[1,]", "Expecting value: line 1 column 4 (char 3)")):
        with pytest.raises(ValueError) as refused:
            loads(body)
        assert str(refused.value) == message
    assert math.isnan(loads_lenient(b"[NaN]")[0]) and loads_lenient(b"-Infinity") == -math.inf
    assert loads_lenient(b"1e400") == math.inf


def nested(depth: int, opener: bytes = b"[") -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    inner = b"1" if opener == b"[" else b'{"a":1}'
    step = b"[" if opener == b"[" else b'{"a":'
    return step * depth + inner + closer * depth


@pytest.mark.parametrize("depth", [10, 799, 800, 801, 900, 1023, 1024, 1025, 3000])
@pytest.mark.parametrize("opener", [b"[", b"{"])
@pytest.mark.parametrize("padding", [0, 20000], ids=["counted", "wrapped"])
def test_deep_bodies_are_read_or_refused_as_the_stdlib_did(depth: int, opener: bytes,
                                                           padding: int) -> None:
    """orjson reads 1024 levels, the stdlib 1000 less the caller's stack: past 800 it decides."""
    body = b" " * padding + nested(depth, opener)
    assert outcome(loads, body) == outcome(stdlib_loads, body)
    assert outcome(loads_lenient, body) == outcome(json.loads, body)


@pytest.mark.parametrize("body", [
    b"1" + b"],[1" * 900, b"[" * 900 + b"1" + b"]" * 899 + b",2]", b"[" * 801 + b"]" * 801,
    b"[" * 900 + b"]" * 900 + b" ", b" " + b"[" * 1000 + b"]" * 1000, b"[]" * 900,
], ids=["closed-early", "two-at-the-top", "empty-801", "trailing-space", "leading-space", "flat"])
def test_a_body_wrapped_to_bound_its_depth_reads_as_itself(body: bytes) -> None:
    assert outcome(loads, body) == outcome(stdlib_loads, body)


@pytest.mark.parametrize("body", [b"", b"{", b"[1,]", b"NaN", b'{"a": 1e400}', b"\xff", b"[" * 3000],
                         ids=range(7))
def test_malformed_bodies_get_the_same_error_on_every_face(body: bytes) -> None:
    try:
        stdlib_loads(body)
    except (ValueError, RecursionError) as e:
        reason = str(e)
    with pytest.raises(HttpError) as v1:
        V1.json_object(body)
    assert v1.value.status == 400
    assert v1.value.error.to_dict() == {"code": Code.INVALID_REQUEST, "message": "Invalid Request",
                                        "data": {"detail": f"the body is not valid JSON ({reason})"}}
    [entry] = decode(body).entries
    assert entry.error is not None
    assert entry.error.to_dict() == {"code": Code.PARSE_ERROR, "message": "Parse error",
                                     "data": {"detail": reason[:200]}}


def test_an_upstream_reply_reads_as_json_loads_read_it() -> None:
    body = decode_body("p", 200, b'{"n": 123456789012345678901, "x": NaN, "s": "\\ud800"}')
    assert body["n"] == 123456789012345678901 and math.isnan(body["x"]) and body["s"] == "\ud800"
    for content in (b"not json", b"[1]"):
        with pytest.raises(RpcError) as refused:
            decode_body("p", 200, content)
        assert refused.value.code == Code.UPSTREAM_ERROR and refused.value.data is not None
        assert refused.value.data["upstream_status"] == 200


# -- writing ------------------------------------------------------------------------------------

class Text(str):
    def __str__(self) -> str:
        return "not this"


class Number(int):
    def __repr__(self) -> str:
        return "not this"


class Real(float):
    pass


class Sorted(dict[Any, Any]):
    def items(self) -> Any:
        return sorted(super().items())


class Items(list[Any]):
    pass


class Level(enum.IntEnum):
    HIGH = 2


class Tone(enum.StrEnum):
    CALM = "calm"


@dataclasses.dataclass
class Point:
    x: int = 1


def deep(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


VALUES: list[Any] = [
    {"a": "é", "b": [1, 2.5, None, True, False]}, {"a": "é", "b": "\ud800"}, {"\udc00": 1},
    "\ud800", 2**64, -(2**63) - 1, 10**30, [2**63, -(2**63)], {1: "a", 2.5: "b", False: 1, None: 2},
    {(1, 2): 3}, (1, (2, 3)), Text("t"), {Text("k"): Number(5)}, Number(7), Real(1.5), Real("nan"),
    Sorted(b=1, a=2), OrderedDict(b=1, a=2), Items([1, 2]), Level.HIGH, Tone.CALM, [Level.HIGH],
    float("nan"), [float("inf")], {"x": None, "y": -math.inf}, {"x": None, "y": [1.5, (math.nan,)]},
    {"x": None}, "null", {"null": "null"}, {1, 2}, b"bytes", object(), Point(),
    datetime.date(2020, 1, 1), deep(300), deep(253), [1e-05, 1e16, 5e-324, 0.1 + 0.2, -0.0, 1e300],
]


def has_float(value: Any) -> bool:
    if isinstance(value, dict):
        return any(has_float(k) or has_float(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_float(v) for v in value)
    return isinstance(value, float)


def same_document(new: Any, old: Any) -> bool:
    """Equal outcomes, except that a float may be spelled another way (``1e-05``, ``0.00001``)."""
    if new[0] == "ok" == old[0]:
        return exact(json.loads(new[1][1])) == exact(json.loads(old[1][1]))
    return bool(new == old)


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_dumps_writes_and_refuses_what_the_stdlib_did(value: Any) -> None:
    new, old = outcome(dumps, value), outcome(stdlib_dumps, value)
    assert same_document(new, old), (new, old)
    if not has_float(value):
        assert new == old


def test_the_stdlibs_writing_is_pinned() -> None:
    assert dumps({"a": "é", "b": [1, 2.5, None]}) == '{"a":"é","b":[1,2.5,null]}'.encode()
    assert dumps({"a": "é", "b": "\ud800"}) == b'{"a":"\\u00e9","b":"\\ud800"}'
    assert dumps([2**64, -(2**63) - 1]) == b"[18446744073709551616,-9223372036854775809]"
    assert dumps({1: "a", None: 2}) == b'{"1":"a","null":2}'
    assert dumps(Sorted(b=1, a=2)) == b'{"a":2,"b":1}'
    assert dumps([Text("t"), Number(7), Level.HIGH, Tone.CALM]) == b'["t",7,2,"calm"]'
    for value in (float("nan"), {"x": None, "y": [math.inf]}, [-math.inf], Real("nan")):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            dumps(value)
    for value, name in (({1, 2}, "set"), (b"x", "bytes"), (Point(), "Point"),
                        (datetime.date(2020, 1, 1), "date")):
        with pytest.raises(TypeError, match=f"Object of type {name} is not JSON serializable"):
            dumps(value)
    with pytest.raises(TypeError, match="keys must be str, int, float, bool or None, not tuple"):
        dumps({(1, 2): 3})


def test_a_float_may_be_spelled_its_shortest_way_and_reads_back_the_same() -> None:
    floats = [1e-05, 1e16, 5e-324, 0.1 + 0.2, -0.0, 1e300, 123456789.123, 2.5e-7]
    assert [exact(f) for f in json.loads(dumps(floats))] == [exact(f) for f in floats]


json_objects = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | st.text(),
    lambda c: st.lists(c, max_size=4) | st.tuples(c) | st.dictionaries(
        st.text(max_size=3) | st.integers() | st.booleans() | st.none(), c, max_size=4),
    max_leaves=12,
)


@given(value=json_objects)
@settings(max_examples=examples(1500), deadline=None, suppress_health_check=list(HealthCheck))
def test_dumps_agrees_with_the_stdlib_on_any_value(value: Any) -> None:
    assert same_document(outcome(dumps, value), outcome(stdlib_dumps, value))
