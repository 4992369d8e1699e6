"""A lean fake OpenAI streaming upstream for ``bench_streams``: every POST is a chat stream of
``--chunks`` events (or the request's ``max_tokens``) ``--gap-ms`` apart (the first at once), a
usage chunk and ``[DONE]``, shaped as OpenAI sends them with ``stream_options.include_usage``
(``"usage":null`` on every content chunk). Bare asyncio protocols, one timer per stream: the
fake must stay cheap next to the gateway it feeds. ``GET /stats`` says how many streams were
open at once at most (``POST /reset`` starts the count again); ``GET /`` answers for the
readiness wait.

    python -m benchmarks._stream_fake --port 8123 [--procs 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
CHUNK = (b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"gpt-bench","system_fingerprint":null,"choices":[{"index":0,"delta":'
         b'{"content":"word%d "},"logprobs":null,"finish_reason":null}],"usage":null}')
USAGE = (b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"gpt-bench","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":%d,'
         b'"total_tokens":%d}}')


MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')  # a request's own length, else --chunks


def framed(data: bytes) -> bytes:
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class Stats:
    open = 0
    max_open = 0
    streams = 0


class Fake(asyncio.Protocol):
    def __init__(self, chunks: int, gap: float) -> None:
        self.chunks = chunks
        self.gap = gap
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self._closed()

    def _closed(self) -> None:
        if self.streaming:
            self.streaming = False
            Stats.open -= 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            asked = MAX_TOKENS.search(body)
            self.request(head.split(" ", 2), int(asked.group(1)) if asked else self.chunks)

    def request(self, line: list[str], chunks: int) -> None:
        assert self.transport is not None
        method, path = line[0], line[1]
        if method == "GET" or (method == "POST" and path == "/reset"):
            if path == "/stats":
                body = json.dumps({"max_open": Stats.max_open, "open": Stats.open,
                                   "streams": Stats.streams}).encode()
            else:
                if path == "/reset":
                    Stats.max_open = Stats.open
                    Stats.streams = 0
                body = b"{}"
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
            return
        self.streaming = True
        self.length = chunks
        Stats.open += 1
        Stats.streams += 1
        Stats.max_open = max(Stats.max_open, Stats.open)
        self.transport.write(HEAD + framed(CHUNK % 0))
        self.sent = 1
        loop = asyncio.get_running_loop()
        self.next_at = loop.time() + self.gap
        self.timer = loop.call_at(self.next_at, self.tick)

    def tick(self) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if self.sent < self.length:
            self.transport.write(framed(CHUNK % self.sent))
            self.sent += 1
            self.next_at += self.gap
            self.timer = asyncio.get_running_loop().call_at(self.next_at, self.tick)
            return
        self.timer = None
        self.transport.write(framed(USAGE % (self.length, self.length + 12)) + framed(b"[DONE]")
                             + b"0\r\n\r\n")
        self._closed()


async def serve(port: int, chunks: int, gap: float) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16384)
    server = await asyncio.get_running_loop().create_server(lambda: Fake(chunks, gap), sock=sock)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--procs", type=int, default=1, help="processes on the port (SO_REUSEPORT)")
    args = parser.parse_args()
    children = []
    for _ in range(args.procs - 1):  # /stats is then one process's view: use --procs 1 to count
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)

    def stop(signum: int, frame: object) -> None:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    asyncio.run(serve(args.port, args.chunks, args.gap_ms / 1000))


if __name__ == "__main__":
    main()
