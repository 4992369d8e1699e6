"""A JSON-RPC upstream that records the time of every request and how many were in flight.

``work {ms, key}`` sleeps ``ms`` then answers its params; executions are counted per
``key``. ``GET /stats`` returns the record, ``POST /reset`` clears it. Run as
``python -m benchmarks._recorder --port N`` (bench_replicas starts it).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class Record:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.executions: Counter[str] = Counter()


rec = Record()


async def one(req: dict[str, Any]) -> dict[str, Any]:
    params = req.get("params") or {}
    rec.executions[str(params.get("key", ""))] += 1
    ms = float(params.get("ms", 0))
    if ms:
        await anyio.sleep(ms / 1000)
    return {"jsonrpc": "2.0", "id": req.get("id"), "result": params}


async def rpc(request: Request) -> JSONResponse:
    rec.times.append(time.monotonic())
    rec.in_flight += 1
    rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)
    try:
        body = await request.json()
        if isinstance(body, list):
            return JSONResponse([await one(r) for r in body])
        return JSONResponse(await one(body))
    finally:
        rec.in_flight -= 1


async def stats(request: Request) -> JSONResponse:
    return JSONResponse({"times": rec.times, "max_in_flight": rec.max_in_flight,
                         "in_flight": rec.in_flight, "executions": dict(rec.executions),
                         "now": time.monotonic()})


async def reset(request: Request) -> JSONResponse:
    global rec
    rec = Record()
    return JSONResponse({})


app = Starlette(routes=[Route("/", rpc, methods=["POST"]), Route("/", stats, methods=["GET"]),
                        Route("/stats", stats), Route("/reset", reset, methods=["POST"])])

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=ap.parse_args().port, log_level="warning")
