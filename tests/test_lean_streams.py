"""Streamed calls on the lean transport (no httpx ``Request`` or ``Response``): events handed
over as they come, an error status before the first event retried or refused as on the whole
path, and the connection handed back for the next request."""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from multiplexer.core.errors import Code
from multiplexer.core.sink import ChunkSink
from multiplexer.transport.http1 import Http1Transport
from providers.openai import OpenAIProvider
from tests.remote_helpers import item, make_provider, started
from tests.test_http1_transport import chunk, serve

pytestmark = pytest.mark.anyio
SSE = b"content-type: text/event-stream\r\ntransfer-encoding: chunked"


async def read_request(stream: anyio.abc.SocketStream) -> bytes:
    """A request's head, its body read too (the next request starts after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += await stream.receive()
    return head


def event(payload: dict[str, Any]) -> bytes:
    return chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")


def delta(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


async def test_an_opened_reply_hands_over_each_event_as_it_comes_and_frees_its_connection():
    more = anyio.Event()
    connections: list[int] = []

    async def upstream(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        async with stream:
            await read_request(stream)
            await stream.send(b"HTTP/1.1 200 OK\r\n" + SSE + b"\r\n\r\n" + chunk(b"data: 1\n\n"))
            await more.wait()  # the first event must reach the caller before the rest exists
            await stream.send(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await read_request(stream)
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    listener, port = await serve()
    transport = Http1Transport()
    url = httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions")
    head = [(b"host", url.netloc), (b"content-length", b"2")]
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream)
        opened = await transport.open("POST", url, head, b"{}", {})
        assert opened.status == 200 and (b"content-type", b"text/event-stream") in opened.headers
        events = aiter(opened)
        assert await anext(events) == b"data: 1\n\n"
        more.set()
        assert b"".join([c async for c in events]) == b"data: 2\n\n"
        reply = await transport.fetch("POST", url, head, b"{}", {})
        assert reply.content == b"ok" and len(connections) == 1  # the same connection, kept alive
        await transport.aclose()
        tg.cancel_scope.cancel()


async def _stream(tmp_path, upstream) -> tuple[Any, list[dict[str, Any]]]:
    listener, port = await serve()
    p = make_provider(OpenAIProvider, {"base_url": f"http://127.0.0.1:{port}/v1", "api_key": "k"},
                      tmp_path, transport=Http1Transport())
    send, receive = anyio.create_memory_object_stream[Any](10)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, upstream)
        async with started(p), send, receive:
            call = item(p, "chat", {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]})
            out = await p.stream(call, ChunkSink(send))
            chunks = [receive.receive_nowait() for _ in range(receive.statistics().current_buffer_used)]
        tg.cancel_scope.cancel()
    return out, chunks


async def test_a_stream_refused_with_503_is_retried_and_then_streams(tmp_path):
    requests: list[bytes] = []

    async def upstream(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            requests.append(await read_request(stream))
            error = json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode()
            await stream.send(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(error), error))
            requests.append(await read_request(stream))  # the retry, on the same connection
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                              "total_tokens": 5}}
            await stream.send(b"HTTP/1.1 200 OK\r\n" + SSE + b"\r\n\r\n" + event(delta("he"))
                              + event(delta("llo")) + event(usage) + chunk(b"data: [DONE]\n\n")
                              + b"0\r\n\r\n")

    out, chunks = await _stream(tmp_path, upstream)
    assert len(requests) == 2 and all(r.startswith(b"POST /v1/chat/completions") for r in requests)
    assert out.error is None and out.result["usage"]["total_tokens"] == 5
    assert [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]] == ["he", "llo"]


async def test_a_stream_refused_with_400_fails_at_once_with_the_upstream_detail(tmp_path):
    requests: list[bytes] = []

    async def upstream(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            requests.append(await read_request(stream))
            error = json.dumps({"error": {"message": "context too long", "type": "invalid_request_error",
                                          "code": "context_length_exceeded"}}).encode()
            await stream.send(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(error), error))
            await anyio.sleep_forever()

    out, chunks = await _stream(tmp_path, upstream)
    assert len(requests) == 1 and chunks == []
    assert out.error is not None and out.error.code == Code.UPSTREAM_ERROR
    assert out.error.data["detail"] == "context too long"
    assert out.error.data["upstream_code"] == "context_length_exceeded"


async def test_a_reply_that_is_not_an_event_stream_is_an_upstream_error(tmp_path):
    async def upstream(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await read_request(stream)
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: 2\r\n\r\n{}")
            await anyio.sleep_forever()

    out, chunks = await _stream(tmp_path, upstream)
    assert chunks == [] and out.error is not None and out.error.code == Code.UPSTREAM_ERROR
    assert "text/event-stream" in out.error.data["detail"]
