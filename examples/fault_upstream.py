"""A JSON-RPC 2.0 upstream that fails on purpose, for fault soaks.

A seeded share of its HTTP requests (``rate``, 20% by default) fails, spread evenly
over these ways:

- ``429_retry_after`` / ``429``: rate limited, with and without ``Retry-After``; nothing runs.
- ``503``: unavailable; nothing runs.
- ``500`` / ``502``: the calls ran, then the server failed (a retry would run them again).
- ``timeout``: the calls ran, then the reply hangs past the client's HTTP timeout.
- ``reset``: the connection is aborted with a TCP RST, before or after the calls ran.
- ``malformed``: the calls ran; the body is not JSON, or JSON of the wrong shape.
- ``partial``: the calls ran; some replies are missing, some are errors, plus noise
  (an unknown id, an exact duplicate).
- ``slow``: the reply comes after ``slow_s``, past short call deadlines.

Its one method, ``act``, is a side effect: it counts how many times it executed each
``params.token`` (``state.executions``), so a duplicate execution is visible. It answers
``{"token": ..., "n": ...}`` so a caller can check an answer is its own.

    python examples/fault_upstream.py --port 9002 --rate 0.2   # GET /stats for the counts
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

FAULTS = ("429_retry_after", "429", "500", "502", "503", "timeout", "reset", "malformed",
          "partial", "slow")
MALFORMED = (b"not json at all", b"<html><body>502 Bad Gateway</body></html>",
             b'{"jsonrpc": "2.0", "result": ', b'"a string"', b"[1, 2, 3]",
             b'{"unexpected": true}', b"null", b"")


@dataclass
class FaultState:
    rate: float = 0.2
    seed: int = 0
    kinds: tuple[str, ...] = FAULTS
    hang_s: float = 2.0  # longer than the gateway's HTTP timeout to this upstream
    slow_s: float = 0.5  # longer than the short call deadlines a soak uses
    retry_after: str = "0.01"
    executions: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    http_requests: int = 0
    messages: int = 0
    active: int = 0  # requests being handled, hung and slow ones included
    rng: random.Random = field(init=False)
    _quiet: anyio.Event | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def quiet(self) -> None:
        """Until no request is in progress: late side effects (hung, slow) have all landed."""
        while self.active:
            self._quiet = self._quiet or anyio.Event()
            await self._quiet.wait()

    def _leave(self) -> None:
        self.active -= 1
        if not self.active and self._quiet is not None:
            self._quiet.set()
            self._quiet = None

    def draw(self) -> str | None:
        if self.rng.random() >= self.rate:
            return None
        kind = self.rng.choice(self.kinds)
        self.faults[kind] += 1
        return kind


def _error(code: int, message: str, rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": {"code": code, "message": message}, "id": rid}


def _execute(state: FaultState, msg: Any) -> dict[str, Any] | None:
    """Run one message (the side effect happens here); its reply, or None for a notification."""
    state.messages += 1
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
        return _error(-32600, "Invalid Request", None)
    rid, params = msg.get("id"), msg.get("params")
    if msg.get("method") != "act":
        reply = _error(-32601, "Method not found", rid)
    elif not isinstance(params, dict) or not isinstance(params.get("token"), str):
        reply = _error(-32602, "Invalid params: act needs a string token", rid)
    else:
        token = params["token"]
        state.executions[token] += 1
        reply = {"jsonrpc": "2.0", "result": {"token": token, "n": state.executions[token]},
                 "id": rid}
    return reply if "id" in msg else None


def _partial(state: FaultState, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rng, out = state.rng, []
    for r in replies:
        roll = rng.random()
        if roll < 0.3:
            continue  # missing
        if roll < 0.6:
            out.append(_error(-32050, "partial failure", r["id"]))
        else:
            out.append(r)
    if out and rng.random() < 0.3:
        out.append(dict(rng.choice(out)))  # an exact duplicate
    if rng.random() < 0.3:
        out.append({"jsonrpc": "2.0", "result": {"token": "stranger"}, "id": 10**12 + rng.randrange(99)})
    rng.shuffle(out)
    return out


async def _reset(request: Request) -> Response:
    """Abort the connection with an RST; wait for uvicorn to see it so no reply is written."""
    transport = request.scope.get("fault.transport")
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
        with anyio.move_on_after(1.0):
            await request.receive()
    return Response(status_code=500)  # never reaches the client


class _ExposeTransport:
    """Puts uvicorn's transport in the scope: the only handle for a real connection reset."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["fault.transport"] = getattr(getattr(send, "__self__", None), "transport", None)
        await self.app(scope, receive, send)


def create_app(state: FaultState | None = None) -> ASGIApp:
    state = state or FaultState()

    async def rpc(request: Request) -> Response:
        state.http_requests += 1
        state.active += 1
        try:
            return await handle(request)
        finally:
            state._leave()

    async def handle(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse(_error(-32700, "Parse error", None))
        fault = state.draw()
        if fault in ("429_retry_after", "429", "503"):
            headers = {"retry-after": state.retry_after} if fault == "429_retry_after" else None
            return Response(b"try again later", int(fault[:3]), headers)
        if fault == "reset" and state.rng.random() < 0.5:
            return await _reset(request)  # before anything ran
        if fault == "slow":
            await anyio.sleep(state.slow_s)
        batch = isinstance(body, list)
        replies = [r for r in (_execute(state, m) for m in (body if batch else [body])) if r is not None]
        if fault in ("500", "502"):
            return Response(b"upstream exploded", int(fault))
        if fault == "reset":
            return await _reset(request)  # after the calls ran
        if fault == "timeout":
            await anyio.sleep(state.hang_s)
        if fault == "malformed":
            return Response(state.rng.choice(MALFORMED), media_type="application/json")
        if fault == "partial":
            if batch:
                replies = _partial(state, replies)
            elif replies:
                replies = [_error(-32050, "partial failure", replies[0]["id"])]
        if not replies:
            return Response(status_code=204)
        return JSONResponse(replies if batch else replies[0])

    async def stats(request: Request) -> Response:
        return JSONResponse({"http_requests": state.http_requests, "messages": state.messages,
                             "faults": dict(state.faults), "executions": dict(state.executions)})

    app = Starlette(routes=[Route("/", rpc, methods=["POST"]), Route("/stats", stats)])
    app.state.faults = state
    return _ExposeTransport(app)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--rate", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    app = create_app(FaultState(rate=args.rate, seed=args.seed))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
