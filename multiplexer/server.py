"""Running the gateway: uvicorn on a socket we bind, signals handled for a clean exit."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn

from .auth import Authenticator, is_loopback
from .config import Config, ConfigError
from .gateway import Gateway
from .http import create_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: we own SIGTERM so the exit code stays 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def check_bind(config: Config, allow_public: bool = False) -> None:
    server = config.server
    if server.api_keys or is_loopback(server.host):
        return
    if allow_public or server.allow_public_without_keys:
        log.warning("serving %s without API keys", server.host)
        return
    raise ConfigError(
        f"server.host: refusing to bind non-loopback address {server.host!r} without "
        "server.api_keys (set server.allow_public_without_keys: true to override)"
    )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it Nagle + delayed ACK add ~40 ms to every small response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _faces(gateway: Gateway) -> tuple[list[Any], Any]:
    """Extra routes and a lifespan from optional faces (MCP)."""
    try:
        from .mcp_face import mount_mcp
    except ImportError:
        return [], None
    return mount_mcp(gateway, Authenticator(gateway.config.server.api_keys))


@asynccontextmanager
async def running(config: Config, *, host: str | None = None, port: int | None = None,
                  gateway: Gateway | None = None) -> AsyncIterator[tuple[Gateway, str]]:
    """Gateway + HTTP server in this event loop; yields (gateway, base_url). Port 0 = ephemeral."""
    host = host or config.server.host
    port = config.server.port if port is None else port
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    gw = gateway or Gateway(config)
    async with gw:
        routes, lifespan = _faces(gw)
        app = create_app(gw, routes, lifespan)
        uconf = uvicorn.Config(app, log_level="warning", lifespan="on" if lifespan else "off",
                               access_log=False, timeout_graceful_shutdown=5)
        server = _Server(uconf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            while not server.started:
                if server.should_exit:
                    raise RuntimeError("HTTP server failed to start")
                await anyio.sleep(0.005)
            shown = f"[{host}]" if ":" in host else host
            try:
                yield gw, f"http://{shown}:{actual}"
            finally:
                server.should_exit = True
    sock.close()


async def serve_forever(config: Config, *, host: str | None = None, port: int | None = None,
                        on_ready: Any = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain within the grace period and return."""
    check_bind(config)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with running(config, host=host, port=port) as (gw, url):
            log.info("multiplexer listening on %s", url)
            if on_ready is not None:
                await on_ready(gw, url)
            async for sig in signals:
                log.info("received %s: draining", signal.Signals(sig).name)
                break
