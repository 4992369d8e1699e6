"""Routes as MCP tools: names clients accept, and results in the shape MCP expects.

Many MCP clients reject tool names over 64 characters, so a longer route name
is published as a shortened, hashed alias and mapped back on ``tools/call``.
Results of non-MCP routes are wrapped into a ``CallToolResult``; gateway errors
become ``isError`` results, except protocol-level ones (unknown tool), which
stay MCP errors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from typing import Any

import mcp_types as types
from mcp import MCPError
from mcp.shared.inbound import X_MCP_HEADER_KEY

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.provider import ToolSpec

log = logging.getLogger(__name__)

MAX_NAME = 64
ERROR_META_KEY = "multiplexer/error"


def short_name(name: str, taken: set[str]) -> str:
    """A stable name of at most 64 characters: a readable head plus a hash of the full name."""
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    candidate = f"{name[:MAX_NAME - 9]}_{digest}"
    n = 0
    while candidate in taken:
        n += 1
        tail = f"_{digest}{n}"
        candidate = name[:MAX_NAME - len(tail)] + tail
    return candidate


class ToolCatalog:
    """The tool list as published, and the map from published names back to route names."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.schemas: dict[str, dict[str, Any]] = {}
        self.with_headers: set[str] = set()  # tools whose schemas declare Mcp-Param headers

    def build(self, specs: Iterable[ToolSpec]) -> list[types.Tool]:
        tools: list[types.Tool] = []
        seen: set[str] = set()
        long: list[ToolSpec] = []
        for spec in specs:
            if spec.name in seen:
                log.warning("tool %r is listed twice; publishing the first", spec.name)
                continue
            seen.add(spec.name)
            if len(spec.name) > MAX_NAME:
                long.append(spec)
            else:
                tools.append(to_tool(spec.name, spec))
        aliases: dict[str, str] = {}
        taken = {t.name for t in tools}
        for spec in long:
            public = short_name(spec.name, taken)
            taken.add(public)
            aliases[public] = spec.name
            tools.append(to_tool(public, spec))
        self.aliases = aliases
        self.schemas = {t.name: t.input_schema for t in tools}
        self.with_headers = {t.name for t in tools if declares_headers(t.input_schema)}
        return tools

    def resolve(self, public: str) -> str:
        return self.aliases.get(public, public)

    def input_schema(self, public: str) -> dict[str, Any] | None:
        """A tool's schema as last listed."""
        return self.schemas.get(public)

    def header_schema(self, public: str) -> dict[str, Any] | None:
        """For the SDK's ``Mcp-Param-*`` header check, from the last listing (no listing per call).

        None where the schema has no ``x-mcp-header`` (the SDK's "nothing to validate"): the check
        would walk it on every call to find no header to compare.
        """
        return self.schemas.get(public) if public in self.with_headers else None


def declares_headers(schema: dict[str, Any]) -> bool:
    """Whether ``x-mcp-header`` appears anywhere in the schema (a key there is one in its JSON)."""
    return X_MCP_HEADER_KEY in json.dumps(schema, default=str)


def to_tool(name: str, spec: ToolSpec) -> types.Tool:
    meta = spec.meta or {}
    annotations = types.ToolAnnotations.model_validate(spec.annotations) if spec.annotations else None
    return types.Tool(
        name=name,
        title=meta.get("title"),
        description=spec.description or None,
        input_schema=spec.input_schema or {"type": "object"},
        output_schema=meta.get("outputSchema"),
        annotations=annotations,
        _meta=meta.get("_meta"),
    )


def wrap_result(result: Any, text: str | None = None) -> types.CallToolResult:
    """A plain route's result as MCP content: JSON text for every client, structured for new ones.

    ``text``: the result as JSON already, where its provider wrote it off the event loop (an
    embedding's floats, read back into ``result`` from it): sent as it is, so text and structure
    agree and MCP clients get the numbers ``/rpc`` and ``/v1`` send; writing the floats as text
    again cost the loop more than twice the reading."""
    if text is None:
        text = json.dumps(result, ensure_ascii=False, separators=(",", ":"), default=str)
    structured = result if isinstance(result, dict) else {"result": result}
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                structured_content=structured)


def error_result(error: RpcError) -> types.CallToolResult:
    """A gateway error as a tool error the model can read; the error object rides in ``_meta``."""
    detail = error.to_dict()
    text = f"error {error.code}: {error.message}"
    if error.data:
        text += " " + json.dumps(error.data, ensure_ascii=False, default=str)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True,
                                _meta={ERROR_META_KEY: detail})


def protocol_error(error: RpcError, tool: str) -> MCPError | None:
    """Errors that are about the request, not the tool's run: unknown tool, upstream protocol errors."""
    if error.code == Code.METHOD_NOT_FOUND:
        return unknown_tool(tool, (error.data or {}).get("did_you_mean"))
    if error.data and error.data.get("mcp_protocol_error"):
        return mcp_error(error)
    return None


def unknown_tool(tool: str, did_you_mean: str | None = None) -> MCPError:
    """``Unknown tool: tools_ecoh; did you mean 'tools_echo'?`` (a tool the caller may call)."""
    if not isinstance(did_you_mean, str):
        return MCPError(types.INVALID_PARAMS, f"Unknown tool: {tool}", {"tool": tool})
    return MCPError(types.INVALID_PARAMS, f"Unknown tool: {tool}; did you mean {did_you_mean!r}?",
                    {"tool": tool, "did_you_mean": did_you_mean})


def mcp_error(error: RpcError) -> MCPError:
    """An upstream's protocol error exactly as it sent it; a gateway error (-32007, ...) as ours."""
    if error.data and error.data.get("mcp_protocol_error"):
        return MCPError(error.code, error.message, error.data.get("upstream_data"))
    return MCPError(error.code, error.message, error.data)
