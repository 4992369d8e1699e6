"""The gateway's HTTP server path per request, in process: direct calls against ASGI.

The gateway's own protocol (``faces/server_protocol.py``) and app (``faces/http.py`` with the
``/v1`` routes) in front of a gateway whose routes go to the built-in echo provider; 64
connections, each with a transport that records writes instead of a socket, send one request
at a time (``POST /rpc`` and ``POST /v1/embeddings``, 5 headers). Each round runs every
combination of face and path (the endpoints' direct calls, or the same requests with the
server's direct table emptied so that they take the ASGI path), in alternating order, and
reports the event loop's CPU per request. With no sockets or client process the figures are
steadier than over HTTP (``bench_local``'s ``rpc_echo`` row), and they show the server path's
own cost; the HTTP rows add the system calls and the client's share of the cores.

    python -m benchmarks.bench_http_path [--rounds 6] [--requests 12800]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import uvicorn
import uvloop
from uvicorn.server import ServerState

from benchmarks._procs import save, table
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.http import create_app
from multiplexer.faces.server_protocol import GatewayHttpProtocol
from multiplexer.faces.v1 import v1_routes
from multiplexer.gateway.config import Config
from multiplexer.gateway.gateway import Gateway

CONFIG = {"providers": {"builtin": {"kind": "echo", "batch": {"max_items": 100, "max_wait_ms": 1}}},
          "routes": {"echo": {"provider": "builtin"},
                     "emb": {"provider": "builtin", "operation": "embeddings", "models": ["echo-embed"]}}}
CONNECTIONS = 64
TEXT = "a short text of a few words to embed"


class Recorder:
    """A transport that counts what would be sent and wakes its connection's client."""

    def __init__(self, done: asyncio.Event) -> None:
        self.done = done
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.done.set()

    def close(self) -> None: ...

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> Any:
        return None

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def request(face: str) -> bytes:
    if face == "/v1/embeddings":
        body = json.dumps({"model": "echo-embed", "input": TEXT}).encode()
    else:
        body = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": {"input": TEXT}, "id": 1}).encode()
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\naccept: */*\r\n"
            b"user-agent: bench\r\ncontent-length: %d\r\n\r\n%s" % (face.encode(), len(body), body))


async def requests(config: uvicorn.Config, face: str, direct: bool, n: int) -> None:
    """``n`` requests over the connections, one at a time on each."""
    state = ServerState()
    raw = request(face)

    async def connection() -> None:
        done = asyncio.Event()
        protocol = GatewayHttpProtocol(config=config, server_state=state, app_state={})
        wire = Recorder(done)
        protocol.connection_made(wire)  # type: ignore[arg-type]
        if not direct:
            protocol._direct = {}  # every request takes the ASGI path
        for _ in range(n // CONNECTIONS):
            done.clear()
            protocol.data_received(raw)
            await done.wait()
        protocol.connection_lost(None)
        assert wire.writes == n // CONNECTIONS

    await asyncio.gather(*(connection() for _ in range(CONNECTIONS)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with Gateway(Config.model_validate(CONFIG)) as gw:
        app = create_app(gw, v1_routes(gw, Authenticator({})))
        config = uvicorn.Config(app, lifespan="off", proxy_headers=False, log_level="warning")
        config.load()
        cases = [(face, direct) for face in ("/rpc", "/v1/embeddings") for direct in (True, False)]
        for face, direct in cases:  # warm every path once
            await requests(config, face, direct, args.requests // 4)
        us: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
        for r in range(args.rounds):
            for face, direct in cases if r % 2 == 0 else cases[::-1]:
                cpu = time.thread_time()
                await requests(config, face, direct, args.requests)
                us[(face, direct)].append((time.thread_time() - cpu) / args.requests * 1e6)
    return {f"{face} {'direct' if direct else 'asgi'}": v for (face, direct), v in us.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=12800)
    args = parser.parse_args()
    result = uvloop.run(run(args))
    rows = []
    for face in ("/rpc", "/v1/embeddings"):
        direct, asgi = result[f"{face} direct"], result[f"{face} asgi"]
        ratios = [d / a for d, a in zip(direct, asgi, strict=True)]
        rows.append([face, f"{statistics.median(asgi):.1f}", f"{statistics.median(direct):.1f}",
                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"])
    print(table(["face", "ASGI path us/request", "direct us/request", "direct vs ASGI (rounds)"], rows))
    print(f"median of {args.rounds} interleaved rounds of {args.requests} requests on {CONNECTIONS} "
          "connections; the event loop's CPU per request, echo provider, no sockets")
    save("bench_http_path", {"params": vars(args), "us_per_request": result})


if __name__ == "__main__":
    main()
