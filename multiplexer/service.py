"""Runs decoded JSON-RPC entries through the gateway and builds the reply body."""

from __future__ import annotations

from typing import Any

import anyio

from .errors import internal_error
from .gateway import Gateway
from .jsonrpc import Decoded, Entry, decode, dumps, error_response, response


async def run_entry(gateway: Gateway, entry: Entry) -> dict[str, Any] | None:
    if entry.error is not None:
        return None if entry.is_notification else error_response(entry.id, entry.error)
    assert entry.call is not None
    outcome = await gateway.submit(entry.call)
    return None if entry.is_notification else response(entry.id, outcome)


async def run_decoded(gateway: Gateway, decoded: Decoded) -> Any:
    """The response object (dict or list), or None when nothing is owed."""
    if not decoded.batch:
        return await run_entry(gateway, decoded.entries[0])
    results: list[dict[str, Any] | None] = [None] * len(decoded.entries)

    async def one(i: int, entry: Entry) -> None:
        results[i] = await run_entry(gateway, entry)

    async with anyio.create_task_group() as tg:
        for i, entry in enumerate(decoded.entries):
            if entry.call is None:
                results[i] = await run_entry(gateway, entry)
            else:
                tg.start_soon(one, i, entry)
    replies = [r for r in results if r is not None]
    return replies or None


async def handle_body(gateway: Gateway, body: bytes, identity: str | None = None) -> bytes | None:
    server = gateway.config.server
    decoded = decode(body, max_items=server.max_batch_items, max_depth=server.max_json_depth,
                     identity=identity)
    reply = await run_decoded(gateway, decoded)
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
