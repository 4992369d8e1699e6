"""The fuzz oracle: from the request bytes alone, what a reply must be; and whether it is.

It knows JSON-RPC 2.0 and the gateway's documented limits (body size, batch items,
JSON depth, keys) and nothing of its code: which ids are owed, which status, which
error code, and that every reply object is spec-shaped.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fuzz_inputs import ABSENT, Case, Limits

NULL_ID = ("NoneType", "None")


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
