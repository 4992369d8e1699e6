"""Command line: ``serve``, ``call``, ``check-config``, ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import anyio

from multiplexer.gateway.config import ConfigError, load_config
from multiplexer.gateway.heap import tune_gc

DEFAULT_CONFIG = "config/default.yaml"


class CliError(Exception):
    """A failure the user can act on: printed as one line, exit status 1."""


def _run(fn: Any, *args: Any) -> Any:
    """anyio.run on uvloop when it is installed: a faster event loop for the server."""
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    return anyio.run(fn, *args, backend_options=options)


def _serve(args: argparse.Namespace) -> int:
    try:
        from multiplexer.server import ServeError, serve_forever  # uvicorn and the faces: only here
    except ImportError as e:  # a broken install must not start a gateway that lacks a face
        raise CliError(f"cannot load the server and its faces ({type(e).__name__}: {e}); "
                       "reinstall the package (pip install -e .)") from None

    config = load_config(args.config)
    tune_gc(config.server.gc_young_threshold)
    if config.server.log_format == "json":
        from multiplexer.faces.access import JsonLines

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
    if args.stdio:
        from multiplexer.faces.mcp.stdio import serve_stdio

        anyio.run(serve_stdio, config)
        return 0
    try:
        _run(lambda: serve_forever(config, host=args.host, port=args.port))
    except ServeError as e:
        raise CliError(str(e)) from None
    return 0


def _call(args: argparse.Namespace) -> int:
    import httpx

    from multiplexer.core.errors import RpcError
    from multiplexer.sdk.client import SyncClient

    try:
        params: Any = json.loads(args.params) if args.params else None
    except json.JSONDecodeError as e:
        raise CliError(f"PARAMS_JSON is not valid JSON: {e}") from None
    try:
        result = SyncClient(args.url, api_key=args.api_key).call(args.method, params)
    except RpcError as e:
        print(json.dumps(e.to_dict(), indent=2), file=sys.stderr)
        return 1
    except httpx.TransportError as e:
        raise CliError(f"cannot reach the gateway at {args.url} ({type(e).__name__}: {e}); "
                       "is `multiplexer serve` running there? (--url picks another)") from None
    print(json.dumps(result, indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(f"{args.file}: ok ({len(config.providers)} providers, {len(config.routes)} routes)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from multiplexer.demo import run_demo

    return anyio.run(run_demo, load_config(args.config), args.port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multiplexer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve /v1, /rpc, /mcp, /healthz, /metrics")
    serve.add_argument("--config", default=DEFAULT_CONFIG)
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--stdio", action="store_true", help="speak MCP on stdin/stdout")
    serve.set_defaults(fn=_serve)

    call = sub.add_parser("call", help="make one call to a running gateway")
    call.add_argument("method")
    call.add_argument("params", nargs="?")
    call.add_argument("--url", default="http://127.0.0.1:8080")
    call.add_argument("--api-key", default=None)
    call.set_defaults(fn=_call)

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(fn=_check)

    demo = sub.add_parser("demo", help="start the gateway, make sample calls, print them, stop")
    demo.add_argument("--config", default=DEFAULT_CONFIG)
    demo.add_argument("--port", type=int, default=0)
    demo.set_defaults(fn=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except CliError as e:
        print(f"multiplexer {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
