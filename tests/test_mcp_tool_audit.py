"""The tool-call audit: one record per MCP ``tools/call`` (who, which virtual server and tool, how it
ended, how long, an argument hash; arguments only with ``audit.arguments``, redacted), written off
the call path and read at ``GET /admin/audit/tools`` with filters and a cursor."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.core.errors import Code
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import mcp_http_client
from tests.pin_helpers import ADMIN, KEYS, config_data, upstream_url

pytestmark = pytest.mark.anyio
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def audited_config(url: str, tmp_path: Path, **audit: Any) -> dict[str, Any]:
    data = config_data(url, tmp_path, tool_limits={"unrug": {"rpm": 1}})
    data["mcp_servers"] = {"words": {"tools": ["rug_look*"]}}
    data["audit"] = audit
    return data


async def records(http: httpx.AsyncClient, base: str, **query: Any) -> dict[str, Any]:
    r = await http.get(base + "/admin/audit/tools", params=query, headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()


async def test_every_tools_call_is_recorded_and_queryable(tmp_path: Path) -> None:
    began = time.time()
    async with upstream_url() as url, running(parse_config(
            audited_config(url, tmp_path, arguments=True))) as (_, base):
        async with mcp_http_client(base + "/mcp", "auto", KEYS["alice"]) as client:
            secret = {"word": "a", "api_key": "sk-" + "s" * 20}
            assert not (await client.call_tool("rug_lookup", secret)).is_error
            assert not (await client.call_tool("rug_unrug", {})).is_error
            assert (await client.call_tool("rug_unrug", {})).is_error  # over the tool's rpm
        async with mcp_http_client(base + "/mcp/words", "legacy", KEYS["alice"]) as client:
            assert not (await client.call_tool("rug_lookup", {"word": "b"})).is_error
        async with httpx.AsyncClient(timeout=30) as http:
            everything = await records(http, base)
            rows = everything["records"]
            assert [(r["tool"], r["status"], r["server"]) for r in rows] == [
                ("rug_lookup", "ok", "words"), ("rug_unrug", "refused", None),
                ("rug_unrug", "ok", None), ("rug_lookup", "ok", None)]
            assert all(r["key"] == "alice" and r["duration_ms"] >= 0 for r in rows)
            assert rows[1]["code"] == Code.RATE_LIMITED and rows[0]["code"] is None
            first = rows[-1]
            assert first["arguments"] == {"word": "a", "api_key": "[redacted]"}
            expected = json.dumps({"api_key": "sk-" + "s" * 20, "word": "a"}, sort_keys=True,
                                  separators=(",", ":"))
            assert first["args_hash"] == hashlib.sha256(expected.encode()).hexdigest()
            assert began <= first["ts"] <= time.time()

            refused = (await records(http, base, status="refused"))["records"]
            assert [r["status"] for r in refused] == ["refused"]
            assert len((await records(http, base, tool="rug_lookup"))["records"]) == 2
            assert (await records(http, base, key="bob"))["records"] == []
            assert (await records(http, base, since=time.time() + 60))["records"] == []
            page = await records(http, base, limit=3)
            assert len(page["records"]) == 3 and page["next_cursor"] is not None
            rest = await records(http, base, limit=3, cursor=page["next_cursor"])
            assert [r["id"] for r in rest["records"]] == [first["id"]] and rest["next_cursor"] is None

            for bad in ({"status": "fine"}, {"limit": "0"}, {"since": "yesterday"}):
                r = await http.get(base + "/admin/audit/tools", params=bad, headers=ADMIN_HEADERS)
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"
            r = await http.get(base + "/admin/audit/tools",
                               headers={"Authorization": f"Bearer {KEYS['alice']}"})
            assert r.status_code == 401  # a caller's key reads no one's audit


async def test_arguments_are_kept_only_when_asked(tmp_path: Path) -> None:
    async with upstream_url() as url, running(parse_config(audited_config(url, tmp_path))) as (_, base):
        async with mcp_http_client(base + "/mcp", "auto", KEYS["alice"]) as client:
            await client.call_tool("rug_lookup", {"word": "secret word"})
        async with httpx.AsyncClient(timeout=30) as http:
            (row,) = (await records(http, base))["records"]
            assert "arguments" not in row and len(row["args_hash"]) == 64


async def test_audit_off_records_nothing(tmp_path: Path) -> None:
    async with upstream_url() as url, running(parse_config(
            audited_config(url, tmp_path, tools=False))) as (_, base):
        async with mcp_http_client(base + "/mcp", "auto", KEYS["alice"]) as client:
            assert not (await client.call_tool("rug_lookup", {"word": "a"})).is_error
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(base + "/admin/audit/tools", headers=ADMIN_HEADERS)
            assert r.status_code == 404
