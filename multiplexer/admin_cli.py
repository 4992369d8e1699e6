"""``multiplexer keys ...`` and ``multiplexer teams ...``: the admin API from the command line
(``--url`` or ``MULTIPLEXER_URL``, the master key from ``MULTIPLEXER_MASTER_KEY``). Each prints the
API's JSON answer; a refusal is one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx

from multiplexer.access.admin import ENV

Command = Callable[..., argparse.ArgumentParser]


class AdminCliError(Exception):
    """One line for the user (the CLI prints it and exits 1)."""


def _request(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    from multiplexer.sdk.client import gateway_url

    master = os.environ.get(ENV, "")
    if not master:
        raise AdminCliError(f"set {ENV} to the gateway's master key (server.admin_key)")
    headers = {"authorization": f"Bearer {master}", "x-admin-actor": getpass.getuser()}
    url = gateway_url(args.url)
    try:
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise AdminCliError(f"cannot reach {url} ({e}); is the gateway running there?") from None
    try:
        data = r.json()
    except ValueError:
        raise AdminCliError(f"{method} {path}: HTTP {r.status_code}: {r.text[:200]}") from None
    if r.status_code >= 400:
        message = data.get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
        raise AdminCliError(f"{method} {path}: {r.status_code} {message}")
    return data


def _globs(value: str | None) -> list[str] | None:
    return None if value is None else [g.strip() for g in value.split(",") if g.strip()]


def _access(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options the user gave, as the API's fields (absent ones left out)."""
    body: dict[str, Any] = {}
    for name in ("models", "routes", "tools"):
        if getattr(args, name, None) is not None:
            body[name] = _globs(getattr(args, name))
    for name in ("rpm", "tpm", "concurrency", "expires_at", "team", "grace_s", *names):
        if getattr(args, name, None) is not None:
            body[name] = getattr(args, name)
    for name in ("metadata", "budget_usd"):
        raw = getattr(args, name, None)
        if raw is not None:
            try:
                body[name] = json.loads(raw)
            except ValueError as e:
                raise AdminCliError(f"--{name.replace('_', '-')} is not JSON: {e}") from None
    return body


def _print(data: Any) -> int:
    json.dump(data, sys.stdout, indent=2)
    print()
    return 0


def _access_options(p: argparse.ArgumentParser, team: bool = True) -> None:
    p.add_argument("--models", help="comma-separated globs of models it may use")
    p.add_argument("--routes", help="comma-separated globs of routes (methods)")
    p.add_argument("--tools", help="comma-separated globs of MCP tools")
    p.add_argument("--rpm", type=float)
    p.add_argument("--tpm", type=float)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--budget-usd", dest="budget_usd", help='JSON, e.g. \'{"daily": "5"}\'')
    p.add_argument("--metadata", help="JSON object")
    if team:
        p.add_argument("--team")
        p.add_argument("--expires-at", dest="expires_at", help="ISO 8601 time, e.g. 2027-01-01T00:00:00Z")


def _url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="the gateway (default: $MULTIPLEXER_URL, else http://127.0.0.1:8080)")


def add_commands(command: Command) -> None:
    keys = command("keys", "manage API keys through the admin API",
                   f"Create, list, show, update, rotate and revoke keys ({ENV} must hold the master key).",
                   "multiplexer keys create --name ci --team red --models 'gpt-4o*'",
                   "multiplexer keys rotate key_0123abcd --grace-s 3600")
    kinds = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = kinds.add_parser("create", help="a new key; its value is printed this once")
    create.add_argument("--name", required=True)
    _access_options(create)
    update = kinds.add_parser("update", help="change a key's fields")
    update.add_argument("id")
    update.add_argument("--name")
    _access_options(update)
    listing = kinds.add_parser("list", help="every key (never their values)")
    listing.add_argument("--team")
    show = kinds.add_parser("show", help="one key")
    show.add_argument("id")
    rotate = kinds.add_parser("rotate", help="a new value; the old one stays valid for the grace period")
    rotate.add_argument("id")
    rotate.add_argument("--grace-s", dest="grace_s", type=float)
    revoke = kinds.add_parser("revoke", help="refuse the key from now on, on every replica")
    revoke.add_argument("id")
    for p in (create, update, listing, show, rotate, revoke):
        _url(p)
    keys.set_defaults(fn=run_keys)

    teams = command("teams", "manage teams through the admin API",
                    "Create, list and update teams: defaults their keys narrow.",
                    "multiplexer teams create red --models 'gpt-*' --rpm 600")
    tkinds = teams.add_subparsers(dest="action", required=True, metavar="ACTION")
    tcreate = tkinds.add_parser("create", help="a new team")
    tcreate.add_argument("name")
    _access_options(tcreate, team=False)
    tupdate = tkinds.add_parser("update", help="change a team's defaults")
    tupdate.add_argument("name")
    _access_options(tupdate, team=False)
    tlist = tkinds.add_parser("list", help="every team")
    for p in (tcreate, tupdate, tlist):
        _url(p)
    teams.set_defaults(fn=run_teams)

    tools = command("tools", "pinned MCP tools and the tool-call audit, through the admin API",
                    "List pinned MCP tools (a quarantined one with what changed), approve a changed "
                    "definition, read the audit of tools/call.",
                    "multiplexer tools list --quarantined",
                    "multiplexer tools approve search:lookup",
                    "multiplexer tools audit --key ci --status refused --limit 20")
    tkinds2 = tools.add_subparsers(dest="action", required=True, metavar="ACTION")
    tools_list = tkinds2.add_parser("list", help="every pinned tool; a quarantined one with its diff")
    tools_list.add_argument("--quarantined", action="store_true", help="only those held back")
    approve = tkinds2.add_parser("approve", help="serve a quarantined tool's new definition")
    approve.add_argument("id", help="PROVIDER:TOOL, as `tools list` shows it")
    approve.add_argument("--hash", help="approve only if the tool still serves the definition of this "
                                        "hash (the `hash` `tools list` showed)")
    audit = tkinds2.add_parser("audit", help="the record of tools/call, newest first")
    audit.add_argument("--key", help="one key's calls (its name or id, or an OAuth subject)")
    audit.add_argument("--tool")
    audit.add_argument("--status", choices=["ok", "error", "refused", "input_required"])
    audit.add_argument("--since", type=float, help="Unix seconds")
    audit.add_argument("--until", type=float, help="Unix seconds")
    audit.add_argument("--limit", type=int)
    audit.add_argument("--cursor", help="next_cursor of the page before")
    for p in (tools_list, approve, audit):
        _url(p)
    tools.set_defaults(fn=run_tools)


def _reported(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except AdminCliError as e:
            print(f"multiplexer {args.command} {args.action}: {e}", file=sys.stderr)
            return 1

    return run


@_reported
def run_keys(args: argparse.Namespace) -> int:
    action = args.action
    if action == "create":
        return _print(_request(args, "POST", "/admin/keys", _access(args, "name")))
    if action == "list":
        query = f"?team={args.team}" if args.team else ""
        return _print(_request(args, "GET", "/admin/keys" + query))
    if action == "show":
        return _print(_request(args, "GET", f"/admin/keys/{args.id}"))
    if action == "update":
        return _print(_request(args, "PATCH", f"/admin/keys/{args.id}", _access(args, "name")))
    if action == "rotate":
        return _print(_request(args, "POST", f"/admin/keys/{args.id}/rotate", _access(args)))
    return _print(_request(args, "DELETE", f"/admin/keys/{args.id}"))


@_reported
def run_teams(args: argparse.Namespace) -> int:
    if args.action == "create":
        return _print(_request(args, "POST", "/admin/teams", {"name": args.name, **_access(args)}))
    if args.action == "update":
        return _print(_request(args, "PATCH", f"/admin/teams/{args.name}", _access(args)))
    return _print(_request(args, "GET", "/admin/teams"))


@_reported
def run_tools(args: argparse.Namespace) -> int:
    from urllib.parse import quote, urlencode

    if args.action == "list":
        return _print(_request(args, "GET", "/admin/mcp/tools" + ("?status=quarantined"
                                                                  if args.quarantined else "")))
    if args.action == "approve":
        body = {"hash": args.hash} if args.hash else None
        return _print(_request(args, "POST", f"/admin/mcp/tools/{quote(args.id, safe=':')}/approve", body))
    query = {k: getattr(args, k) for k in ("key", "tool", "status", "since", "until", "limit", "cursor")
             if getattr(args, k) is not None}
    return _print(_request(args, "GET", "/admin/audit/tools" + (f"?{urlencode(query)}" if query else "")))
