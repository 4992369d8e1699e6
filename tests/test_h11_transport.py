"""The lean httpx transport: keep-alive reuse, stale connections, timeouts, errors."""

from __future__ import annotations

import anyio
import anyio.abc
import httpx
import pytest

from providers.h11_transport import H11Transport

pytestmark = pytest.mark.anyio
REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


async def serve() -> tuple[anyio.abc.SocketListener, int]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    return listener, listener.extra(anyio.abc.SocketAttribute.local_port)


async def read_request(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    return data


async def test_reuses_one_connection_and_recovers_from_a_stale_one() -> None:
    connections: list[int] = []

    async def handler(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        async with stream:
            await read_request(stream)
            await stream.send(REPLY)
            if len(connections) == 1:
                await read_request(stream)
                await stream.send(REPLY)
            # the second connection closes after one reply without saying so

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        async with httpx.AsyncClient(transport=H11Transport()) as client:
            for _ in range(2):
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            assert len(connections) == 1  # kept alive
            for _ in range(2):  # first conn closes; then a stale one is replaced silently
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            assert len(connections) == 3
        tg.cancel_scope.cancel()


async def test_read_timeout_and_connect_error_map_to_httpx_exceptions() -> None:
    async def silent(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await read_request(stream)
            await anyio.sleep_forever()

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, silent)
        async with httpx.AsyncClient(transport=H11Transport(), timeout=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"http://127.0.0.1:{port}/", content=b"x")
        tg.cancel_scope.cancel()
    async with httpx.AsyncClient(transport=H11Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("http://127.0.0.1:9/")


async def test_body_headers_and_status_round_trip() -> None:
    seen: list[bytes] = []

    async def echo(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = await read_request(stream)
            seen.append(head)
            body = b'{"a":1}'
            await stream.send(b"HTTP/1.1 418 I'm a teapot\r\nx-test: yes\r\ncontent-length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body)

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, echo)
        async with httpx.AsyncClient(transport=H11Transport()) as client:
            r = await client.post(f"http://127.0.0.1:{port}/rpc?x=1", json={"q": 2},
                                  headers={"authorization": "Bearer k"})
        assert r.status_code == 418 and r.headers["x-test"] == "yes" and r.json() == {"a": 1}
        assert seen[0].startswith(b"POST /rpc?x=1 HTTP/1.1") and b"Bearer k" in seen[0]
        tg.cancel_scope.cancel()
