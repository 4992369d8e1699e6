"""Anthropic's Messages API <-> Gemini's ``generateContent``: both directions in one place, for
``/v1/messages`` callers of a ``kind: gemini`` route (whole, streamed as Anthropic's named
events, and in ``/v1/messages/batches``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from multiplexer.core.errors import invalid_params
from multiplexer.core.foreign import ChunkConverter

from .gemini_shapes import (
    answer_text,
    blocked,
    call_id,
    candidate,
    declarations,
    ending,
    function_calls,
    generation_config,
    inline_image,
    merge_turns,
    parts_of,
    tool_output,
    usage_numbers,
)

KNOBS = {"max_tokens": "maxOutputTokens", "temperature": "temperature", "top_p": "topP",
         "top_k": "topK", "stop_sequences": "stopSequences"}


# -- Anthropic messages -> Gemini request ----------------------------------------------------
def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def _parts(content: Any, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        raise invalid_params(f"{where}.content must be a string or an array of blocks", param="messages")
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"text": block["text"]})
        elif kind == "image":
            source = block.get("source") if isinstance(block.get("source"), dict) else {}
            if source.get("type") != "base64":
                raise invalid_params(f"{at}: Gemini routes take base64 image sources only", param="messages")
            parts.append(inline_image(f"data:{source.get('media_type')};base64,{source.get('data')}",
                                      "messages"))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise invalid_params(f"{at}: a tool_use block needs a name", param="messages")
            names[str(block.get("id"))] = block["name"]
            args = block.get("input") if isinstance(block.get("input"), dict) else {}
            parts.append({"functionCall": {"name": block["name"], "args": args}})
        elif kind == "tool_result":
            name = names.get(str(block.get("tool_use_id")))
            if name is None:
                raise invalid_params(f"{at}: tool_use_id matches no earlier tool_use block", param="messages")
            output = _block_text(block.get("content"))
            response = {"error": output} if block.get("is_error") else tool_output(output)
            parts.append({"functionResponse": {"name": name, "response": response}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # Anthropic's own reasoning: nothing Gemini can read back
        else:
            raise invalid_params(f"{at}: Gemini routes take text, image, tool_use and tool_result blocks",
                                 param="messages")
    return parts


def _tool_config(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "any", "none"):
        return {"functionCallingConfig": {"mode": kind.upper()}}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [choice["name"]]}}
    raise invalid_params("tool_choice must be {type: auto|any|none|tool}", param="tool_choice")


def messages_request(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic messages body as a ``generateContent`` body (``model`` kept for the route)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_params("'messages' must be a non-empty array", param="messages")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid_params("'max_tokens' must be a positive integer", param="max_tokens")
    names: dict[str, str] = {}
    contents = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise invalid_params(f"messages[{i}].role must be user or assistant", param="messages")
        contents.append({"role": "user" if role == "user" else "model",
                         "parts": _parts(m.get("content"), f"messages[{i}]", names)})
    out: dict[str, Any] = {"contents": merge_turns(contents)}
    if "model" in body:
        out["model"] = body["model"]
    system = _block_text(body.get("system"))
    if system:
        out["systemInstruction"] = {"parts": [{"text": system}]}
    out["generationConfig"] = generation_config(body, KNOBS)
    tools = body.get("tools")
    if tools:
        decls = declarations(tools, _custom_tool, "Gemini routes take custom (client) tools only")
        out["tools"] = [{"functionDeclarations": decls}]
    tool_config = _tool_config(body.get("tool_choice"))
    if tool_config is not None:
        out["toolConfig"] = tool_config
    return out


def _custom_tool(tool: Any) -> tuple[Any, Any, Any] | None:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        return None
    return tool.get("name"), tool.get("description"), tool.get("input_schema")


# -- Gemini response -> Anthropic message ----------------------------------------------------
def stop_reason(reason: Any, called: bool) -> str | None:
    return ending(reason, called, ("tool_use", "max_tokens", "refusal", "end_turn"))


def message_usage(result: Any) -> dict[str, Any]:
    numbers = usage_numbers(result)
    prompt, output, cached, _ = numbers if numbers is not None else (0, 0, 0, 0)
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _blocks(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = answer_text(parts)
    if text:
        blocks.append({"type": "text", "text": text})
    for call in function_calls(parts):
        blocks.append({"type": "tool_use", "id": call_id(call, "toolu_"), "name": call.get("name"),
                       "input": call.get("args") or {}})
    return blocks


def message_response(result: Any, body: dict[str, Any]) -> dict[str, Any]:
    """A ``GenerateContentResponse`` (its first candidate) as an Anthropic ``message``."""
    cand = candidate(result)
    blocks = _blocks(parts_of(cand))
    called = any(b["type"] == "tool_use" for b in blocks)
    reason = cand.get("finishReason") or ("SAFETY" if blocked(result) else "STOP")
    rid = result.get("responseId") if isinstance(result, dict) else None
    return {"id": f"msg_{rid or uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": body.get("model"), "content": blocks, "stop_reason": stop_reason(reason, called),
            "stop_sequence": None, "usage": message_usage(result)}


def messages_stream(body: dict[str, Any]) -> ChunkConverter:
    """Gemini stream chunks as Anthropic's events: ``message_start`` first, a text block that
    grows by ``text_delta``s, a block per tool call, then ``message_delta`` and ``message_stop``
    once a chunk carries the finish reason."""
    message_id = "msg_" + uuid.uuid4().hex[:24]
    state: dict[str, Any] = {"started": False, "open": None, "index": 0, "called": False, "done": False,
                             "usage": None}

    def close_block(out: list[dict[str, Any]]) -> None:
        if state["open"] is not None:
            out.append({"type": "content_block_stop", "index": state["index"]})
            state["index"] += 1
            state["open"] = None

    def convert(chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            return [chunk]
        if state["done"]:
            return []
        if isinstance(chunk.get("usageMetadata"), dict):  # each chunk may say it; the last one counts
            state["usage"] = chunk["usageMetadata"]
        out: list[dict[str, Any]] = []
        if not state["started"]:
            state["started"] = True
            usage = {**message_usage(chunk), "output_tokens": 0}
            out.append({"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
        cand = candidate(chunk)
        parts = parts_of(cand)
        text = answer_text(parts)
        if text:
            if state["open"] != "text":
                close_block(out)
                out.append({"type": "content_block_start", "index": state["index"],
                            "content_block": {"type": "text", "text": ""}})
                state["open"] = "text"
            out.append({"type": "content_block_delta", "index": state["index"],
                        "delta": {"type": "text_delta", "text": text}})
        for block in _blocks(parts):
            if block["type"] != "tool_use":
                continue
            close_block(out)
            state["called"] = True
            out.append({"type": "content_block_start", "index": state["index"],
                        "content_block": {**block, "input": {}}})
            partial = json.dumps(block["input"], separators=(",", ":"))
            out.append({"type": "content_block_delta", "index": state["index"],
                        "delta": {"type": "input_json_delta", "partial_json": partial}})
            state["open"] = "tool"
        reason = cand.get("finishReason") or ("SAFETY" if blocked(chunk) else None)
        if reason is not None:
            close_block(out)
            state["done"] = True
            output = message_usage({"usageMetadata": state["usage"]})["output_tokens"]
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(reason, state["called"]), "stop_sequence": None},
                        "usage": {"output_tokens": output}})
            out.append({"type": "message_stop"})
        return out

    return convert

