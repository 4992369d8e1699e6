"""JSON-RPC 2.0 codec: bytes in, calls and error entries out; outcomes in, bytes out.

It never raises on client input: whatever arrives becomes either requests to run
or spec-shaped error responses (``decode`` is property-tested on arbitrary bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import RpcError, invalid_params, invalid_request, parse_error
from multiplexer.core.json_codec import loads
from multiplexer.core.tracing import TRACE_KEYS, trace_carrier

_NO_ID = object()
# The only ``_meta`` keys that steer the gateway; any other key is dropped, never interpreted
# (a client must not switch on, say, retries of a call that is not safe to repeat).
META_KEYS = {"priority", "timeout_ms", "idempotency_key", "want_route", "want_cost", *TRACE_KEYS}


@dataclass(slots=True)
class Entry:
    """One element of a request: a call to run, or an error already decided."""

    id: Any = _NO_ID  # _NO_ID: a notification
    call: Call | None = None
    error: RpcError | None = None

    @property
    def is_notification(self) -> bool:
        return self.id is _NO_ID


def is_unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text: JSON's ``"\\ud800"`` escape decodes to a lone surrogate,
    which UTF-8 (a socket, SQLite, a tokenizer) cannot carry."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def is_token_array(value: Any) -> bool:
    """Whether ``value`` is OpenAI's token-array input: a non-empty list of ints (bools are not)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def depth_exceeds(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return False


def _valid_id(value: Any) -> bool:
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


def split_meta(params: Any) -> tuple[Any, dict[str, Any]]:
    """Remove ``_meta`` from named params; positional params carry none."""
    if isinstance(params, dict) and "_meta" in params:
        params = dict(params)
        meta = params.pop("_meta")
        if not isinstance(meta, dict):
            raise invalid_params("_meta must be an object")
        return params, meta
    return params, {}


def call_from(method: str, params: Any, meta: dict[str, Any], identity: str | None) -> Call:
    """Build a ``Call``, validating the per-call options that ride in ``_meta``."""
    priority = meta.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise invalid_params("_meta.priority must be an integer")
    timeout_ms = meta.get("timeout_ms")
    if timeout_ms is not None and (
        not isinstance(timeout_ms, int | float) or isinstance(timeout_ms, bool) or timeout_ms <= 0
    ):
        raise invalid_params("_meta.timeout_ms must be a positive number")
    key = meta.get("idempotency_key")
    if key is not None and not isinstance(key, str):
        raise invalid_params("_meta.idempotency_key must be a string")
    call = Call(method, params, priority, timeout_ms, key, identity)
    want_route = meta.get("want_route", False)
    if not isinstance(want_route, bool):
        raise invalid_params("_meta.want_route must be a boolean")
    call.want_route = want_route
    want_cost = meta.get("want_cost")
    if want_cost is not None:
        if not isinstance(want_cost, bool):
            raise invalid_params("_meta.want_cost must be true or false")
        call.want_cost = want_cost
    if "traceparent" in meta:
        call.trace = trace_carrier(meta)
    return call


def decode_entry(obj: Any, identity: str | None = None) -> Entry:
    if not isinstance(obj, dict):
        return Entry(id=None, error=invalid_request("a request must be a JSON object"))
    rid = obj.get("id", _NO_ID)
    if rid is not _NO_ID and not _valid_id(rid):
        return Entry(id=None, error=invalid_request("id must be a string, number or null"))
    echo = None if rid is _NO_ID else rid
    if obj.get("jsonrpc") != "2.0":
        return Entry(id=echo, error=invalid_request('"jsonrpc" must be exactly "2.0"'))
    method = obj.get("method")
    if not isinstance(method, str):
        return Entry(id=echo, error=invalid_request('"method" must be a string'))
    params = obj.get("params")
    if "params" in obj and not isinstance(params, dict | list):
        return Entry(id=echo, error=invalid_request('"params" must be an object or an array'))
    try:
        params, meta = split_meta(params)
        call = call_from(method, params, meta, identity)
    except RpcError as e:
        return Entry(id=rid, error=e)
    call.notification = rid is _NO_ID
    return Entry(id=rid, call=call)


@dataclass(slots=True)
class Decoded:
    batch: bool
    entries: list[Entry]


def decode(body: bytes, *, max_items: int = 1000, max_depth: int = 64,
           identity: str | None = None) -> Decoded:
    """Turn a request body into entries; a body-level failure is one error entry."""
    try:
        obj = loads(body)
    except (ValueError, RecursionError) as e:
        return Decoded(False, [Entry(id=None, error=parse_error(str(e)[:200]))])
    # a value max_depth + 1 levels down sits inside max_depth brackets: with fewer, no walk
    if body.count(b"[") + body.count(b"{") >= max_depth and depth_exceeds(obj, max_depth):
        return Decoded(False, [Entry(id=None, error=invalid_request(
            f"JSON nested deeper than {max_depth} levels"))])
    if isinstance(obj, list):
        if not obj:
            return Decoded(False, [Entry(id=None, error=invalid_request("empty batch"))])
        if len(obj) > max_items:
            err = invalid_request(f"batch of {len(obj)} items exceeds the limit of {max_items} "
                                  "(server.max_batch_items); send it in smaller batches")
            assert err.data is not None
            err.data["max_batch_items"] = max_items
            return Decoded(False, [Entry(id=None, error=err)])
        return Decoded(True, [decode_entry(o, identity) for o in obj])
    return Decoded(False, [decode_entry(obj, identity)])


def response(rid: Any, outcome: Outcome) -> dict[str, Any]:
    if outcome.error is not None:
        return {"jsonrpc": "2.0", "error": outcome.error.to_dict(), "id": rid}
    return {"jsonrpc": "2.0", "result": outcome.result, "id": rid}


def error_response(rid: Any, error: RpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": error.to_dict(), "id": rid}
