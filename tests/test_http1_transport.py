"""The lean httpx transport: keep-alive reuse, stale connections, timeouts, errors."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import re
import socket
import ssl
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
from anyio.streams.tls import TLSListener

from multiplexer.transport.http1 import Http1Transport, ResponseTooLarge

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
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
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
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"http://127.0.0.1:{port}/", content=b"x")
        tg.cancel_scope.cancel()
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
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
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            r = await client.post(f"http://127.0.0.1:{port}/rpc?x=1", json={"q": 2},
                                  headers={"authorization": "Bearer k"})
        assert r.status_code == 418 and r.headers["x-test"] == "yes" and r.json() == {"a": 1}
        assert seen[0].startswith(b"POST /rpc?x=1 HTTP/1.1") and b"Bearer k" in seen[0]
        tg.cancel_scope.cancel()


def head(length: int | None = None, status: int = 200) -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"HTTP/1.1 %d OK\r\n%s\r\n\r\n" % (status, size)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_long_reply_streams_and_its_connection_is_reused_after_the_end() -> None:
    more = anyio.Event()
    connections: list[int] = []

    async def stream_events(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        async with stream:
            await read_request(stream)
            await stream.send(head() + chunk(b"data: 1\n\n"))
            await more.wait()  # the client must see the first event before the rest exists
            await stream.send(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await read_request(stream)
            await stream.send(REPLY)

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, stream_events)
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            request = client.build_request("POST", f"http://127.0.0.1:{port}/", json={})
            response = await client.send(request, stream=True)
            lines = response.aiter_lines()
            assert await anext(lines) == "data: 1"
            more.set()
            assert [line async for line in lines] == ["", "data: 2", ""]
            await response.aclose()
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        assert len(connections) == 1
        tg.cancel_scope.cancel()


async def test_a_reply_over_the_size_cap_fails_and_the_cap_can_be_lifted_per_request() -> None:
    async def big(stream: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):  # client hung up
            async with stream:
                while True:
                    request = await read_request(stream)
                    if b"/declared" in request:
                        await stream.send(head(2048) + b"x" * 2048)
                    else:  # no length up front: counted as it arrives
                        await stream.send(head() + chunk(b"x" * 700) + chunk(b"x" * 700)
                                          + b"0\r\n\r\n")

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, big)
        transport = Http1Transport(max_response_bytes=1024)
        async with httpx.AsyncClient(transport=transport) as client:
            for path in ("/declared", "/chunked"):
                with pytest.raises(ResponseTooLarge, match="1024-byte cap"):
                    await client.get(f"http://127.0.0.1:{port}{path}")
            request = client.build_request("GET", f"http://127.0.0.1:{port}/declared",
                                           extensions={"max_response_bytes": None})
            assert len((await client.send(request)).content) == 2048
        tg.cancel_scope.cancel()


async def test_pool_cap_holds_requests_until_a_connection_is_free_then_times_out() -> None:
    open_now, most = 0, 0
    release = anyio.Event()
    arrived = anyio.Event()

    async def held(stream: anyio.abc.SocketStream) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            async with stream:
                with contextlib.suppress(anyio.EndOfStream):  # the client closed its pool
                    while True:
                        await read_request(stream)
                        if open_now == 2:
                            arrived.set()
                        await release.wait()
                        await stream.send(REPLY)
        finally:
            open_now -= 1

    listener, port = await serve()
    url = f"http://127.0.0.1:{port}/"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, held)
        transport = Http1Transport(max_connections=2)
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, pool=0.05)) as c:
            results: list[str] = []

            async def get() -> None:
                results.append((await c.get(url)).text)

            async with anyio.create_task_group() as calls:
                calls.start_soon(get)
                calls.start_soon(get)
                await arrived.wait()  # both connections busy: a third waits, then gives up
                with pytest.raises(httpx.PoolTimeout):
                    await c.get(url)
                for _ in range(3):
                    calls.start_soon(get)
                release.set()
            assert results == ["ok"] * 5 and most == 2
        tg.cancel_scope.cancel()


async def test_write_timeout_when_the_upstream_stops_reading() -> None:
    # A listening socket nobody accepts from: the kernel completes the handshake and then
    # holds what fits in a small receive buffer (an anyio server would read into memory).
    with socket.socket() as deaf:
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.bind(("127.0.0.1", 0))
        deaf.listen()
        port = deaf.getsockname()[1]
        timeout = httpx.Timeout(5, write=0.2)
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=timeout) as client:
            with pytest.raises(httpx.WriteTimeout):
                await client.post(f"http://127.0.0.1:{port}/", content=b"x" * (16 << 20))


async def test_a_post_on_a_connection_the_server_closed_goes_on_a_fresh_one() -> None:
    requests: list[bytes] = []
    closed = anyio.Event()

    async def one_reply_then_close(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            requests.append(await read_request(stream))
            await stream.send(REPLY)
        closed.set()

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, one_reply_then_close)
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            assert (await client.post(f"http://127.0.0.1:{port}/", content=b"1")).text == "ok"
            await closed.wait()  # the kept-alive connection is now dead: seen before the write
            assert (await client.post(f"http://127.0.0.1:{port}/", content=b"2")).text == "ok"
        assert len(requests) == 2
        tg.cancel_scope.cancel()


async def test_a_post_the_server_read_then_dropped_is_not_sent_again() -> None:
    requests: list[bytes] = []

    async def reads_then_drops(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            requests.append(await read_request(stream))
            if len(requests) == 1:
                await stream.send(REPLY)
                requests.append(await read_request(stream))  # read the POST, then vanish

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, reads_then_drops)
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            with pytest.raises(httpx.ReadError):  # it may have run: the caller decides
                await client.post(f"http://127.0.0.1:{port}/", content=b"charge")
        assert len(requests) == 2  # one GET and the POST once, never resent
        tg.cancel_scope.cancel()


async def test_replies_httptools_frames_and_what_it_refuses() -> None:
    """100 Continue before the reply, a body that ends at close, Connection: close, HEAD,
    a malformed reply; a header with a line break is never sent."""
    connections: list[bytes] = []
    replies = {
        b"/continue": b"HTTP/1.1 100 Continue\r\n\r\n" + REPLY,
        b"/until-close": b"HTTP/1.1 200 OK\r\n\r\nall of it",
        b"/close": b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"/head": b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n",
        b"/garbage": b"HTTP/1.1 two hundred\r\n\r\n",
    }

    async def answer(stream: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            async with stream:
                while True:
                    request = await read_request(stream)
                    connections.append(request)
                    path = request.split(b" ")[1]
                    await stream.send(replies[path])
                    if path in (b"/until-close", b"/close", b"/garbage"):
                        return

    listener, port = await serve()
    url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, answer)
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            assert (await client.get(f"{url}/continue")).text == "ok"
            assert (await client.get(f"{url}/until-close")).text == "all of it"
            assert (await client.get(f"{url}/close")).text == "ok"
            head = await client.head(f"{url}/head")
            assert head.status_code == 200 and head.content == b""
            with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
                await client.get(f"{url}/garbage")
            with pytest.raises(httpx.LocalProtocolError):
                await client.get(f"{url}/continue", headers={"x-evil": "a\r\nx-injected: 1"})
        assert not any(b"x-injected" in r for r in connections)
        tg.cancel_scope.cancel()


async def test_a_big_streamed_body_pauses_reading_until_the_consumer_drains_it() -> None:
    from multiplexer.transport.connection import HIGH_WATER

    total, piece = 64 << 20, b"x" * (1 << 20)
    sent = [0]
    connections: list[int] = []

    async def big_body(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            async with stream:
                await read_request(stream)
                await stream.send(head(total))
                while sent[0] < total:
                    await stream.send(piece)
                    sent[0] += len(piece)
                await read_request(stream)
                await stream.send(REPLY)

    listener, port = await serve()
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, big_body)
        transport = Http1Transport(max_response_bytes=None)
        url = f"http://127.0.0.1:{port}/"
        response = await transport.handle_async_request(httpx.Request("GET", url))
        conn = response.stream._conn  # type: ignore[attr-defined]
        chunks = response.aiter_raw()
        got = len(await anext(chunks)) + len(await anext(chunks))  # one after the head's read
        with anyio.fail_after(10):
            while not conn.read_paused:  # the consumer stopped: reading pauses, not buffers
                await anyio.sleep(0.005)
            assert conn.unread <= HIGH_WATER + (1 << 20) and sent[0] < total
            async for data in chunks:  # draining resumes reading, to the end of the reply
                got += len(data)
        assert got == total and not conn.read_paused
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.get(url)).text == "ok"
        assert len(connections) == 1  # kept alive after the stream was read to its end
        tg.cancel_scope.cancel()


async def test_an_idle_connection_the_peer_closed_or_wrote_to_is_not_reused() -> None:
    connections: list[int] = []
    pooled = anyio.Event()

    async def reply_then_misbehave(stream: anyio.abc.SocketStream) -> None:
        connections.append(1)
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            async with stream:
                path = (await read_request(stream)).split(b" ")[1]
                await stream.send(REPLY)
                if path == b"/next":
                    return
                await pooled.wait()  # the client holds the connection as idle
                if path == b"/stray":  # an unasked-for reply on the idle connection
                    await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nbad")
                    await read_request(stream)
                    await stream.send(REPLY)

    listener, port = await serve()
    url, origin = f"http://127.0.0.1:{port}", ("http", "127.0.0.1", port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, reply_then_misbehave)
        transport = Http1Transport()
        async with httpx.AsyncClient(transport=transport) as client:
            for path in ("/close", "/stray"):
                pooled = anyio.Event()
                assert (await client.get(f"{url}{path}")).text == "ok"
                (idle,) = transport._idle[origin]
                pooled.set()
                with anyio.fail_after(5):
                    while not idle.closed:  # the loop reports the close or the stray bytes
                        await anyio.sleep(0.005)
                assert (await client.post(f"{url}/next", content=b"x")).text == "ok"
                assert idle not in transport._idle[origin]
        assert len(connections) == 4  # each dead connection was replaced, none was written to
        tg.cancel_scope.cancel()


async def test_cancelling_a_request_mid_read_closes_its_connection_and_frees_its_slot() -> None:
    got_request = anyio.Event()
    hung_up: list[str] = []

    async def stall(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            path = (await read_request(stream)).split(b" ")[1]
            if path == b"/ok":
                await stream.send(REPLY)
                return
            if path == b"/body":  # a head, part of the body, then nothing
                await stream.send(head() + chunk(b"data: 1\n\n"))
            got_request.set()
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                await stream.receive()  # until the client hangs up
            hung_up.append(path.decode())

    listener, port = await serve()
    url = f"http://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, stall)
        # one connection at most: the next request gets it only if the cancelled one freed it
        transport = Http1Transport(max_connections=1)
        timeout = httpx.Timeout(5, pool=1)
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            for path in ("/head", "/body"):
                got_request = anyio.Event()

                async def call(path: str = path) -> None:
                    async with client.stream("GET", f"{url}{path}") as response:
                        await response.aread()

                async with anyio.create_task_group() as calls:
                    calls.start_soon(call)
                    await got_request.wait()  # waiting for the head, or for more of the body
                    calls.cancel_scope.cancel()
                assert (await client.get(f"{url}/ok")).text == "ok"
        with anyio.fail_after(5):
            while len(hung_up) < 2:
                await anyio.sleep(0.005)
        assert hung_up == ["/head", "/body"]
        tg.cancel_scope.cancel()


def tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a self-signed certificate for 127.0.0.1, and a client's that trusts it."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return server, ssl.create_default_context(cafile=tmp_path / "cert.pem")


async def test_https_keeps_alive_and_a_body_ended_by_an_unclean_tls_close_is_whole(
        tmp_path: Path) -> None:
    server_tls, client_tls = tls_contexts(tmp_path)
    connections: list[int] = []

    async def answer(stream: anyio.abc.ByteStream) -> None:
        connections.append(1)
        async with stream:
            while True:
                request = await read_request(stream)  # type: ignore[arg-type]
                if b"/until-close" in request:  # then no close_notify: the TCP close ends it
                    await stream.send(b"HTTP/1.1 200 OK\r\n\r\nall of it")
                    return
                await stream.send(REPLY)

    listener, port = await serve()
    tls_listener = TLSListener(listener, server_tls, standard_compatible=False)
    async with tls_listener, anyio.create_task_group() as tg:
        tg.start_soon(tls_listener.serve, answer)
        async with httpx.AsyncClient(transport=Http1Transport(verify=client_tls)) as client:
            for _ in range(2):
                assert (await client.get(f"https://127.0.0.1:{port}/")).text == "ok"
            assert len(connections) == 1
            assert (await client.get(f"https://127.0.0.1:{port}/until-close")).text == "all of it"
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(f"https://127.0.0.1:{port}/")  # not trusted by default
        async with httpx.AsyncClient(transport=Http1Transport(verify=False)) as client:
            assert (await client.get(f"https://127.0.0.1:{port}/")).text == "ok"  # as httpx's verify=False
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(("name", "value"), [(b"x-evil", b"a\r\nx-injected: 1"), (b"x-nul", b"a\0b"),
                                             (b"x-bad\n", b"v")])
def test_a_header_that_would_split_its_line_is_refused_by_name(name: bytes, value: bytes) -> None:
    from multiplexer.transport.http1 import _wire

    headers = [(b"host", b"example.test"), (name, value), (b"x-fine", b"ok")]
    with pytest.raises(httpx.LocalProtocolError, match=re.escape(repr(name))):
        _wire("POST", b"/v1", headers, b"{}", None)
    assert _wire("POST", b"/v1", [headers[0], headers[2]], b"{}", None) == (
        b"POST /v1 HTTP/1.1\r\nhost: example.test\r\nx-fine: ok\r\n\r\n{}")
