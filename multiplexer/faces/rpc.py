"""Runs decoded JSON-RPC entries through the gateway and builds the reply body."""

from __future__ import annotations

from typing import Any

from multiplexer.core.call import Outcome
from multiplexer.core.errors import internal_error
from multiplexer.core.jsonrpc import Decoded, Entry, decode, dumps, error_response, response
from multiplexer.gateway.gateway import Gateway


def _reply(entry: Entry, outcome: Outcome | None) -> dict[str, Any] | None:
    if entry.is_notification:
        return None
    if entry.error is not None:
        return error_response(entry.id, entry.error)
    assert outcome is not None
    return response(entry.id, outcome)


async def run_decoded(gateway: Gateway, decoded: Decoded,
                      trace: dict[str, str] | None = None) -> Any:
    """The response object (dict or list), or None when nothing is owed.

    ``trace``: the request's trace context, for calls that bring none in ``_meta``."""
    calls = [e.call for e in decoded.entries if e.call is not None and e.error is None]
    if gateway.tracer.enabled:
        for call in calls:
            call.face = "rpc"
            call.trace = call.trace or trace
    outcomes = iter(await gateway.submit_many(calls) if calls else [])
    replies = [
        _reply(e, next(outcomes) if e.call is not None and e.error is None else None)
        for e in decoded.entries
    ]
    if not decoded.batch:
        return replies[0]
    kept = [r for r in replies if r is not None]
    return kept or None


async def handle_body(gateway: Gateway, body: bytes, identity: str | None = None,
                      trace: dict[str, str] | None = None) -> bytes | None:
    server = gateway.config.server
    decoded = decode(body, max_items=server.max_batch_items, max_depth=server.max_json_depth,
                     identity=identity)
    reply = await run_decoded(gateway, decoded, trace)
    if reply is None:
        return None
    try:
        return dumps(reply)
    except (TypeError, ValueError):
        return dumps([_safe(r) for r in reply] if isinstance(reply, list) else _safe(reply))


def _safe(reply: dict[str, Any]) -> dict[str, Any]:
    """Replace a result that is not valid JSON (NaN, bytes, ...) by an error for that call only."""
    try:
        dumps(reply)
        return reply
    except (TypeError, ValueError):
        return error_response(reply.get("id"), internal_error("result is not valid JSON"))
