"""Run a fake on a real 127.0.0.1 socket, inside the caller's event loop or from the command line.

`serve_app` binds the socket itself (port 0 by default), so the URL is known before uvicorn starts
and there is no race to find a free port; readiness is an event set by uvicorn's own startup.
Needs the asyncio backend (uvicorn is asyncio-only).

    python -m tests.fakes.serve openai --port 8001
"""

from __future__ import annotations

import argparse
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn
from starlette.types import ASGIApp

from multiplexer.server import bind, serve_asgi

__all__ = ["serve_app"]


class _AnnouncingServer(uvicorn.Server):
    """CLI server: prints its URL only once it accepts connections, so scripts can wait on stdout."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self.banner, flush=True)


def _config(app: ASGIApp) -> uvicorn.Config:
    return uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)


@contextlib.asynccontextmanager
async def serve_app(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` until the block exits; yields its base URL, e.g. `http://127.0.0.1:54321`."""
    sock = bind(host, port)
    try:
        async with serve_asgi(app, sock) as url:
            yield url
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fakes.serve", description=__doc__)
    parser.add_argument("provider", choices=["openai", "anthropic"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="model time per answer")
    parser.add_argument("--requests-per-window", type=int, default=None,
                        help="the request limit the headers report (per 60 s window)")
    args = parser.parse_args(argv)
    if args.provider == "openai":
        from tests.fakes.openai_fake import create_app
    else:
        from tests.fakes.anthropic_fake import create_app  # type: ignore[assignment]
    app = create_app()
    fake = app.state.fake
    fake.latency_s = args.latency_ms / 1000
    if args.requests_per_window is not None:
        fake.limiter.requests_per_window = args.requests_per_window
    sock = bind(args.host, args.port)
    bound_host, bound_port = sock.getsockname()[:2]
    banner = f"fake {args.provider} API on http://{bound_host}:{bound_port}"
    _AnnouncingServer(_config(app), banner).run(sockets=[sock])


if __name__ == "__main__":
    main()
