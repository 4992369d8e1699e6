"""The HTTP server's writes in one turn of the event loop leave as one send."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import uvicorn
from uvicorn.server import ServerState

from multiplexer.faces.server_protocol import GatewayHttpProtocol, JoinedWrites


class Wire:
    """A transport that records each write it is asked for."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sent.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> Any:
        return None if name in ("sockname", "peername", "sslcontext", "socket") else f"info:{name}"

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def test_writes_in_one_turn_leave_together_and_later_ones_apart() -> None:
    async def run() -> list[bytes]:
        wire = Wire()
        joined = JoinedWrites(wire, asyncio.get_running_loop())  # type: ignore[arg-type]
        joined.write(b"HTTP/1.1 200 OK\r\n\r\n")
        joined.write(b"body")
        assert wire.sent == []  # held until the turn ends
        await asyncio.sleep(0)
        joined.write(b"chunk")  # a streamed chunk in a later turn
        await asyncio.sleep(0)
        assert joined.get_extra_info("cipher") == "info:cipher"  # the rest is the transport's
        return wire.sent

    assert asyncio.run(run()) == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"chunk"]


def test_close_sends_what_is_held_first_and_a_lost_connection_gets_nothing() -> None:
    async def run() -> tuple[Wire, Wire]:
        loop = asyncio.get_running_loop()
        wire, lost = Wire(), Wire()
        joined = JoinedWrites(wire, loop)  # type: ignore[arg-type]
        joined.write(b"last words")
        joined.close()
        gone = JoinedWrites(lost, loop)  # type: ignore[arg-type]
        gone.write(b"too late")
        lost.close()  # the peer went away before the turn ended
        await asyncio.sleep(0)
        return wire, lost

    wire, lost = asyncio.run(run())
    assert wire.sent == [b"last words"] and wire.closed
    assert lost.sent == []


@pytest.mark.anyio
async def test_the_server_protocol_answers_with_one_write() -> None:
    """uvicorn writes a response's head and body apart; through the gateway's protocol one
    write carries both (a recording transport, so the count does not depend on timing)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    config = uvicorn.Config(app, lifespan="off", proxy_headers=False)
    config.load()
    protocol = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={})
    wire = Wire()
    protocol.connection_made(wire)  # type: ignore[arg-type]
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    for _ in range(10):
        await anyio.lowlevel.checkpoint()
    assert len(wire.sent) == 1
    head, _, body = wire.sent[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"{}"
