"""Unit tests: publishing routes as MCP tools, shaping results, checking origins."""

from __future__ import annotations

import json

import mcp_types as types
from hypothesis import given
from hypothesis import strategies as st

from multiplexer.core.errors import Code, RpcError, rate_limited
from multiplexer.core.provider import ToolSpec
from multiplexer.faces.mcp.http import origin_allowed
from multiplexer.faces.mcp.tools import (
    ERROR_META_KEY,
    MAX_NAME,
    ToolCatalog,
    error_result,
    protocol_error,
    short_name,
    wrap_result,
)

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=200)


@given(st.lists(NAMES, max_size=30, unique=True))
def test_published_names_fit_64_chars_are_unique_and_map_back(names: list[str]) -> None:
    catalog = ToolCatalog()
    tools = catalog.build(ToolSpec(n) for n in names)
    published = [t.name for t in tools]
    assert len(published) == len(set(published)) == len(names)
    assert all(len(p) <= MAX_NAME for p in published)
    assert sorted(catalog.resolve(p) for p in published) == sorted(names)
    assert all(catalog.resolve(n) == n for n in names if len(n) <= MAX_NAME)


def test_short_names_are_stable_and_avoid_taken_names() -> None:
    name = "x" * 100
    first = short_name(name, set())
    assert first == short_name(name, set()) and len(first) == MAX_NAME and first.startswith("x" * 55)
    second = short_name(name, {first})
    assert second != first and len(second) <= MAX_NAME


def test_duplicates_keep_the_first_and_schemas_are_remembered() -> None:
    catalog = ToolCatalog()
    tools = catalog.build([ToolSpec("a", "first", {"type": "object", "properties": {"x": {}}}),
                           ToolSpec("a", "second")])
    assert [(t.name, t.description) for t in tools] == [("a", "first")]
    assert catalog.input_schema("a") == {"type": "object", "properties": {"x": {}}}
    assert catalog.input_schema("b") is None


def test_tool_fields_come_from_the_spec() -> None:
    spec = ToolSpec("t", "d", {"type": "object"}, {"readOnlyHint": True},
                    {"title": "T", "outputSchema": {"type": "object"}, "_meta": {"k": 1}})
    (tool,) = ToolCatalog().build([spec])
    assert tool.title == "T" and tool.output_schema == {"type": "object"} and tool.meta == {"k": 1}
    assert tool.annotations == types.ToolAnnotations(read_only_hint=True)


def test_plain_results_become_text_and_structured_content() -> None:
    result = wrap_result({"a": [1, 2]})
    assert result.structured_content == {"a": [1, 2]}
    assert json.loads(result.content[0].text) == {"a": [1, 2]}  # type: ignore[union-attr]
    assert wrap_result(7).structured_content == {"result": 7}
    assert wrap_result(None).structured_content == {"result": None}


def test_gateway_errors_become_tool_errors_with_the_error_object() -> None:
    error = rate_limited("rpm", 1.5)
    result = error_result(error)
    assert result.is_error and result.meta == {ERROR_META_KEY: error.to_dict()}
    assert result.content[0].text.startswith("error -32003: Rate limited")  # type: ignore[union-attr]
    assert protocol_error(error, "t") is None


def test_unknown_tools_and_upstream_protocol_errors_stay_protocol_errors() -> None:
    unknown = protocol_error(RpcError(Code.METHOD_NOT_FOUND, "Method not found"), "nope")
    assert unknown is not None and unknown.code == types.INVALID_PARAMS and "nope" in unknown.message
    marked = RpcError(-32602, "bad", {"mcp_protocol_error": True, "upstream_data": "d"})
    upstream = protocol_error(marked, "t")
    assert upstream is not None and (upstream.code, upstream.message, upstream.data) == (-32602, "bad", "d")


def test_origins() -> None:
    allowed = ["http://127.0.0.1", "http://localhost"]
    assert origin_allowed(None, allowed) and origin_allowed("", allowed)
    assert origin_allowed("http://localhost", allowed)
    assert origin_allowed("http://localhost:5173", allowed)
    assert origin_allowed("HTTP://LOCALHOST:80/", allowed)
    assert not origin_allowed("http://localhost.evil.example", allowed)
    assert not origin_allowed("http://localhost:80.evil.example", allowed)
    assert not origin_allowed("https://localhost", allowed)
    assert not origin_allowed("null", allowed)
    assert origin_allowed("http://anything", ["*"])
