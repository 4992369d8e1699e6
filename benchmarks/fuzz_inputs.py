"""Seeded fuzz inputs for ``/rpc`` and ``/mcp``, and the oracle that judges each reply.

Case ``i`` of seed ``s`` is generated from its own ``random.Random(f"{s}:{i}")``, so any
failing input is reproduced from two numbers. The oracle works from the request bytes
alone (JSON-RPC 2.0 plus the gateway's documented limits: body size, batch items,
JSON depth) and says what the reply must be: which ids are owed, or which status.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RPC_CLASSES: dict[str, int] = {  # class -> weight
    "valid": 10, "mutated": 30, "malformed_json": 10, "wrong_types": 10, "huge_ids": 7,
    "deep_nesting": 6, "giant_batch": 5, "invalid_utf8": 8, "oversized": 3, "random_bytes": 8,
    "bad_auth": 3,
}
MCP_CLASSES: dict[str, int] = {
    "valid": 15, "mutated": 30, "bad_headers": 10, "malformed_json": 8, "wrong_types": 8,
    "huge_ids": 6, "deep_nesting": 5, "batch_array": 3, "invalid_utf8": 6, "oversized": 2,
    "random_bytes": 5, "bad_auth": 2,
}

ABSENT = object()
NULL_ID = ("NoneType", "None")
MODERN = "2026-07-28"
MODERN_META = {"io.modelcontextprotocol/protocolVersion": MODERN,
               "io.modelcontextprotocol/clientCapabilities": {}}


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


# -- JSON the way the gateway reads it ---------------------------------------------------
def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def strict_loads(body: bytes | str) -> Any:
    return json.loads(body, parse_float=_finite, parse_constant=_no_constant)


def depth(obj: Any) -> int:
    """Levels, counting scalars (``[1]`` is 2), as the gateway's ``max_json_depth`` does."""
    best, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        best = max(best, d)
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return best


def valid_id(value: Any) -> bool:
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


def id_key(value: Any) -> tuple[str, str]:
    return (type(value).__name__, repr(value))


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


# -- the /rpc oracle -----------------------------------------------------------------------
@dataclass(slots=True)
class Owed:
    """What a reply must be. ``kind``: status (``status`` + error ``codes``), one (a single error
    with ``codes`` and id null), none (204), single (``ids[0]``), batch (``ids``)."""

    kind: str
    status: int = 200
    codes: frozenset[int] = frozenset()
    ids: list[tuple[tuple[str, str], int | None]] = field(default_factory=list)


def _owed_entry(obj: Any) -> tuple[tuple[str, str], int | None] | None:
    if not isinstance(obj, dict):
        return NULL_ID, -32600
    if "id" in obj and not valid_id(obj["id"]):
        return NULL_ID, -32600
    rid = obj.get("id", ABSENT)
    echo = NULL_ID if rid is ABSENT else id_key(rid)
    if obj.get("jsonrpc") != "2.0" or not isinstance(obj.get("method"), str) or (
            "params" in obj and not isinstance(obj["params"], dict | list)):
        return echo, -32600
    if rid is ABSENT:
        return None  # a notification: nothing owed, whatever happens to it
    return echo, None


def expect_rpc(case: Case, limits: Limits, key: str) -> Owed:
    auth = case.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != key:
        return Owed("status", 401, frozenset({-32005}))
    if len(case.body) > limits.max_body:
        return Owed("status", 413, frozenset({-32006}))
    try:
        obj = strict_loads(case.body)
    except (ValueError, RecursionError):
        return Owed("one", codes=frozenset({-32700}))
    if depth(obj) > limits.max_depth:
        return Owed("one", codes=frozenset({-32600, -32700}))  # -32700 if the parser's stack gave out
    if isinstance(obj, list):
        if not obj or len(obj) > limits.max_items:
            return Owed("one", codes=frozenset({-32600}))
        owed = [o for o in (_owed_entry(x) for x in obj) if o is not None]
        return Owed("batch", ids=owed) if owed else Owed("none", 204)
    one = _owed_entry(obj)
    return Owed("single", ids=[one]) if one is not None else Owed("none", 204)


def reply_problem(r: Any) -> str | None:
    """Why ``r`` is not a JSON-RPC 2.0 response object (None if it is one)."""
    if not isinstance(r, dict):
        return "reply is not an object"
    if r.get("jsonrpc") != "2.0" or "id" not in r or not valid_id(r["id"]):
        return "bad jsonrpc/id member"
    if ("result" in r) == ("error" in r) or set(r) - {"jsonrpc", "id", "result", "error"}:
        return "must have exactly one of result/error and nothing else"
    if "error" in r:
        e = r["error"]
        if not isinstance(e, dict) or set(e) - {"code", "message", "data"}:
            return "error is not an error object"
        if not isinstance(e.get("code"), int) or isinstance(e.get("code"), bool) or \
                not isinstance(e.get("message"), str):
            return "error needs an integer code and a string message"
    return None


def _code(r: dict[str, Any]) -> int | None:
    return r["error"]["code"] if "error" in r else None


def check_rpc(owed: Owed, status: int, content_type: str, content: bytes) -> tuple[str, list[str]]:
    """(response class, problems) for one HTTP reply."""
    problems: list[str] = []
    if status >= 500:
        return f"{status}", [f"HTTP {status}"]
    if owed.kind == "none":
        if status != 204 or content:
            problems.append(f"nothing owed, got HTTP {status} with {len(content)} bytes")
        return str(status), problems
    want = owed.status
    if status != want:
        problems.append(f"expected HTTP {want}, got {status}")
    if "application/json" not in content_type:
        problems.append(f"content-type {content_type!r}")
    try:
        body = strict_loads(content)
    except (ValueError, RecursionError):
        return f"{status} non-json", [*problems, "reply is not JSON"]
    if owed.kind in ("status", "one", "single"):
        if isinstance(body, list):
            return f"{status} batch", [*problems, "a batch reply to a non-batch request"]
        why = reply_problem(body)
        if why:
            return f"{status} bad", [*problems, why]
        code = _code(body)
        if owed.kind == "single":
            rid, fixed = owed.ids[0]
            if id_key(body["id"]) != rid:
                problems.append(f"reply id {body['id']!r:.60} is not the request's")
            if fixed is not None and code != fixed:
                problems.append(f"expected error {fixed}, got {code}")
        else:
            if body["id"] is not None:
                problems.append("a request-level error must carry id null")
            if code not in owed.codes:
                problems.append(f"expected error {sorted(owed.codes)}, got {code}")
        return f"{status} {'result' if code is None else code}", problems
    if not isinstance(body, list):
        return f"{status} single", [*problems, "a batch was owed, got a single reply"]
    for r in body:
        why = reply_problem(r)
        if why:
            return f"{status} bad", [*problems, why]
    got = Counter(id_key(r["id"]) for r in body)
    want_ids = Counter(rid for rid, _ in owed.ids)
    if got != want_ids:
        problems.append(f"batch ids differ: missing {sum((want_ids - got).values())}, "
                        f"unexpected {sum((got - want_ids).values())}")
    fixed = Counter((rid, code) for rid, code in owed.ids if code is not None)
    have = Counter((id_key(r["id"]), _code(r)) for r in body)
    if fixed - have:
        problems.append("an invalid batch entry did not get its -32600")
    return f"{status} batch", problems


# -- /mcp generators and oracle ----------------------------------------------------------------
MCP_TOOLS = ["echo", "subtract", "sum", "get_data", "fail", "no_such_tool", "calc_echo"]


def mcp_message(rng: random.Random) -> dict[str, Any]:
    method = rng.choice(["tools/call"] * 6 + ["tools/list", "server/discover", "ping",
                                              "resources/list", "nope/nope"])
    params: dict[str, Any] = {"_meta": dict(MODERN_META)}
    if method == "tools/call":
        tool = rng.choice(MCP_TOOLS)
        args = rpc_params(rng, tool)
        if args is ABSENT:
            args = {}
        elif not isinstance(args, dict):
            args = {"values": args} if tool == "sum" else {"v": args}
        params.update(name=tool, arguments=args)
    msg = {"jsonrpc": "2.0", "id": rng.choice([rng.randint(0, 10**6), f"m{rng.randint(0, 999)}"]),
           "method": method, "params": params}
    if rng.random() < 0.05:
        del msg["id"]
    return msg


def mcp_headers(key: str, msg: Any) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": MODERN, "authorization": f"Bearer {key}"}
    if isinstance(msg, dict):
        if isinstance(msg.get("method"), str) and msg["method"].isascii():
            headers["mcp-method"] = msg["method"]
        params = msg.get("params")
        if isinstance(params, dict) and isinstance(params.get("name"), str) and params["name"].isascii():
            headers["mcp-name"] = params["name"]
    return headers


def bad_headers(rng: random.Random, headers: dict[str, str]) -> dict[str, str]:
    headers = dict(headers)
    for _ in range(rng.randint(1, 2)):
        k = rng.choice(["accept", "mcp-protocol-version", "mcp-method", "mcp-name", "content-type",
                        "origin", "mcp-session-id"])
        headers[k] = rng.choice(["", "text/plain", "application/json", "text/event-stream",
                                 "2025-11-25", "1999-01-01", "tools/list", "echo", "http://evil.test",
                                 "http://localhost:3000", "deadbeef", "x" * 500])
        if rng.random() < 0.3:
            headers.pop(k, None)
    return headers


class McpFuzzer:
    """Case ``i`` of a seed, for ``/mcp`` (2026-07-28 Streamable HTTP, one message per POST)."""

    def __init__(self, seed: int, limits: Limits, key: str) -> None:
        self.seed, self.limits, self.key = seed, limits, key
        self.classes = list(MCP_CLASSES)
        self.weights = list(MCP_CLASSES.values())

    def case(self, i: int) -> Case:
        rng = random.Random(f"mcp:{self.seed}:{i}")
        cls = rng.choices(self.classes, self.weights)[0]
        msg: Any = mcp_message(rng)
        chunked = False
        if cls == "mutated":
            for _ in range(rng.randint(1, 3)):
                msg = mutate_obj(rng, msg)
        elif cls == "wrong_types":
            msg = wrong_types(rng)
        elif cls == "huge_ids":
            msg["id"] = huge_id(rng)
        elif cls == "batch_array":
            msg = [mcp_message(rng) for _ in range(rng.choice([1, 2, 50, 500]))]
        headers = mcp_headers(self.key, msg)
        body = dumps(msg)
        if cls == "mutated" and rng.random() < 0.3:
            body = mutate_bytes(rng, body)
        elif cls == "bad_headers":
            headers = bad_headers(rng, headers)
        elif cls == "malformed_json":
            body = malformed(rng, body)
        elif cls == "deep_nesting":
            body = deep_body(rng, self.limits)
        elif cls == "invalid_utf8":
            body = invalid_utf8(rng)
        elif cls == "oversized":
            body, chunked = oversized(rng, self.limits)
        elif cls == "random_bytes":
            body = random_bytes(rng)
        elif cls == "bad_auth":
            headers = {k: v for k, v in headers.items() if k != "authorization"}
            headers.update(rng.choice(BAD_AUTH))
        return Case(i, cls, body, headers, chunked)


def sse_messages(content: bytes) -> list[Any]:
    out = []
    for event in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                          if line.startswith(b"data:"))
        if data:
            out.append(json.loads(data))
    return out


def check_mcp(case: Case, key: str, limits: Limits, status: int, content_type: str,
              content: bytes) -> tuple[str, list[str]]:
    """(response class, problems): no 5xx, 401/413 as documented, every body JSON-RPC-shaped
    and carrying the request's id (or null)."""
    auth = case.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if status >= 500:
        return str(status), [f"HTTP {status}"]
    problems: list[str] = []
    origin = case.headers.get("origin")
    if origin and not origin.startswith(("http://localhost", "http://127.0.0.1")):
        if status != 403:
            problems.append(f"foreign Origin answered {status}")
    elif scheme.lower() != "bearer" or token.strip() != key:
        if status != 401:
            problems.append(f"bad key answered {status}")
    elif len(case.body) > limits.max_body and status != 413:
        problems.append(f"oversized body answered {status}")
    try:
        sent = strict_loads(case.body)
    except (ValueError, RecursionError):
        sent = ABSENT
    sent_id = sent.get("id", ABSENT) if isinstance(sent, dict) else ABSENT
    if status == 202:
        if content or not (isinstance(sent, dict) and "id" not in sent):
            problems.append("202 for a message that is owed a reply")
        return "202", problems
    if not content:
        if status in (200, 401, 413):
            problems.append(f"HTTP {status} with an empty body")
        return f"{status} empty", problems
    try:
        if "text/event-stream" in content_type:
            messages = sse_messages(content)
            label = f"{status} sse"
        elif "application/json" in content_type:
            messages = [json.loads(content)]
            label = f"{status} json"
        elif 400 <= status < 500 and status not in (401, 413):
            return f"{status} plain", problems  # Streamable HTTP: an error body MAY be JSON-RPC
        else:
            return f"{status} other", [*problems, f"content-type {content_type!r}"]
    except ValueError:
        return f"{status} bad", [*problems, "body is not JSON"]
    if not messages:
        return label, [*problems, "no message in the body"]
    reply = messages[-1]
    why = reply_problem(reply)
    if why:
        return label, [*problems, why]
    if reply["id"] is not None and (sent_id is ABSENT or id_key(reply["id"]) != id_key(sent_id)):
        problems.append("reply id is not the request's")
    if status in (401, 413) and _code(reply) not in (-32005, -32006):
        problems.append(f"HTTP {status} without the documented error code")
    return f"{label} {'result' if 'result' in reply else _code(reply)}", problems


Checker = Callable[[Case, int, str, bytes], tuple[str, list[str]]]
