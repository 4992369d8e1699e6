"""What both ``/v1`` translations to and from Gemini's ``generateContent`` share: images as
``inlineData``, tool schemas, tool call ids, finish reasons and ``usageMetadata``.

Gemini's own wire shapes (camelCase proto JSON) are read here and in the translation modules
only; the provider passes them through untouched on ``/rpc`` and ``/mcp``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from multiplexer.core.errors import invalid_params

DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)(;[\w=.-]+)*;base64,(?P<data>.*)$", re.S)
# Keys of JSON Schema that Gemini's ``parameters`` (an OpenAPI subset) refuses.
SCHEMA_DROP = frozenset({"$schema", "$id", "additionalProperties", "strict", "examples"})
FILTERED = frozenset({"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII",
                      "IMAGE_SAFETY", "LANGUAGE"})


def inline_image(url: Any, param: str) -> dict[str, Any]:
    """A ``data:<mime>;base64,...`` URL as an ``inlineData`` part. Remote URLs are refused: the
    Gemini API reads only uploaded files or inline bytes, and the gateway fetches nothing."""
    found = DATA_URL.match(url) if isinstance(url, str) else None
    if found is None:
        raise invalid_params("Gemini routes take images as base64 data: URLs "
                             "(data:image/png;base64,...); remote URLs are not fetched", param=param)
    return {"inlineData": {"mimeType": found["mime"], "data": found["data"]}}


def clean_schema(schema: Any) -> Any:
    """A JSON Schema as Gemini's ``parameters``: the keys it refuses dropped, at every depth."""
    if isinstance(schema, dict):
        return {k: clean_schema(v) for k, v in schema.items() if k not in SCHEMA_DROP}
    if isinstance(schema, list):
        return [clean_schema(v) for v in schema]
    return schema


def declaration(name: Any, description: Any, schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise invalid_params("a tool needs a name", param=param)
    out: dict[str, Any] = {"name": name}
    if isinstance(description, str):
        out["description"] = description
    if isinstance(schema, dict) and schema.get("properties"):
        out["parameters"] = clean_schema(schema)
    return out


def call_id(part: dict[str, Any], prefix: str) -> str:
    """A function call's id: Gemini's own when it sends one, else a fresh one."""
    given = part.get("id")
    return given if isinstance(given, str) and given else prefix + uuid.uuid4().hex[:24]


def arguments_object(raw: Any, param: str) -> dict[str, Any]:
    """A tool call's arguments (a JSON string in OpenAI's shape) as Gemini's ``args`` object."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        raise invalid_params("tool call arguments must be a JSON object", param=param) from None
    if not isinstance(value, dict):
        raise invalid_params("tool call arguments must be a JSON object", param=param)
    return value


def tool_output(content: Any) -> dict[str, Any]:
    """A tool's output as a ``functionResponse.response`` object: a JSON object as it is, anything
    else under ``content``."""
    if isinstance(content, str):
        try:
            value = json.loads(content)
        except ValueError:
            value = None
        return value if isinstance(value, dict) else {"content": content}
    return {"content": content}


def merge_turns(contents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive turns of one role as one (Gemini wants user and model turns to alternate;
    several tool results answer one model turn together)."""
    out: list[dict[str, Any]] = []
    for turn in contents:
        if not turn["parts"]:
            continue
        if out and out[-1]["role"] == turn["role"]:
            out[-1]["parts"].extend(turn["parts"])
        else:
            out.append({"role": turn["role"], "parts": list(turn["parts"])})
    return out


def candidate(result: Any) -> dict[str, Any]:
    """The first candidate of a ``GenerateContentResponse`` (an empty one when it was blocked)."""
    candidates = result.get("candidates") if isinstance(result, dict) else None
    first = candidates[0] if isinstance(candidates, list) and candidates else {}
    return first if isinstance(first, dict) else {}


def parts_of(cand: dict[str, Any]) -> list[dict[str, Any]]:
    content = cand.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def answer_text(parts: list[dict[str, Any]]) -> str:
    """The text of the answer's parts; thought summaries (``thought: true``) are not the answer."""
    return "".join(p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought"))


def function_calls(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p["functionCall"] for p in parts if isinstance(p.get("functionCall"), dict)]


def blocked(result: Any) -> bool:
    feedback = result.get("promptFeedback") if isinstance(result, dict) else None
    return isinstance(feedback, dict) and bool(feedback.get("blockReason"))


def usage_numbers(result: Any) -> tuple[int, int, int, int] | None:
    """(prompt, output incl. thoughts, cached, thoughts) tokens from ``usageMetadata``."""
    meta = result.get("usageMetadata") if isinstance(result, dict) else None
    if not isinstance(meta, dict):
        return None

    def n(key: str) -> int:
        value = meta.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    thoughts = n("thoughtsTokenCount")
    return (n("promptTokenCount") + n("toolUsePromptTokenCount"), n("candidatesTokenCount") + thoughts,
            n("cachedContentTokenCount"), thoughts)


def usage_total(body: Any) -> int | None:
    """Tokens a response says it used (``totalTokenCount``, else the sum of its parts)."""
    meta = body.get("usageMetadata") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        return None
    total = meta.get("totalTokenCount")
    if isinstance(total, int):
        return total
    numbers = usage_numbers(body)
    return None if numbers is None else numbers[0] + numbers[1]


def ending(reason: Any, called: bool, words: tuple[str, str, str, str]) -> str | None:
    """A ``finishReason`` in the caller's API: ``words`` are its (tool call, length, filtered,
    done); None while the answer goes on."""
    if reason is None:
        return None
    tool, length, filtered, done = words
    if called:
        return tool
    if reason == "MAX_TOKENS":
        return length
    return filtered if reason in FILTERED else done


def declarations(tools: Any, spec: Callable[[Any], tuple[Any, Any, Any] | None],
                 refusal: str) -> list[dict[str, Any]]:
    """``functionDeclarations`` from the caller's ``tools``; ``spec`` takes one tool to its (name,
    description, schema), None for a kind Gemini cannot call (``refusal`` says which it takes)."""
    if not isinstance(tools, list):
        raise invalid_params("'tools' must be an array", param="tools")
    decls = []
    for tool in tools:
        found = spec(tool)
        if found is None:
            raise invalid_params(refusal, param="tools")
        decls.append(declaration(*found, "tools"))
    return decls


def generation_config(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``generationConfig`` from the caller's knobs (``names``: their key -> Gemini's)."""
    config: dict[str, Any] = {}
    for theirs, ours in names.items():
        value = body.get(theirs)
        if value is None:
            continue
        if ours == "stopSequences":
            value = [value] if isinstance(value, str) else value
        config.setdefault(ours, value)
    return config
