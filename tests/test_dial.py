"""Connecting to a host's addresses as RFC 8305 says: both families interleaved, attempts raced."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest

from multiplexer.transport.dial import dial, interleaved, race

pytestmark = pytest.mark.anyio
V6, V4 = socket.AF_INET6, socket.AF_INET


def addr(family: int, host: str) -> tuple[int, int, int, Any]:
    return family, socket.SOCK_STREAM, socket.IPPROTO_TCP, (host, 443)


def test_families_take_turns_each_in_the_resolvers_order() -> None:
    found = [addr(V6, "a6"), addr(V6, "b6"), addr(V6, "c6"), addr(V4, "a4"), addr(V4, "b4")]
    assert [a[3][0] for a in interleaved(found)] == ["a6", "a4", "b6", "b4", "c6"]


async def test_an_address_that_never_answers_loses_to_the_next_one() -> None:
    """The first address hangs (a route that drops packets); the second starts after the attempt
    delay and wins; the hanging attempt is cancelled and its socket closed."""
    started: list[str] = []
    hung: list[socket.socket] = []

    async def connect(sock: socket.socket, sockaddr: Any) -> None:
        started.append(sockaddr[0])
        if sockaddr[0] == "black-hole":
            hung.append(sock)
            await anyio.sleep_forever()

    sock = await race([addr(V6, "black-hole"), addr(V4, "fine")], connect, delay=0.01)
    try:
        assert started == ["black-hole", "fine"] and sock.family == V4
        assert hung[0].fileno() == -1  # closed when its attempt was cancelled
    finally:
        sock.close()


async def test_a_failed_attempt_starts_the_next_at_once_and_all_failing_raise() -> None:
    async def refuse(sock: socket.socket, sockaddr: Any) -> None:
        raise ConnectionRefusedError(f"refused by {sockaddr[0]}")

    with anyio.fail_after(5):  # the attempt delay is an hour: no attempt waits for it
        with pytest.raises(OSError, match="refused by one; refused by two"):
            await race([addr(V4, "one"), addr(V4, "two")], refuse, delay=3600)


async def test_dial_connects_to_a_literal_and_to_a_name() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        for host in ("127.0.0.1", "localhost"):
            sock = await dial(host, port)
            peer, _ = listener.accept()
            try:
                assert sock.getpeername() == peer.getsockname()
            finally:
                peer.close()
                sock.close()
    finally:
        listener.close()
