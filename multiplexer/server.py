"""Running the gateway: uvicorn on a socket we bind, signals handled for a clean exit."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn

from multiplexer.access.admin import AdminKey
from multiplexer.access.compose import key_store_on
from multiplexer.faces.admin import admin_routes
from multiplexer.faces.auth import Authenticator, is_loopback
from multiplexer.faces.http import create_app
from multiplexer.faces.jobs import attach_jobs
from multiplexer.faces.mcp.http import mount_mcp
from multiplexer.faces.requests import request_routes
from multiplexer.faces.server_protocol import GatewayHttpProtocol
from multiplexer.faces.siblings import Slot, among_siblings
from multiplexer.faces.ui import close_streams, ui_routes
from multiplexer.faces.v1 import v1_routes
from multiplexer.gateway import heap
from multiplexer.gateway.config import Config, ConfigError
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.reload import ConfigReloader, on_reload
from multiplexer.preflight import check_services, live_keys
from multiplexer.state_paths import log_where_state_lives

log = logging.getLogger(__name__)


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside our event loop: readiness is an event, and we own SIGTERM/SIGINT
    (uvicorn's own capture would re-raise the signal after shutdown and spoil exit 0)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()
        self.stopped = anyio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()

    async def run_until_exit(self, sockets: list[socket.socket]) -> None:
        try:
            await self.serve(sockets=sockets)
        finally:
            self.ready.set()
            self.stopped.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@asynccontextmanager
async def serve_asgi(app: Any, sock: socket.socket, *, lifespan: bool = False,
                     keepalive_s: float = 5.0) -> AsyncIterator[str]:
    """Serve an ASGI app on a bound socket until the block exits; yields the base URL.
    ``keepalive_s``: how long an idle connection stays open (uvicorn's default here)."""
    host, port = sock.getsockname()[:2]
    # Our protocol (uvicorn's, plus a disconnect hook per request); no proxy-header rewriting:
    # the gateway never reads the client address, and the middleware cost CPU on every request.
    # uvicorn's access log is off: the app logs its own lines (faces/access.py).
    uconf = uvicorn.Config(app, log_level="warning", lifespan="on" if lifespan else "off",
                           access_log=False, timeout_graceful_shutdown=5,
                           timeout_keep_alive=keepalive_s,  # type: ignore[arg-type]
                           http=GatewayHttpProtocol, proxy_headers=False)
    server = EmbeddedServer(uconf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run_until_exit, [sock])
        try:
            await server.ready.wait()
            if not server.started:
                raise RuntimeError(f"HTTP server failed to start on {host}:{port}")
            yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        finally:
            server.should_exit = True
            with anyio.move_on_after(10, shield=True):
                await server.stopped.wait()


class ServeError(RuntimeError):
    """The server cannot start (the address is taken, not ours to bind, ...): one line for the CLI."""


def check_bind(config: Config, host: str, stored_keys: int = 0) -> None:
    """The one check of the address actually bound (from config or ``--host``): off loopback,
    callers must present a key (``server.api_keys``, or ``stored_keys``: the key store's live
    ones), unless the config says otherwise. The admin key guards only /admin/ and the
    dashboard, ``server.oauth`` only /mcp: neither asks /rpc or /v1 callers for anything."""
    server = config.server
    store = key_store_on(config)
    if is_loopback(host) or server.api_keys or (store and stored_keys > 0):
        return
    if server.allow_public_without_keys:
        log.warning("serving %s without API keys", host)
        return
    why = [part for on, part in ((AdminKey(server.admin_key).enabled,
                                  "the admin key guards only /admin/ and the dashboard"),
                                 (server.oauth is not None, "server.oauth guards only /mcp"),
                                 (store, "the key store holds no live key")) if on]
    if not why:
        raise ConfigError(f"refusing to serve on non-loopback address {host!r} without server.api_keys "
                          "(set server.allow_public_without_keys: true to override)")
    fixes = ["set server.api_keys", *(["create one with `multiplexer keys create`"] if store else []),
             "set server.allow_public_without_keys: true to override"]
    raise ConfigError(f"refusing to serve on non-loopback address {host!r}: callers need no key "
                      f"({', and '.join(why)}): {', '.join(fixes[:-1])}, or {fixes[-1]}")


async def check_start(config: Config, host: str) -> None:
    """Everything checked before anything runs: the stores and the state reachable
    (``StartupError``), then the address (``ConfigError``), with the key store's live keys
    counted where they decide it."""
    await check_services(config)
    server = config.server
    counts = not (is_loopback(host) or server.api_keys) and key_store_on(config)
    check_bind(config, host, await anyio.to_thread.run_sync(live_keys, config) if counts else 0)


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port); ``reuse_port``: shared with the other workers of
    ``serve --workers N``, each binding its own (SO_REUSEPORT: the kernel spreads connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it Nagle + delayed ACK add ~40 ms to every small response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (is another gateway running? choose another with --port)" if port else ""
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


@asynccontextmanager
async def running(config: Config, *, host: str | None = None, port: int | None = None,
                  gateway: Gateway | None = None, slot: Slot | None = None,
                  ) -> AsyncIterator[tuple[Gateway, str]]:
    """Gateway + HTTP server in this event loop; yields (gateway, base_url). Port 0 = ephemeral.
    ``slot``: this process is one worker of ``serve --workers N`` (multiplexer/workers.py)."""
    host = host or config.server.host
    port = config.server.port if port is None else port
    await check_start(config, host)
    if slot is not None and slot.fd is not None:  # the supervisor's socket (no SO_REUSEPORT)
        sock = socket.socket(fileno=slot.fd)
    else:
        sock = bind(host, port, reuse_port=slot is not None)
    if slot is None:  # serve --workers N: its parent said it once
        log_where_state_lives(config)
    gw = gateway or Gateway(config)
    try:
        async with gw:
            attach_jobs(gw)
            auth = Authenticator(config.server.api_keys, gw.keys)  # one for every face: /rpc, /v1, /mcp
            reloader = gw.faces["reloader"] = ConfigReloader(gw, config.source)  # SIGHUP, /admin/reload
            reloader.checks.append(lambda new: check_bind(new, host, 1 if gw.keys.issued else 0))
            on_reload(gw, lambda new: auth.use(new.server.api_keys))
            mcp_routes, lifespan = mount_mcp(gw, auth)
            admin = AdminKey(config.server.admin_key)
            routes = v1_routes(gw, auth) + mcp_routes + admin_routes(gw, admin)
            routes += request_routes(gw, admin, auth, ui=config.server.ui)  # the request log
            if config.server.ui:
                routes += ui_routes(gw, admin, auth)
            app = create_app(gw, routes, lifespan, auth, admin=admin, public=not is_loopback(host))
            gw.faces["app"] = app  # what is mounted, for those who enumerate it
            heap.serving(gw)  # before the first call: no full pauses on start-up's heap after
            async with among_siblings(slot, gw), serve_asgi(
                    app, sock, lifespan=lifespan is not None,
                    keepalive_s=config.server.keepalive_s) as url:
                try:
                    yield gw, url
                finally:
                    close_streams(gw)  # open dashboards end now, not after the grace period
    finally:
        sock.close()


async def serve_forever(config: Config, *, host: str | None = None, port: int | None = None,
                        on_ready: Any = None, slot: Slot | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain within the grace period and return; SIGHUP reads
    the config file again (``gateway/reload.py``), in the gateway's own task group."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with running(config, host=host, port=port, slot=slot) as (gw, url):
            if slot is None:
                log.info("multiplexer listening on %s", url)
            else:
                log.info("worker %d (pid %d) serving on %s", slot.index, os.getpid(), url)
                slot.tell_ready()
            if on_ready is not None:
                await on_ready(gw, url)
            async for sig in signals:
                if sig == signal.SIGHUP:
                    log.info("received SIGHUP: reloading the config")
                    gw.start_background(gw.faces["reloader"].reload, "sighup")
                    continue
                log.info("received %s: draining", signal.Signals(sig).name)
                break
