"""A small JSON-RPC 2.0 upstream server (the spec's examples plus test knobs).

Run it with ``python examples/jsonrpc_upstream.py --port 9001`` and point the
gateway's ``kind: jsonrpc`` provider at ``http://127.0.0.1:9001/``. Tests and
benchmarks import ``create_app`` and inspect or tune ``UpstreamState``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class UpstreamState:
    http_requests: int = 0
    executions: Counter[str] = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)
    reject_arrays: bool = False
    fail_next: list[int] = field(default_factory=list)  # HTTP statuses for the next requests
    retry_after: str | None = None
    reverse_batches: bool = True  # answer arrays out of order, as the spec allows
    drop_ids: set[Any] = field(default_factory=set)  # ids whose reply goes missing
    gate: anyio.Event | None = None  # `wait` blocks until this is set


def _error(code: int, message: str, rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": {"code": code, "message": message}, "id": rid}


async def _run(state: UpstreamState, method: str, params: Any) -> Any:
    state.executions[method] += 1
    if method == "subtract":
        if isinstance(params, dict):
            return params["minuend"] - params["subtrahend"]
        return params[0] - params[1]
    if method == "sum":
        values = params.get("values", []) if isinstance(params, dict) else params
        return sum(values)
    if method == "get_data":
        return ["hello", 5]
    if method in ("notify_hello", "notify_sum", "update"):
        return None
    if method == "echo":
        return params
    if method == "sleep":
        await anyio.sleep(float((params or {}).get("ms", 10)) / 1000)
        return "slept"
    if method == "wait":
        if state.gate is not None:
            await state.gate.wait()
        return "released"
    if method == "stats":
        return {"http_requests": state.http_requests, "executions": dict(state.executions)}
    if method == "fail":
        params = params or {}
        raise ValueError(params.get("message", "failed on purpose"), params.get("code", 1001))
    raise KeyError(method)


async def _handle(state: UpstreamState, msg: Any) -> dict[str, Any] | None:
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or "method" not in msg:
        return _error(-32600, "Invalid Request", None)
    rid = msg.get("id")
    try:
        result = await _run(state, msg["method"], msg.get("params"))
    except KeyError:
        reply = _error(-32601, "Method not found", rid)
    except (TypeError, IndexError):
        reply = _error(-32602, "Invalid params", rid)
    except ValueError as e:
        reply = {"jsonrpc": "2.0", "error": {"code": e.args[-1], "message": str(e.args[0]),
                                             "data": {"why": "asked to"}}, "id": rid}
    else:
        reply = {"jsonrpc": "2.0", "result": result, "id": rid}
    if "id" not in msg or rid in state.drop_ids:
        return None
    return reply


def create_app(state: UpstreamState | None = None) -> Starlette:
    state = state or UpstreamState()

    async def rpc(request: Request) -> Response:
        state.http_requests += 1
        if state.fail_next:
            status = state.fail_next.pop(0)
            headers = {"retry-after": state.retry_after} if state.retry_after else None
            return Response(b"upstream trouble", status, headers)
        try:
            body = json.loads(await request.body())
        except ValueError:
            return Response(json.dumps(_error(-32700, "Parse error", None)),
                            media_type="application/json")
        if isinstance(body, list):
            if state.reject_arrays:
                return Response(json.dumps(_error(-32600, "Batches not supported", None)),
                                media_type="application/json")
            state.batch_sizes.append(len(body))
            replies = [r for r in [await _handle(state, m) for m in body] if r is not None]
            if state.reverse_batches:
                replies.reverse()
            if not replies:
                return Response(status_code=204)
            return Response(json.dumps(replies), media_type="application/json")
        state.batch_sizes.append(1)
        reply = await _handle(state, body)
        if reply is None:
            return Response(status_code=204)
        return Response(json.dumps(reply), media_type="application/json")

    app = Starlette(routes=[Route("/", rpc, methods=["POST"])])
    app.state.upstream = state
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=9001)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
