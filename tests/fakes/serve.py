"""Run a fake on a real 127.0.0.1 socket, inside the caller's event loop or from the command line.

`serve_app` binds the socket itself (port 0 by default), so the URL is known before uvicorn starts
and there is no race to find a free port; readiness is an event set by uvicorn's own startup.
Needs the asyncio backend (uvicorn is asyncio-only).

    python -m tests.fakes.serve openai --port 8001
    python -m tests.fakes.serve --config config/remote.example.yaml   # every fake it points at

With `--config`, each `openai`, `anthropic`, `gemini`, `mistral` (`base_url`) or `azure_openai` (`endpoint`)
provider whose address is on this machine gets the fake of its kind on the port the URL names;
each prints `fake <kind> API on <url>` once it accepts connections.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import anyio
from starlette.types import ASGIApp

from multiplexer.cli import _run as run_loop
from multiplexer.gateway.config import Config, ConfigError, load_config
from multiplexer.server import bind, serve_asgi

__all__ = ["fakes_for", "serve_app"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
KINDS = ("openai", "anthropic", "gemini", "azure_openai", "mistral")


@contextlib.asynccontextmanager
async def serve_app(app: ASGIApp, host: str = "127.0.0.1", port: int = 0,
                    keepalive_s: float = 5.0, reuse_port: bool = False) -> AsyncIterator[str]:
    """Serve `app` until the block exits; yields its base URL, e.g. `http://127.0.0.1:54321`.
    ``reuse_port``: several processes serve one port (SO_REUSEPORT), as a benchmark's upstream."""
    sock = bind(host, port, reuse_port=reuse_port)
    try:
        async with serve_asgi(app, sock, keepalive_s=keepalive_s) as url:
            yield url
    finally:
        sock.close()


def fakes_for(config: Config) -> list[tuple[str, str, int]]:
    """(kind, host, port) of each fake the config's providers of a faked kind point at locally."""
    found = []
    for pconf in config.providers.values():
        url = urlsplit(str(pconf.extra.get("endpoint" if pconf.kind == "azure_openai" else "base_url", "")))
        if pconf.kind in KINDS and url.hostname in LOCAL_HOSTS and url.port:
            found.append((pconf.kind, url.hostname, url.port))
    return found


def _app(kind: str, args: argparse.Namespace) -> ASGIApp:
    if kind == "openai":
        from tests.fakes.openai_fake import create_app
    elif kind == "gemini":
        from tests.fakes.gemini_fake import create_app  # type: ignore[assignment]
    elif kind == "azure_openai":
        from tests.fakes.vendor_fakes import create_azure_app as create_app  # type: ignore[assignment]
    elif kind == "mistral":
        from tests.fakes.mistral_fake import create_app  # type: ignore[assignment]
    else:
        from tests.fakes.anthropic_fake import create_app  # type: ignore[assignment]
    app = create_app()
    fake = app.state.fake
    fake.latency_s = args.latency_ms / 1000
    if args.requests_per_window is not None:
        fake.limiter.requests_per_window = args.requests_per_window
    return app


async def _serve(targets: list[tuple[str, str, int]], args: argparse.Namespace) -> None:
    """Every fake at once, each URL printed only once it accepts connections (scripts wait on it)."""
    async with contextlib.AsyncExitStack() as stack:
        for kind, host, port in targets:
            url = await stack.enter_async_context(serve_app(_app(kind, args), host, port,
                                                            args.keepalive_s, args.reuse_port))
            print(f"fake {kind} API on {url}", flush=True)
        await anyio.sleep_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fakes.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("provider", nargs="?", choices=list(KINDS))
    parser.add_argument("--config", help="start the fakes this gateway config points at instead")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="model time per answer")
    parser.add_argument("--requests-per-window", type=int, default=None,
                        help="the request limit the headers report (per 60 s window)")
    parser.add_argument("--keepalive-s", type=float, default=5.0,
                        help="an idle client connection is closed after this (benchmarks: long)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="share the port with other processes (SO_REUSEPORT; benchmarks)")
    args = parser.parse_args(argv)
    if args.config is not None:
        try:
            targets = fakes_for(load_config(args.config))
        except ConfigError as e:
            parser.error(str(e))
        if not targets:
            parser.error(f"{args.config} points no openai or anthropic provider at this machine")
    elif args.provider is not None:
        targets = [(args.provider, args.host, args.port)]
    else:
        parser.error("name a provider (openai, anthropic) or --config")
    with contextlib.suppress(KeyboardInterrupt):
        run_loop(_serve, targets, args)


if __name__ == "__main__":
    main()
