"""The codec never raises on client input and always answers in spec shape."""

from __future__ import annotations

import json

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiplexer.core.json_codec import dumps, loads
from multiplexer.core.jsonrpc import decode, split_meta
from multiplexer.faces.rpc import handle_body
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway

CONFIG = parse_config({
    "providers": {"b": {"kind": "echo", "batch": {"max_items": 50}}},
    "routes": {"echo": {"provider": "b"}, "sum": {"provider": "b", "dedup": True}},
    "server": {"max_batch_items": 20, "max_json_depth": 16},
})

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                     allow_infinity=False) | st.text()
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=5), c, max_size=4), max_leaves=12)
requests = st.fixed_dictionaries(
    {},
    optional={
        "jsonrpc": st.sampled_from(["2.0", "2.0", "1.0", 2]),
        "method": st.sampled_from(["echo", "sum", "nope", 3]) | st.text(max_size=5),
        "params": json_values | st.fixed_dictionaries(
            {"values": st.lists(st.integers(), max_size=3)},
            optional={"_meta": st.dictionaries(st.sampled_from(
                ["priority", "timeout_ms", "idempotency_key", "x"]), json_scalars)}),
        "id": st.none() | st.integers() | st.text(max_size=4) | st.booleans() | st.lists(
            st.integers(), max_size=1),
    },
)
bodies = (
    st.binary(max_size=200)
    | requests.map(lambda r: json.dumps(r).encode())
    | st.lists(requests | json_values, max_size=25).map(lambda r: json.dumps(r).encode())
)


def check_response(obj: object) -> None:
    assert isinstance(obj, dict) and obj["jsonrpc"] == "2.0" and "id" in obj
    assert ("result" in obj) != ("error" in obj)
    if "error" in obj:
        err = obj["error"]
        assert isinstance(err["code"], int) and isinstance(err["message"], str)


@given(body=bodies)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_bytes_give_a_spec_shaped_reply_or_none(body: bytes) -> None:
    async def go() -> bytes | None:
        async with Gateway(CONFIG) as gw:
            return await handle_body(gw, body)

    reply = anyio.run(go)
    decoded = decode(body, max_items=20, max_depth=16)
    if reply is None:
        assert (all(e.is_notification for e in decoded.entries) and decoded.batch) or (
            not decoded.batch and decoded.entries[0].is_notification)
        return
    obj = json.loads(reply)
    if isinstance(obj, list):
        assert decoded.batch and obj
        replies = [e for e in decoded.entries if not e.is_notification]
        assert [o["id"] for o in obj] == [e.id for e in replies]
        for o in obj:
            check_response(o)
    else:
        check_response(obj)


def test_meta_is_split_from_named_params_only() -> None:
    assert split_meta({"a": 1, "_meta": {"priority": 2}}) == ({"a": 1}, {"priority": 2})
    assert split_meta([1, {"_meta": 1}]) == ([1, {"_meta": 1}], {})


def test_batch_limit_and_depth_limit() -> None:
    big = json.dumps([{"jsonrpc": "2.0", "method": "echo", "id": i} for i in range(21)]).encode()
    d = decode(big, max_items=20)
    assert not d.batch and d.entries[0].error.code == -32600
    assert d.entries[0].error.data["max_batch_items"] == 20
    assert decode(b"[" * 5000 + b"]" * 5000).entries[0].error.code in (-32600, -32700)
    assert decode(b'{"id": 1e999}').entries[0].error.code == -32700
    assert decode(b'{"id": NaN}').entries[0].error.code == -32700


@pytest.mark.parametrize("meta,ok", [
    ({"priority": 3}, True), ({"priority": True}, False), ({"timeout_ms": 0}, False),
    ({"timeout_ms": 10.5}, True), ({"idempotency_key": 5}, False), ("x", False),
])
def test_meta_validation(meta: object, ok: bool) -> None:
    body = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": {"_meta": meta}, "id": 1})
    entry = decode(body.encode()).entries[0]
    assert (entry.error is None) == ok
    if not ok:
        assert entry.error.code == -32602 and entry.id == 1


def test_depth_limit_is_exact_at_its_boundary() -> None:
    """Nesting of exactly ``max_depth`` levels passes and one more is refused, with or without
    brackets inside strings (the decoder skips its walk when the body holds too few brackets)."""
    def nested(levels: int, text: str = "x") -> bytes:  # the string ``levels`` levels down
        inner: object = text
        for _ in range(levels - 3):
            inner = [inner]
        return json.dumps({"jsonrpc": "2.0", "method": "echo", "params": {"a": inner}, "id": 1}).encode()

    for text in ("x", "[[[{{{" * 10):
        assert decode(nested(16, text), max_depth=16).entries[0].error is None
        assert decode(nested(17, text), max_depth=16).entries[0].error.code == -32600
    assert decode(nested(3), max_depth=2).entries[0].error.code == -32600


@pytest.mark.parametrize("body", [
    b'{"a": [1, 2.5, -0, "\\u00e9", null, true]}', '{"a": "é"}', '"é"'.encode("utf-16"),
    '[1]'.encode("utf-32"), b'\xef\xbb\xbf{"b": 1}', b'"\\ud800"', bytearray(b"[3]"),
    b"123456789012345678901234567890",
])
def test_loads_reads_what_json_loads_reads(body: bytes | str) -> None:
    assert loads(body) == json.loads(body)


@pytest.mark.parametrize("body", [b"NaN", b"[Infinity]", b'{"x": -Infinity}', b"1e400", b"[-1e400]"])
def test_loads_refuses_what_json_is_not(body: bytes) -> None:
    with pytest.raises(ValueError, match=r"not valid JSON|out of range"):
        loads(body)


def test_loads_refuses_a_bom_in_text_and_a_trailing_comma() -> None:
    with pytest.raises(json.JSONDecodeError, match="BOM"):
        loads("\ufeff{}")
    with pytest.raises(json.JSONDecodeError, match="Expecting value"):
        loads(b"[1,]")


def test_dumps_escapes_a_lone_surrogate_and_refuses_nan() -> None:
    assert dumps({"a": "é", "b": "\ud800"}) == b'{"a":"\\u00e9","b":"\\ud800"}'
    assert dumps({"a": "é", "b": [1, 2.5]}) == '{"a":"é","b":[1,2.5]}'.encode()
    with pytest.raises(ValueError):
        dumps([float("nan")])
