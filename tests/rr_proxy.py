"""A round-robin HTTP load balancer for the replica tests and benchmarks: each request (not each
connection) goes to the next backend, the way a balancer without session affinity spreads them.

Responses stream through as they come (an SSE stream stays open until either side closes it). A
backend that refuses the connection is skipped for the next one, as a balancer's health check
would; ``served`` records which backend answered each request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx

from multiplexer.server import bind, serve_asgi

_HOP = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"}


class RoundRobin:
    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self.served: list[int] = []  # the backend index of each request, in order
        self._next = 0
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30, read=None),
                                      limits=httpx.Limits(max_connections=1000))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        target = path.decode() + (("?" + query.decode()) if query else "")
        response = None
        for _ in range(len(self.backends)):
            index = self._next % len(self.backends)
            self._next += 1
            request = self.http.build_request(scope["method"], self.backends[index] + target,
                                              headers=headers, content=body)
            try:
                response = await self.http.send(request, stream=True)
            except httpx.ConnectError:
                continue  # a dead backend: the next one
            self.served.append(index)
            break
        if response is None:
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b"no backend"})
            return
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            async with anyio.create_task_group() as tg:
                async def client_gone() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(client_gone)
                try:
                    async for chunk in response.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError:
                    pass  # the backend went away mid-stream: the client sees the stream end
                await send({"type": "http.response.body", "body": b""})
                tg.cancel_scope.cancel()
        finally:
            await response.aclose()


@asynccontextmanager
async def round_robin(backends: list[str]) -> AsyncIterator[tuple[str, RoundRobin]]:
    """The balancer on a free loopback port; yields (its base URL, the balancer)."""
    proxy = RoundRobin(backends)
    try:
        async with serve_asgi(proxy, bind("127.0.0.1", 0)) as url:
            yield url, proxy
    finally:
        await proxy.http.aclose()


def main() -> None:
    """``python -m tests.rr_proxy --port P URL...``: the balancer as a process of its own (the
    benchmarks keep it off their client's event loop)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()

    async def serve() -> None:
        proxy = RoundRobin(args.backends)
        try:
            async with serve_asgi(proxy, bind("127.0.0.1", args.port)):
                await anyio.sleep_forever()
        finally:
            await proxy.http.aclose()

    anyio.run(serve)


if __name__ == "__main__":
    main()
