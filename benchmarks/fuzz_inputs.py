"""Seeded fuzz inputs for ``/rpc``: hostile bodies and headers, by input class.

Case ``i`` of seed ``s`` is generated from its own ``random.Random(f"{s}:{i}")``, so any
failing input is reproduced from two numbers (``RpcFuzzer(s, ...).case(i)``).
``fuzz_mcp`` builds ``/mcp`` cases from the same pieces; ``fuzz_oracle`` judges replies.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

RPC_CLASSES: dict[str, int] = {  # class -> weight
    "valid": 10, "mutated": 30, "malformed_json": 10, "wrong_types": 10, "huge_ids": 7,
    "deep_nesting": 6, "giant_batch": 5, "invalid_utf8": 8, "oversized": 3, "random_bytes": 8,
    "bad_auth": 3,
}
ABSENT = object()


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = 65_536
    max_items: int = 200
    max_depth: int = 64


@dataclass(slots=True)
class Case:
    index: int
    cls: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False


# -- random JSON -------------------------------------------------------------------------
_STRINGS = ["", "a", "ü-ñ-€", "😀", "\u0000", "\ud800", "\udfff x", "\\", '"', "\n\t", "null",
            "2.0", "__proto__", "%s%n", "' OR 1=1 --", "<script>", "A" * 300]


def rand_scalar(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.25:
        return rng.choice([0, 1, -1, 42, 2**31, -(2**63), 2**64 + 1, 10**30, rng.randint(-999, 999)])
    if r < 0.4:
        return rng.choice([0.0, -0.0, 1.5, 1e308, -1e-308, 5e-324, rng.uniform(-1e6, 1e6)])
    if r < 0.75:
        if rng.random() < 0.5:
            return rng.choice(_STRINGS)
        return "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 12)))
    return rng.choice([True, False, None])


def rand_json(rng: random.Random, budget: int = 3) -> Any:
    if budget <= 0 or rng.random() < 0.45:
        return rand_scalar(rng)
    if rng.random() < 0.5:
        return [rand_json(rng, budget - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "b", "x", "_meta", "id", "", "ü"]) + str(rng.randint(0, 9)):
            rand_json(rng, budget - 1) for _ in range(rng.randint(0, 4))}


def dumps(obj: Any) -> bytes:
    """Client-side JSON: ``ensure_ascii`` so lone surrogates go out as valid ``\\ud800`` escapes."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


# -- /rpc generators ------------------------------------------------------------------------
RPC_METHODS = ["echo", "subtract", "sum", "get_data", "notify_hello", "fail", "calc_echo",
               "calc_sleep", "minus", "no_such_method", "rpc.discover", ""]


def rand_id(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.15:
        return ABSENT
    if r < 0.6:
        return rng.randint(0, 10**6)
    if r < 0.85:
        return f"id-{rng.randint(0, 10**6)}"
    return rng.choice([None, 0, -1, 1.5, 2**63, "", "ü"])


def rpc_params(rng: random.Random, method: str) -> Any:
    if method in ("subtract", "minus"):
        a, b = rng.randint(-100, 100), rng.randint(-100, 100)
        return [a, b] if rng.random() < 0.5 else {"minuend": a, "subtrahend": b}
    if method == "sum":
        return [rng.randint(0, 5) for _ in range(rng.randint(0, 4))]
    if method == "calc_sleep":
        if rng.random() < 0.05:  # a slow call cut by its own deadline
            return {"ms": 5000, "_meta": {"timeout_ms": rng.choice([1, 20, 50])}}
        return {"ms": rng.choice([0, 1, 5])}
    if method == "fail":
        return {"message": rand_scalar(rng)}
    if method in ("get_data", "notify_hello"):
        return ABSENT if rng.random() < 0.7 else [rand_scalar(rng)]
    return rand_json(rng, 3) if rng.random() < 0.8 else {"v": rand_json(rng, 2)}


def rpc_request(rng: random.Random) -> dict[str, Any]:
    method = rng.choice(RPC_METHODS)
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    params = rpc_params(rng, method)
    if isinstance(params, dict) and rng.random() < 0.2:
        params = {**params, "_meta": {k: v for k, v in (
            ("priority", rng.randint(-5, 5)), ("timeout_ms", rng.choice([1, 100, 2000])),
            ("idempotency_key", f"k{rng.randint(0, 50)}")) if rng.random() < 0.5}}
    if params is not ABSENT:
        msg["params"] = params
    rid = rand_id(rng)
    if rid is not ABSENT:
        msg["id"] = rid
    return msg


def valid_body(rng: random.Random) -> Any:
    if rng.random() < 0.6:
        return rpc_request(rng)
    return [rpc_request(rng) for _ in range(rng.randint(1, 12))]


def mutate_obj(rng: random.Random, obj: Any) -> Any:
    """One structural change: a key dropped, retyped, renamed or added, somewhere."""
    target = obj
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        obj[i] = mutate_obj(rng, obj[i]) if rng.random() < 0.9 else rand_json(rng)
        return obj
    if not isinstance(target, dict):
        return rand_json(rng)
    op = rng.randrange(6)
    keys = list(target)
    if op == 0 and keys:
        del target[rng.choice(keys)]
    elif op == 1 and keys:
        target[rng.choice(keys)] = rand_json(rng, 2)
    elif op == 2 and keys:
        k = rng.choice(keys)
        target[k.upper() if k.islower() else k + " "] = target.pop(k)
    elif op == 3:
        target[rng.choice(["id", "jsonrpc", "method", "params", "result", "error", "extra"])] = \
            rand_json(rng, 2)
    elif op == 4 and isinstance(target.get("params"), dict):
        target["params"]["_meta"] = rng.choice([
            rand_json(rng, 2), {"priority": rand_scalar(rng)}, {"timeout_ms": rand_scalar(rng)},
            {"idempotency_key": rand_scalar(rng)}, {"timeout_ms": -1}, "meta"])
    else:
        target["jsonrpc"] = rng.choice(["1.0", 2.0, "2", None, "2.0 ", "2.0"])
    return target


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randint(0, len(b))
        if op == 0 and b:
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif op == 2:
            del b[pos:pos + rng.randint(1, 8)]
        elif op == 3:
            b[pos:pos] = rng.choice([b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"null"])
        else:
            del b[pos:]
    return bytes(b)


def malformed(rng: random.Random, text: bytes) -> bytes:
    return rng.choice([
        lambda: text[: rng.randint(0, max(len(text) - 1, 0))],
        lambda: text.replace(b'"', b"'", 1 + rng.randrange(4)),
        lambda: text.replace(b",", b"", 1),
        lambda: text.rstrip(b"}]") + b",}",
        lambda: text + b" trailing",
        lambda: text.replace(b"2.0", b"2.0\x00", 1),
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":[NaN],"id":1}',
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":[Infinity,-Infinity],"id":1}',
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":[1e999],"id":1}',
        lambda: b'{"jsonrpc":"2.0","method":"echo","id":1e999}',
        lambda: b"/* comment */" + text,
        lambda: b"", lambda: b"   \n\t ", lambda: b"\xef\xbb\xbf" + text,
        lambda: b'{"jsonrpc":"2.0","method":"echo","id":1,"id":2}',
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":{"a":1,"a":[1]},"id":"dup"}',
        lambda: b"[" + text + b"," + text,
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":"\\x41","id":1}',
        lambda: b'{"jsonrpc":"2.0","method":"echo","params":["\\ud83d"],"id":"\\udc00"}',
        lambda: mutate_bytes(rng, text),
    ])()


def wrong_types(rng: random.Random) -> Any:
    pick = rng.randrange(8)
    if pick == 0:
        return rng.choice([1, "x", None, True, 3.5, "[]", {}])
    if pick == 1:
        return [rand_scalar(rng) for _ in range(rng.randint(1, 6))]
    if pick == 2:
        return [[], {}, [1], [{}]]
    msg = rpc_request(rng)
    key = rng.choice(["jsonrpc", "method", "params", "id"])
    msg[key] = rng.choice([True, False, None, 0, 1.0, [], {}, [1, 2], {"a": 1}, "str", 2.0])
    return msg if rng.random() < 0.7 else [msg, rpc_request(rng)]


def huge_id(rng: random.Random) -> Any:
    return rng.choice([
        10 ** rng.randint(19, 4299), -(10 ** rng.randint(19, 300)), 2**64, 2**1000,
        float(f"1e{rng.randint(300, 308)}"), -0.0, 5e-324, 1.7976931348623157e308,
        "x" * rng.randint(1000, 30_000), "\ud800", "a\udfffb", "😀" * 500, "\u0000" * 10,
    ])


def huge_ids_body(rng: random.Random) -> bytes:
    if rng.random() < 0.15:  # past the interpreter's int-digit limit: a parse error, not a crash
        return b'{"jsonrpc":"2.0","method":"echo","params":[1],"id":' + b"9" * rng.choice(
            [4301, 5000, 20000]) + b"}"
    msgs = [rpc_request(rng) for _ in range(rng.choice([1, 1, 3]))]
    for m in msgs:
        if rng.random() < 0.8:
            m["id"] = huge_id(rng)
    return dumps(msgs[0] if len(msgs) == 1 else msgs)


def nested(rng: random.Random, levels: int) -> bytes:
    if rng.random() < 0.5:
        return b"[" * levels + b"1" + b"]" * levels
    return b'{"a":' * levels + b"1" + b"}" * levels


def deep_body(rng: random.Random, limits: Limits) -> bytes:
    levels = rng.choice([limits.max_depth - 4, limits.max_depth - 3, limits.max_depth - 2,
                         limits.max_depth - 1, limits.max_depth, limits.max_depth + 1, 100, 900,
                         1000, 1100, 5000, 30_000])
    where = rng.randrange(3)
    if where == 0:
        return nested(rng, levels)
    inner = nested(rng, max(levels - 3, 1))
    if where == 1:
        return b'{"jsonrpc":"2.0","method":"echo","params":[' + inner + b'],"id":7}'
    return b'[{"jsonrpc":"2.0","method":"echo","params":{"x":' + inner + b'},"id":"d"}]'


def giant_batch(rng: random.Random, limits: Limits) -> bytes:
    n = rng.choice([limits.max_items - 1, limits.max_items, limits.max_items + 1,
                    rng.randint(limits.max_items // 2, limits.max_items),
                    rng.randint(limits.max_items + 1, 20 * limits.max_items)])
    cheap = rng.random() < 0.5 or n > limits.max_items
    items: list[Any] = []
    for k in range(n):
        if cheap:
            items.append(rng.choice([1, {}, [], {"jsonrpc": "2.0"}, None]))
        else:
            items.append({"jsonrpc": "2.0", "method": rng.choice(["get_data", "nope", "echo"]),
                          "id": k} if rng.random() < 0.9 else {"jsonrpc": "2.0", "method": "nope"})
    return dumps(items)


def invalid_utf8(rng: random.Random) -> bytes:
    text = dumps(rpc_request(rng) | {"id": 5, "method": "echo", "params": ["PLACE"]})
    bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80",
                      b"\x80", b"\xfe\xff", b"\xf4\x90\x80\x80"])
    pick = rng.randrange(4)
    if pick == 0:
        return text.replace(b"PLACE", b"PL" + bad + b"ACE")
    if pick == 1:
        return bad + text
    if pick == 2:  # UTF-16/32 are valid JSON encodings (RFC 8259 says UTF-8; json.loads detects them)
        return text.decode().encode(rng.choice(["utf-16", "utf-16-le", "utf-32", "utf-16-be"]))
    return text.replace(b'"echo"', b'"ech' + bad + b'"')


def oversized(rng: random.Random, limits: Limits) -> tuple[bytes, bool]:
    size = rng.choice([limits.max_body + 1, limits.max_body + 100, 2 * limits.max_body,
                       4 * limits.max_body])
    body = b'{"jsonrpc":"2.0","method":"echo","params":["' + b"x" * size + b'"],"id":1}'
    return body, rng.random() < 0.4


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice([0, 1, 2, 5, 20, 200, 2000])
    if rng.random() < 0.5:
        return bytes(rng.randrange(256) for _ in range(n))
    return bytes(rng.choice(b'{}[]":,0123456789.-eE truefalsn\\u') for _ in range(n))


BAD_AUTH = [{}, {"authorization": "Bearer wrong-key"}, {"authorization": "Basic Zm9vOmJhcg=="},
            {"authorization": "Bearer"}, {"authorization": "bearer x"}, {"authorization": "Token x"},
            {"authorization": "Bearer fuzz-key-0000x"}, {"authorization": "Bearer fuzz-key-000"},
            {"authorization": "fuzz-key-0000"}, {"authorization": "Bearer  fuzz-key-0000"}]


class RpcFuzzer:
    """Case ``i`` of a seed, for ``/rpc``."""

    def __init__(self, seed: int, limits: Limits, key: str) -> None:
        self.seed, self.limits, self.key = seed, limits, key
        self.classes = list(RPC_CLASSES)
        self.weights = list(RPC_CLASSES.values())

    def case(self, i: int) -> Case:
        rng = random.Random(f"{self.seed}:{i}")
        cls = rng.choices(self.classes, self.weights)[0]
        auth = {"authorization": f"Bearer {self.key}"}
        chunked = False
        if cls == "valid":
            body = dumps(valid_body(rng))
        elif cls == "mutated":
            obj = valid_body(rng)
            for _ in range(rng.randint(1, 3)):
                obj = mutate_obj(rng, obj)
            body = dumps(obj)
            if rng.random() < 0.3:
                body = mutate_bytes(rng, body)
        elif cls == "malformed_json":
            body = malformed(rng, dumps(valid_body(rng)))
        elif cls == "wrong_types":
            body = dumps(wrong_types(rng))
        elif cls == "huge_ids":
            body = huge_ids_body(rng)
        elif cls == "deep_nesting":
            body = deep_body(rng, self.limits)
        elif cls == "giant_batch":
            body = giant_batch(rng, self.limits)
        elif cls == "invalid_utf8":
            body = invalid_utf8(rng)
        elif cls == "oversized":
            body, chunked = oversized(rng, self.limits)
        elif cls == "random_bytes":
            body = random_bytes(rng)
        else:
            body = dumps(valid_body(rng))
            auth = dict(rng.choice(BAD_AUTH))
        return Case(i, cls, body, {"content-type": "application/json", **auth}, chunked)
