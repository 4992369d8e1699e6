"""Command line: serve, call, check-config, paths, demo (the help texts below are what users read)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import anyio

from multiplexer.core.startup import StartupError
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import ConfigError, load_config
from multiplexer.gateway.heap import tune_gc


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
        from multiplexer.faces.siblings import worker_slot
        from multiplexer.server import ServeError, check_start, serve_forever  # uvicorn, faces: only here
        from multiplexer.state_paths import log_where_state_lives
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
        from multiplexer.preflight import check_services

        config.server.workers = 1  # one process on stdin/stdout: it enforces the whole limits
        anyio.run(check_services, config)
        log_where_state_lives(config)  # on stderr, as every log line: stdout is the protocol's
        anyio.run(serve_stdio, config)
        return 0
    if args.workers is not None:
        config.server.workers = _workers_arg(args.workers)
    slot = worker_slot()
    if slot is not None:  # one worker of `serve --workers N`
        config.server.workers = slot.count  # the share of the limits it enforces
    elif config.server.worker_count() > 1:
        from multiplexer.workers import Plan, supervise

        _run(check_start, config, args.host or config.server.host)  # once, before any worker
        log_where_state_lives(config)  # once for all workers, which share the store
        plan = Plan(args.config, args.host or config.server.host,
                    config.server.port if args.port is None else args.port,
                    config.server.worker_count(), config.server.grace_period_s, args.verbose)
        try:
            return supervise(plan)
        except ServeError as e:
            raise CliError(str(e)) from None
    try:
        _run(lambda: serve_forever(config, host=args.host, port=args.port, slot=slot))
    except ServeError as e:
        raise CliError(str(e)) from None
    return 0


def _workers_arg(value: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise CliError(f"--workers: expected a whole number >= 1, or auto; got {value!r}")
    return count


def _call(args: argparse.Namespace) -> int:
    from multiplexer.core.errors import RpcError
    from multiplexer.sdk.client import GatewayUnreachable, SyncClient, gateway_url

    try:
        params: Any = json.loads(args.params) if args.params else None
    except json.JSONDecodeError as e:
        raise CliError(f"PARAMS_JSON is not valid JSON: {e}") from None
    try:
        url = gateway_url(args.url)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        result = SyncClient(url, api_key=args.api_key).call(args.method, params)
    except GatewayUnreachable as e:
        detail = (e.data or {}).get("error")
        raise CliError(f"{e.message} at {url} ({detail}); is `multiplexer serve` running there? "
                       "(--url or MULTIPLEXER_URL picks another)") from None
    except RpcError as e:
        print(json.dumps(e.to_dict(), indent=2), file=sys.stderr)
        return 1
    if isinstance(result, dict) and result.get("isError") is True:  # an MCP tool's own failure
        print(json.dumps(result, indent=2), file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


def _spend(args: argparse.Namespace) -> int:
    import httpx

    from multiplexer.money.report import table
    from multiplexer.sdk.client import gateway_url

    key = os.environ.get("MULTIPLEXER_MASTER_KEY")
    if not key:
        raise CliError("set MULTIPLEXER_MASTER_KEY to the gateway's admin key")
    try:
        url = gateway_url(args.url)
    except ValueError as e:
        raise CliError(str(e)) from None
    query = {k: v for k, v in (("group_by", args.by), ("since", args.since), ("until", args.until)) if v}
    try:
        reply = httpx.get(f"{url}/admin/spend", params=query, timeout=30,
                          headers={"authorization": f"Bearer {key}"})
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the gateway at {url} ({type(e).__name__}: {e})") from None
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise CliError(f"GET /admin/spend: {reply.status_code} {message}")
    print(table(reply.json(), [g for g in args.by.split(",") if g], cache=args.cache))
    return 0


def _check(args: argparse.Namespace) -> int:
    """Validation, then what the config names on this machine and what its routes can serve
    (``gateway/config_checks.py``), every problem in one error as validation reports them."""
    from multiplexer.gateway.config_checks import problems

    config = load_config(args.file)
    lines = problems(config)
    if lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
    print(f"{args.file}: ok ({len(config.providers)} providers, {len(config.routes)} routes)")
    return 0


def _paths(args: argparse.Namespace) -> int:
    from multiplexer.state_paths import state_paths

    rows = state_paths(load_config(args.config), args.config)
    width = max(len(what) for what, _ in rows)
    for what, where in rows:
        print(f"{what:<{width}}  {where}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from multiplexer.demo import run_demo

    logging.getLogger("multiplexer.access").setLevel(logging.WARNING)  # the demo prints its own lines
    config = load_config(args.config)
    config.server.workers = 1  # the demo is one process
    if "path" not in config.store.model_fields_set and config.store.url is None:
        # a show, not a deployment: its jobs and spend go to a folder of its own, not the one it ran in
        with tempfile.TemporaryDirectory(prefix="multiplexer-demo-") as tmp:
            config.store.path = str(Path(tmp) / "multiplexer.db")
            return anyio.run(run_demo, config, args.port)
    return anyio.run(run_demo, config, args.port)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _parser() -> argparse.ArgumentParser:
    from multiplexer.core.version import VERSION

    def command(name: str, summary: str, about: str, *examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=about, epilog=_examples(*examples),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    parser = argparse.ArgumentParser(
        prog="multiplexer", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A gateway in front of model and tool providers: it batches, rate-limits and "
                    "deduplicates\ncalls arriving over /v1 (OpenAI, Anthropic), JSON-RPC, MCP and "
                    "the Python SDK.",
        epilog=_examples("multiplexer serve --config config/remote.example.yaml",
                         "multiplexer call echo '{\"hello\": \"world\"}'"))
    parser.add_argument("--version", action="version", version=f"multiplexer {VERSION}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = command("serve", "run the gateway",
                    "Run the gateway: /v1, /rpc, /mcp, /healthz and /metrics on one port, until stopped.",
                    "multiplexer serve --port 8081   # the packaged default config",
                    "multiplexer serve --stdio   # MCP on stdin/stdout, for a desktop client")
    serve.add_argument("--config", default=DEFAULT_CONFIG,
                       help="YAML config; relative paths in it are its folder's (default: the packaged one)")
    serve.add_argument("--host", default=None, help="address to bind (default: the config's server.host)")
    serve.add_argument("--port", type=int, default=None, help="port (default: the config's server.port)")
    serve.add_argument("--stdio", action="store_true", help="speak MCP on stdin/stdout instead of HTTP")
    serve.add_argument("--workers", default=None, metavar="N",
                       help="gateway processes on the one port, or auto: one per core "
                            "(default: the config's server.workers, 1)")
    serve.set_defaults(fn=_serve)

    call = command("call", "make one call to a running gateway",
                   "Make one call to a running gateway: its result on stdout (exit 0), or its error,\n"
                   "or an MCP tool result with isError, on stderr (exit 1).",
                   "multiplexer call sum '{\"values\": [1, 2, 3]}'",
                   "MULTIPLEXER_URL=gw.internal:8080 multiplexer call tools_echo '{\"text\": \"hi\"}'")
    call.add_argument("method", help="the method, which is also the route or MCP tool name")
    call.add_argument("params", nargs="?", metavar="PARAMS_JSON", help="params as JSON (optional)")
    call.add_argument("--url", default=None,
                      help="the gateway (default: $MULTIPLEXER_URL, else http://127.0.0.1:8080)")
    call.add_argument("--api-key", default=None, help="the caller's key (default: $MULTIPLEXER_API_KEY)")
    call.set_defaults(fn=_call)

    spend = command("spend", "what keys spent and the gateway saved",
                    "Spend and savings from a running gateway (GET /admin/spend with\n"
                    "$MULTIPLEXER_MASTER_KEY), as a table with a total line.",
                    "multiplexer spend --by key,route --since 2026-12-01",
                    "multiplexer spend --by model,day --url gw.internal:8080")
    spend.add_argument("--by", default="key",
                       help="comma-separated groups among key, team, route, model, day (default: key)")
    spend.add_argument("--since", default=None, help="first day, ISO (2026-12-01); default: all")
    spend.add_argument("--until", default=None, help="last day, ISO; default: today")
    spend.add_argument("--cache", action="store_true",
                       help="also the prompt caches' writes, moves and what the moves cost")
    spend.add_argument("--url", default=None,
                       help="the gateway (default: $MULTIPLEXER_URL, else http://127.0.0.1:8080)")
    spend.set_defaults(fn=_spend)

    check = command("check-config", "validate a config file",
                    "Validate a config file: its count of providers and routes, or what is wrong (exit 2).",
                    "multiplexer check-config config/remote.example.yaml",
                    "multiplexer check-config deploy/gateway.yaml && multiplexer serve "
                    "--config deploy/gateway.yaml")
    check.add_argument("file", help="the YAML config to check")
    check.set_defaults(fn=_check)

    paths = command("paths", "where a config's keys, spend, jobs and files live",
                    "Print where the gateway keeps its state with this config, one line each: the\n"
                    "config file, the store (SQLite file, or PostgreSQL URL with its password hidden),\n"
                    "the folder of uploads in progress and, with a local model, the compile verdicts.\n"
                    "Nothing is created or opened.",
                    "multiplexer paths",
                    "multiplexer paths --config deploy/gateway.yaml")
    paths.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: the packaged one)")
    paths.set_defaults(fn=_paths)

    demo = command("demo", "show the gateway at work, offline",
                   "Start the gateway, make sample calls through each face, print them, stop.",
                   "multiplexer demo",
                   "multiplexer demo --config my.yaml --port 9000")
    demo.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: the packaged one)")
    demo.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    demo.set_defaults(fn=_demo)

    from multiplexer.admin_cli import add_commands  # keys and teams over the admin API

    add_commands(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The console script; returns the exit status (argparse's own exits included: --help, --version,
    a usage error) so callers and tests get a number rather than ``SystemExit``."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except StartupError as e:  # a store or the state the config names cannot be used: as a config error
        print(f"multiplexer {args.command}: {e}", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"multiplexer {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
