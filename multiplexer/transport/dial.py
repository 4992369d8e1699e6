"""A connected TCP socket to a host, its addresses raced as RFC 8305 ("Happy Eyeballs") says.

Why here: uvloop's ``create_connection`` (the gateway's loop) tries a host's addresses one after
another, so an upstream whose IPv6 route silently drops packets would hold every new connection
until its connect timeout. Here the addresses are tried with both families interleaved, a new
attempt starting every ``ATTEMPT_DELAY_S`` while the earlier ones are pending or as soon as one
fails, and the first to connect wins (the others are closed), as anyio's ``connect_tcp`` does.
The socket is then handed to ``create_connection(sock=...)`` (with TLS where asked).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

ATTEMPT_DELAY_S = 0.25  # RFC 8305's recommended connection attempt delay

Address = tuple[int, int, int, Any]  # family, type, proto, sockaddr
Connect = Callable[[socket.socket, Any], Awaitable[None]]


async def dial(host: str, port: int) -> socket.socket:
    """A connected, non-blocking TCP socket to ``host:port``; raises ``OSError`` when every
    address failed."""
    loop = asyncio.get_running_loop()
    address = literal(host)
    if address is not None:  # nothing to resolve
        addresses: list[Address] = [(address[0], socket.SOCK_STREAM, socket.IPPROTO_TCP,
                                     (address[1], port))]
    else:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = interleaved([(f, t, p, a) for f, t, p, _, a in found])
    if not addresses:
        raise OSError(f"{host} has no address")
    return await race(addresses, loop.sock_connect)


def literal(host: str) -> tuple[int, str] | None:
    """``host`` as an address (IPv6 in brackets or not): its family and its text; None for a
    name to resolve."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return (socket.AF_INET6 if address.version == 6 else socket.AF_INET), str(address)


async def _connected(address: Address, connect: Connect) -> socket.socket:
    """A new non-blocking socket connected to ``address`` by ``connect``; closed if it fails."""
    family, kind, proto, sockaddr = address
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await connect(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def interleaved(addresses: Sequence[Address]) -> list[Address]:
    """The first family's first address, then the other family's first, and so on (RFC 8305 §4),
    each family in the resolver's order."""
    by_family: dict[int, list[Address]] = {}
    for a in addresses:
        by_family.setdefault(a[0], []).append(a)
    queues = list(by_family.values())
    out: list[Address] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


async def race(addresses: Sequence[Address], connect: Connect,
               delay: float = ATTEMPT_DELAY_S) -> socket.socket:
    """The first of ``addresses`` to connect (by ``connect``), attempts started ``delay`` apart;
    one address is simply connected (no task group: a new connection to an upstream named by
    its address, a stream's at a thousand at once, pays no race it cannot have)."""
    if len(addresses) == 1:
        return await _connected(addresses[0], connect)
    winner: socket.socket | None = None
    errors: list[OSError] = []

    async def attempt(address: Address, failed: anyio.Event, scope: anyio.CancelScope) -> None:
        nonlocal winner
        try:
            sock = await _connected(address, connect)
        except OSError as e:
            errors.append(e)
            failed.set()
            return
        if winner is None:
            winner = sock
            scope.cancel()  # the other attempts, and any not started yet
        else:
            sock.close()

    async with anyio.create_task_group() as tg:
        for address in addresses:
            failed = anyio.Event()
            tg.start_soon(attempt, address, failed, tg.cancel_scope)
            with anyio.move_on_after(delay):
                await failed.wait()
    if winner is None:
        raise errors[0] if len(errors) == 1 else OSError(
            f"every address failed: {'; '.join(str(e) for e in errors)}")
    return winner
