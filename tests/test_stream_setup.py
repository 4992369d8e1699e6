"""What a stream costs beyond its chunks: its upstream connection kept for the next call when the
stream stopped at its last event with the reply's end already read, closed when it was not."""

from __future__ import annotations

import anyio
import anyio.abc
import httpx
import pytest

from multiplexer.transport.http1 import Http1Transport
from tests.test_http1_transport import chunk, head, read_request, serve

pytestmark = pytest.mark.anyio
URL_HEADERS = [(b"content-type", b"application/json")]


async def one_stream(transport: Http1Transport, port: int, go: list[anyio.Event]) -> bytes:
    """A streamed request read up to its first bytes (a relay's ``[DONE]``), then closed."""
    body = b"{}"
    headers = [(b"host", b"127.0.0.1:%d" % port), (b"content-length", b"%d" % len(body)),
               *URL_HEADERS]
    opened = await transport.open("POST", httpx.URL(f"http://127.0.0.1:{port}/"), headers, body,
                                  {"read": 5.0, "connect": 5.0, "pool": 5.0})
    rest = opened.rest
    assert rest is not None and opened.first == []
    go[0].set()  # the head is read alone: now the events
    first = b""
    async for data in rest:
        first = data
        break
    await rest.aclose()
    return first


@pytest.mark.parametrize("ended", [True, False])
async def test_a_stream_closed_at_its_last_event_keeps_its_connection_only_when_the_reply_ended(
        ended: bool) -> None:
    connections: list[int] = []
    go = [anyio.Event()]
    end = b"0\r\n\r\n" if ended else b""

    async def streams(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        async with stream:
            for _ in range(2):
                try:
                    await read_request(stream)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                await stream.send(head())
                await go[0].wait()
                go[0] = anyio.Event()
                await stream.send(chunk(b"data: [DONE]\n\n") + end)

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, streams)
        transport = Http1Transport()
        try:
            for _ in range(2):
                assert await one_stream(transport, port, go) == b"data: [DONE]\n\n"
        finally:
            await transport.aclose()
        # ended: one connection for both; cut off before its end: the next dials anew
        assert len(connections) == (1 if ended else 2)
        tg.cancel_scope.cancel()
