"""Seeded fuzz inputs for ``/mcp``: MCP over Streamable HTTP, one message per POST.

Valid cases are 2026-07-28 requests (``_meta`` envelope plus the matching
``MCP-Protocol-Version`` / ``Mcp-Method`` / ``Mcp-Name`` headers), so the fuzz gets
past the transport's checks into the gateway; the other classes break them.
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks.fuzz_inputs import (
    ABSENT,
    BAD_AUTH,
    Case,
    Limits,
    deep_body,
    dumps,
    huge_id,
    invalid_utf8,
    malformed,
    mutate_bytes,
    mutate_obj,
    oversized,
    random_bytes,
    rpc_params,
    wrong_types,
)

MCP_CLASSES: dict[str, int] = {
    "valid": 15, "mutated": 30, "bad_headers": 10, "malformed_json": 8, "wrong_types": 8,
    "huge_ids": 6, "deep_nesting": 5, "batch_array": 3, "invalid_utf8": 6, "oversized": 2,
    "random_bytes": 5, "bad_auth": 2,
}
MODERN = "2026-07-28"
MODERN_META = {"io.modelcontextprotocol/protocolVersion": MODERN,
               "io.modelcontextprotocol/clientCapabilities": {}}
MCP_TOOLS = ["echo", "subtract", "sum", "get_data", "fail", "no_such_tool", "calc_echo"]


def mcp_message(rng: random.Random) -> dict[str, Any]:
    method = rng.choice(["tools/call"] * 6 + ["tools/list", "server/discover", "ping",
                                              "resources/list", "nope/nope"])
    params: dict[str, Any] = {"_meta": dict(MODERN_META)}
    if method == "tools/call":
        tool = rng.choice(MCP_TOOLS)
        args = rpc_params(rng, tool)
        if args is ABSENT:
            args = {}
        elif not isinstance(args, dict):
            args = {"values": args} if tool == "sum" else {"v": args}
        params.update(name=tool, arguments=args)
    msg = {"jsonrpc": "2.0", "id": rng.choice([rng.randint(0, 10**6), f"m{rng.randint(0, 999)}"]),
           "method": method, "params": params}
    if rng.random() < 0.05:
        del msg["id"]
    return msg


def mcp_headers(key: str, msg: Any) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": MODERN, "authorization": f"Bearer {key}"}
    if isinstance(msg, dict):
        if _header_value(msg.get("method")):
            headers["mcp-method"] = msg["method"]
        params = msg.get("params")
        if isinstance(params, dict) and _header_value(params.get("name")):
            headers["mcp-name"] = params["name"]
    return headers


def _header_value(value: Any) -> bool:
    """Whether an HTTP client can send ``value`` as a header at all (else leave the header out)."""
    return isinstance(value, str) and value.isascii() and value.isprintable() and value == value.strip()


def bad_headers(rng: random.Random, headers: dict[str, str]) -> dict[str, str]:
    headers = dict(headers)
    for _ in range(rng.randint(1, 2)):
        k = rng.choice(["accept", "mcp-protocol-version", "mcp-method", "mcp-name", "content-type",
                        "origin", "mcp-session-id"])
        headers[k] = rng.choice(["", "text/plain", "application/json", "text/event-stream",
                                 "2025-11-25", "1999-01-01", "tools/list", "echo", "http://evil.test",
                                 "http://localhost:3000", "deadbeef", "x" * 500])
        if rng.random() < 0.3:
            headers.pop(k, None)
    return headers


class McpFuzzer:
    """Case ``i`` of a seed, for ``/mcp`` (2026-07-28 Streamable HTTP, one message per POST)."""

    def __init__(self, seed: int, limits: Limits, key: str) -> None:
        self.seed, self.limits, self.key = seed, limits, key
        self.classes = list(MCP_CLASSES)
        self.weights = list(MCP_CLASSES.values())

    def case(self, i: int) -> Case:
        rng = random.Random(f"mcp:{self.seed}:{i}")
        cls = rng.choices(self.classes, self.weights)[0]
        msg: Any = mcp_message(rng)
        chunked = False
        if cls == "mutated":
            for _ in range(rng.randint(1, 3)):
                msg = mutate_obj(rng, msg)
        elif cls == "wrong_types":
            msg = wrong_types(rng)
        elif cls == "huge_ids":
            msg["id"] = huge_id(rng)
        elif cls == "batch_array":
            msg = [mcp_message(rng) for _ in range(rng.choice([1, 2, 50, 500]))]
        headers = mcp_headers(self.key, msg)
        body = dumps(msg)
        if cls == "mutated" and rng.random() < 0.3:
            body = mutate_bytes(rng, body)
        elif cls == "bad_headers":
            headers = bad_headers(rng, headers)
        elif cls == "malformed_json":
            body = malformed(rng, body)
        elif cls == "deep_nesting":
            body = deep_body(rng, self.limits)
        elif cls == "invalid_utf8":
            body = invalid_utf8(rng)
        elif cls == "oversized":
            body, chunked = oversized(rng, self.limits)
        elif cls == "random_bytes":
            body = random_bytes(rng)
        elif cls == "bad_auth":
            headers = {k: v for k, v in headers.items() if k != "authorization"}
            headers.update(rng.choice(BAD_AUTH))
        return Case(i, cls, body, headers, chunked)
