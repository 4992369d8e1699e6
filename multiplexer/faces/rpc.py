"""Runs decoded JSON-RPC entries through the gateway and builds the reply body."""

from __future__ import annotations

from multiplexer.core.call import Outcome
from multiplexer.core.errors import RpcError, internal_error
from multiplexer.core.json_codec import dumps
from multiplexer.core.jsonrpc import Decoded, Entry, decode, error_response, response
from multiplexer.faces.access import Note, note_rpc
from multiplexer.gateway.gateway import Gateway
from multiplexer.money.report import cost_meta


def _reply(entry: Entry, outcome: Outcome | None) -> dict:
    if entry.error is not None:
        return error_response(entry.id, entry.error)
    assert outcome is not None
    return response(entry.id, outcome)


async def _outcomes(gateway: Gateway, decoded: Decoded,
                    trace: dict[str, str] | None = None) -> list[Outcome | None]:
    """One outcome per entry in order; None where the entry was refused at decoding.

    ``trace``: the request's trace context, for calls that bring none in ``_meta``."""
    calls = [e.call for e in decoded.entries if e.call is not None and e.error is None]
    if gateway.tracer.enabled:
        for call in calls:
            call.face = "rpc"
            call.trace = call.trace or trace
    outcomes = iter(await gateway.submit_many(calls) if calls else [])
    return [next(outcomes) if e.call is not None and e.error is None else None for e in decoded.entries]


async def handle_body(gateway: Gateway, body: bytes, identity: str | None = None,
                      trace: dict[str, str] | None = None, note: Note | None = None) -> bytes | None:
    """The reply body (None: nothing to send); ``note`` learns the method and the first error."""
    server = gateway.config.server
    decoded = decode(body, max_items=server.max_batch_items, max_depth=server.max_json_depth,
                     identity=identity)
    outcomes = await _outcomes(gateway, decoded, trace)
    if note is not None:
        note_rpc(note, decoded, outcomes)
    parts = [_encoded(e, o) for e, o in zip(decoded.entries, outcomes, strict=True) if not e.is_notification]
    if not parts:
        return None
    return b"[" + b",".join(parts) + b"]" if decoded.batch else parts[0]


def with_cost(outcome: Outcome) -> Outcome:
    """The result with ``_meta.cost_usd`` (and ``saved_usd``) where it is an object."""
    result = outcome.result
    if not isinstance(result, dict):
        return outcome
    meta = result.get("_meta")
    return Outcome({**result, "_meta": {**(meta if isinstance(meta, dict) else {}), **cost_meta(outcome)}})


def _encoded(entry: Entry, outcome: Outcome | None) -> bytes:
    """One reply's JSON; a result the provider encoded already is spliced in, not encoded again."""
    if entry.call is not None and entry.call.want_cost and outcome is not None and outcome.ok:
        outcome = with_cost(outcome)
    if outcome is not None and entry.call is not None and entry.call.want_route:
        outcome = with_route(outcome, entry.call.route or entry.call.method)
    elif entry.error is None and outcome is not None and outcome.ok and outcome.result_json is not None:
        return b'{"jsonrpc":"2.0","result":' + outcome.result_json + b',"id":' + dumps(entry.id) + b"}"
    reply = _reply(entry, outcome)
    try:
        return dumps(reply)
    except (TypeError, ValueError):  # a result that is not valid JSON (NaN, bytes, ...): this call only
        return dumps(error_response(reply.get("id"), internal_error("result is not valid JSON")))


def with_route(outcome: Outcome, route: str) -> Outcome:
    """The outcome with the route that served it (``_meta.want_route``): ``_meta.route`` on an
    object result, ``data.route`` on an error; other results stay as they are."""
    if outcome.error is not None:
        e = outcome.error
        return Outcome.fail(RpcError(e.code, e.message, {**(e.data or {}), "route": route}))
    result = outcome.result
    if not isinstance(result, dict):
        return outcome
    meta = result.get("_meta")
    return Outcome({**result, "_meta": {**(meta if isinstance(meta, dict) else {}), "route": route}})
