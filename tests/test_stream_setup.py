"""What a stream costs beyond its chunks: its upstream connection kept for the next call when the
stream stopped at its last event with the reply's end already read, closed when it was not; a
stream run in its caller's task (no worker task parked on it) unless its lane would hold it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import anyio.abc
import httpx
import pytest

from multiplexer.core.call import Call, Item, Outcome
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.core.sink import ChunkSink
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
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


class Streams(Provider):
    """A streaming provider that notes the task each stream runs in; every stream holds until
    its gate opens."""

    def __init__(self, ctx: ProviderContext | None = None) -> None:
        self.name = "p"
        self.gate = anyio.Event()
        self.tasks: list[asyncio.Task | None] = []
        self.started = 0

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        return [Outcome(result=i.params) for i in items]

    async def stream(self, item: Item, sink: ChunkSink) -> Outcome:
        self.tasks.append(asyncio.current_task())
        self.started += 1
        await self.gate.wait()
        await sink.send({"n": item.params["n"]})
        return Outcome(result={"n": item.params["n"]})


class Reader:
    def __init__(self) -> None:
        self.chunks: list[object] = []

    async def send(self, chunk: object) -> None:
        self.chunks.append(chunk)

    def send_nowait(self, chunk: object) -> None:
        self.chunks.append(chunk)

    def close(self) -> None:
        pass


def streams_config(**batch: object) -> object:
    return parse_config({
        "providers": {"p": {"kind": "echo", "batch": {"max_items": 1, **batch},
                            "limits": {"concurrency": 4}}},
        "routes": {"r": {"provider": "p"}},
    })


async def run_streams(gw: Gateway, prov: Streams, n: int
                      ) -> list[tuple[Outcome, asyncio.Task | None, Reader]]:
    out: list[tuple[Outcome, asyncio.Task | None, Reader]] = []

    async def one(i: int) -> None:
        call = Call("r", {"n": i})
        call.sink = reader = Reader()
        out.append((await gw.submit(call), asyncio.current_task(), reader))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
            while prov.started <= i:  # each stream is open before the next arrives
                await anyio.sleep(0)
        prov.gate.set()
    return out


async def test_a_stream_runs_in_its_callers_task_while_others_stream_on_its_lane() -> None:
    prov = Streams()
    async with Gateway(streams_config(), providers={"p": prov}) as gw:
        await anyio.sleep(0)  # the lane's loop is up
        out = await run_streams(gw, prov, 3)
        assert sorted(o.result["n"] for o, _, _ in out) == [0, 1, 2]
        assert all(r.chunks == [{"n": o.result["n"]}] for o, _, r in out)
        # no worker task per stream: each ran in its caller's own
        assert {id(t) for t in prov.tasks} == {id(t) for _, t, _ in out}
        lane = next(iter(gw.lanes.values()))
        assert lane.in_flight == 0 and gw.limiters["p"].in_flight == 0


async def test_a_stream_a_busy_lanes_formation_would_hold_for_a_batch_still_queues() -> None:
    prov = Streams()
    async with Gateway(streams_config(max_items=4, max_wait_ms=5), providers={"p": prov}) as gw:
        await anyio.sleep(0)
        out = await run_streams(gw, prov, 2)
        assert sorted(o.result["n"] for o, _, _ in out) == [0, 1]
        first, second = sorted(out, key=lambda o: o[0].result["n"])
        assert prov.tasks[0] is first[1]  # an idle lane: the caller's task
        assert prov.tasks[1] is not second[1]  # the lane's formation waited for a batch: a worker
