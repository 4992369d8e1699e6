"""OpenAI's chat completions and embeddings <-> Gemini's ``generateContent`` and
``batchEmbedContents``: both directions in one place, for ``/v1/chat/completions`` and
``/v1/embeddings`` callers of a ``kind: gemini`` route (whole, streamed, and in ``/v1/batches``)."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from typing import Any

from multiplexer.core.errors import invalid_params
from multiplexer.core.foreign import ChunkConverter

from .gemini_shapes import (
    answer_text,
    arguments_object,
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

KNOBS = {"temperature": "temperature", "top_p": "topP", "max_completion_tokens": "maxOutputTokens",
         "max_tokens": "maxOutputTokens", "stop": "stopSequences", "n": "candidateCount",
         "seed": "seed", "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty"}
# Chat keys with no Gemini equivalent that change the answer: refused, never silently dropped.
REFUSED = ("logprobs", "top_logprobs", "audio", "prediction", "web_search_options", "logit_bias")


# -- OpenAI chat -> Gemini request -----------------------------------------------------------
def _user_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        raise invalid_params(f"{where}.content must be a string or an array of parts", param="messages")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append(inline_image(url, "messages"))
        else:
            raise invalid_params(f"{where}.content[{j}]: Gemini routes take text and image_url parts",
                                 param="messages")
    return parts


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _contents(messages: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if not isinstance(messages, list) or not messages:
        raise invalid_params("'messages' must be a non-empty array", param="messages")
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> function name (a tool result names its function)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role in ("system", "developer"):
            system.append(_text(m.get("content")))
        elif role == "user":
            contents.append({"role": "user", "parts": _user_parts(m.get("content"), where)})
        elif role == "assistant":
            parts: list[dict[str, Any]] = [{"text": t} for t in [_text(m.get("content"))] if t]
            for call in m.get("tool_calls") or []:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid_params(f"{where}.tool_calls: each needs a function name", param="messages")
                names[str(call.get("id"))] = fn["name"]
                parts.append({"functionCall": {"name": fn["name"],
                                               "args": arguments_object(fn.get("arguments"), "messages")}})
            contents.append({"role": "model", "parts": parts})
        elif role == "tool":
            name = names.get(str(m.get("tool_call_id")))
            if name is None:
                raise invalid_params(f"{where}: tool_call_id matches no earlier assistant tool call",
                                     param="messages")
            response = tool_output(m.get("content") if isinstance(m.get("content"), str)
                                   else _text(m.get("content")))
            contents.append({"role": "user", "parts": [{"functionResponse": {"name": name,
                                                                             "response": response}}]})
        else:
            raise invalid_params(f"{where}.role must be system, developer, user, assistant or tool",
                                 param="messages")
    return merge_turns(contents), system


def _tool_config(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[choice]
        return {"functionCallingConfig": {"mode": mode}}
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [fn["name"]]}}
    raise invalid_params("tool_choice must be auto, none, required or a named function",
                         param="tool_choice")


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat body as a ``generateContent`` body (``model`` kept for the route)."""
    for key in REFUSED:
        if body.get(key) not in (None, False):
            raise invalid_params(f"{key!r} is not supported on Gemini routes", param=key)
    if body.get("stream") and isinstance(body.get("n"), int) and body["n"] > 1:
        raise invalid_params("a streamed call on a Gemini route takes n: 1", param="n")
    contents, system = _contents(body.get("messages"))
    out: dict[str, Any] = {"contents": contents}
    if "model" in body:
        out["model"] = body["model"]
    if system:
        out["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    config = generation_config(body, KNOBS)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        config["responseMimeType"] = "application/json"
        schema = fmt.get("json_schema")
        if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            config["responseJsonSchema"] = schema["schema"]
    if config:
        out["generationConfig"] = config
    tools = body.get("tools")
    if tools:
        decls = declarations(tools, _function_tool, "Gemini routes take function tools only")
        out["tools"] = [{"functionDeclarations": decls}]
    tool_config = _tool_config(body.get("tool_choice"))
    if tool_config is not None:
        out["toolConfig"] = tool_config
    return out


def _function_tool(tool: Any) -> tuple[Any, Any, Any] | None:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict):
        return None
    return fn.get("name"), fn.get("description"), fn.get("parameters")


# -- Gemini response -> OpenAI chat ----------------------------------------------------------
def finish_reason(reason: Any, called: bool) -> str | None:
    return ending(reason, called, ("tool_calls", "length", "content_filter", "stop"))


def chat_usage(result: Any) -> dict[str, Any] | None:
    numbers = usage_numbers(result)
    if numbers is None:
        return None
    prompt, output, cached, thoughts = numbers
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": thoughts}}


def _tool_calls(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": call_id(c, "call_"), "type": "function",
             "function": {"name": c.get("name"), "arguments": json.dumps(c.get("args") or {})}}
            for c in function_calls(parts)]


def chat_response(result: Any, body: dict[str, Any]) -> dict[str, Any]:
    """A ``GenerateContentResponse`` as a ``chat.completion``, a choice per candidate."""
    choices = []
    candidates = result.get("candidates") if isinstance(result, dict) else None
    for i, cand in enumerate(candidates if isinstance(candidates, list) else []):
        parts = parts_of(cand) if isinstance(cand, dict) else []
        calls = _tool_calls(parts)
        text = answer_text(parts) or (None if calls else "")
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": cand.get("index", i) if isinstance(cand, dict) else i, "message": message,
                        "logprobs": None,
                        "finish_reason": finish_reason(cand.get("finishReason", "STOP"), bool(calls))})
    if not choices and blocked(result):
        choices.append({"index": 0, "message": {"role": "assistant", "content": None, "refusal": None},
                        "logprobs": None, "finish_reason": "content_filter"})
    rid = result.get("responseId") if isinstance(result, dict) else None
    return {"id": f"chatcmpl-{rid or uuid.uuid4().hex[:24]}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model"), "system_fingerprint": None,
            "choices": choices, "usage": chat_usage(result)}


def chat_stream(body: dict[str, Any]) -> ChunkConverter:
    """Each Gemini stream chunk as ``chat.completion.chunk`` events; the usage chunk (after the
    one that finishes) only when the caller asked for it, as OpenAI does."""
    options = body.get("stream_options")
    want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    base = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.get("model"), "system_fingerprint": None}
    state: dict[str, Any] = {"first": True, "calls": 0, "usage": None}

    def convert(chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            return [chunk]
        if isinstance(chunk.get("usageMetadata"), dict):  # each chunk may say it; the last one counts
            state["usage"] = chunk["usageMetadata"]
        cand = candidate(chunk)
        parts = parts_of(cand)
        delta: dict[str, Any] = {}
        if state["first"]:
            delta["role"] = "assistant"
        text = answer_text(parts)
        if text:
            delta["content"] = text
        calls = _tool_calls(parts)
        if calls:
            delta["tool_calls"] = [{"index": state["calls"] + k, **c} for k, c in enumerate(calls)]
            state["calls"] += len(calls)
        reason = cand.get("finishReason") or ("SAFETY" if blocked(chunk) else None)
        out = []
        if delta.keys() - {"role"} or reason is not None or state["first"]:
            out.append({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason(reason, state["calls"] > 0)}]})
            state["first"] = False
        if reason is not None and want_usage:
            out.append({**base, "choices": [], "usage": chat_usage({"usageMetadata": state["usage"]})})
        return out

    return convert


# -- embeddings --------------------------------------------------------------------------------
def embeddings_request(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI embeddings body as a ``batchEmbedContents`` body: one request per input."""
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs:
        raise invalid_params("'input' must be a non-empty string or array of strings", param="input")
    if not all(isinstance(x, str) and x for x in inputs):
        raise invalid_params("Gemini routes embed text: every input must be a non-empty string "
                             "(token arrays are not supported)", param="input")
    extra: dict[str, Any] = {}
    if isinstance(body.get("dimensions"), int):
        extra["outputDimensionality"] = body["dimensions"]
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise invalid_params("encoding_format must be float or base64", param="encoding_format")
    out: dict[str, Any] = {"requests": [{"content": {"parts": [{"text": x}]}, **extra} for x in inputs]}
    if "model" in body:
        out["model"] = body["model"]
    return out


def embeddings_response(result: Any, body: dict[str, Any]) -> dict[str, Any]:
    vectors = result.get("embeddings") if isinstance(result, dict) else None
    encode = packed if body.get("encoding_format") == "base64" else list
    data = [{"object": "embedding", "index": i, "embedding": encode(v.get("values", []))}
            for i, v in enumerate(vectors if isinstance(vectors, list) else []) if isinstance(v, dict)]
    numbers = usage_numbers(result)
    tokens = numbers[0] if numbers is not None else 0
    return {"object": "list", "data": data, "model": body.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def packed(values: list[float]) -> str:
    """``encoding_format: base64``: little-endian float32s, as OpenAI sends (the SDK's default)."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
