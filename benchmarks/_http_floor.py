"""The gateway's HTTP server with nothing behind it: what any call over HTTP costs first.

``serve_asgi`` (uvicorn with the gateway's own protocol, on uvloop, as ``multiplexer
serve`` runs it) in front of an ASGI app that reads each request's body and answers a
fixed JSON-RPC result. ``bench_local``'s ``http_floor`` row sends it the echo row's
requests: its CPU per call is what the server and ASGI cost before any of the gateway's
own code (faces, JSON-RPC, admission, lanes) runs. ``GET /metrics`` answers empty, so the
row reads no model CPU.

    python -m benchmarks._http_floor PORT
"""

from __future__ import annotations

import sys
from typing import Any

import anyio

from multiplexer.cli import _run
from multiplexer.server import bind, serve_asgi

REPLY = b'{"jsonrpc":"2.0","result":{},"id":1}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = b"" if scope["path"] == "/metrics" else REPLY
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def main(port: int) -> None:
    sock = bind("127.0.0.1", port)
    async with serve_asgi(app, sock):
        await anyio.sleep_forever()


if __name__ == "__main__":
    _run(main, int(sys.argv[1]))
