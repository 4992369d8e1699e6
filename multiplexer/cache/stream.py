"""A stored answer replayed as the stream a caller asked for, and a relayed stream assembled
into a whole answer to store.

- ``chat_chunks``: OpenAI ``chat.completion.chunk``s of a stored ``chat.completion`` (the face
  encodes them as SSE and adds ``[DONE]``);
- ``message_events``: Anthropic's events of a stored ``message`` (``message_start``,
  ``content_block_start``, ``ping``, ``content_block_delta``, ``content_block_stop``,
  ``message_delta``, ``message_stop``), as the real API streams them;
- ``Recorder``: the face's end of a stream the cache is on for, keeping each chunk as it
  passes (an object, or an event's bytes as the upstream sent them), and ``whole``: those
  chunks as the whole answer the same call would have had unstreamed (None when the stream
  was anything but one text answer: tool calls, several choices, a refusal, thinking, an
  error, a stream cut short)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from multiplexer.core.json_codec import loads_lenient

_PIECE = re.compile(r"\S+\s*|\s+")
PIECES = 16  # chunks the answer's text is cut into at most


def _pieces(text: str) -> list[str]:
    words = _PIECE.findall(text)
    step = max(1, -(-len(words) // PIECES))
    return ["".join(words[i:i + step]) for i in range(0, len(words), step)]


def chat_chunks(result: Any, params: Any) -> list[dict[str, Any]] | None:
    """The chunks of a stored ``chat.completion``; None when it is not one (then the call is
    not answered from the cache)."""
    if not isinstance(result, dict) or result.get("object") != "chat.completion":
        return None
    choices = result.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message") or {}
    text = message.get("content")
    if not isinstance(text, str) or message.get("tool_calls"):
        return None
    head = {"id": result.get("id", "chatcmpl-cache"), "object": "chat.completion.chunk",
            "created": result.get("created", 0), "model": result.get("model", "")}
    if result.get("system_fingerprint") is not None:
        head["system_fingerprint"] = result["system_fingerprint"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in _pieces(text)]
    out.append(chunk({}, choices[0].get("finish_reason") or "stop"))
    options = params.get("stream_options") if isinstance(params, dict) else None
    if isinstance(options, dict) and options.get("include_usage") and result.get("usage"):
        out.append({**head, "choices": [], "usage": result["usage"]})
    return out


def message_events(result: Any) -> list[dict[str, Any]] | None:
    """Anthropic's stream of a stored ``message`` (each event's ``type`` is its name); None when
    it is not a message of text blocks only."""
    if not isinstance(result, dict) or result.get("type") != "message":
        return None
    content = result.get("content")
    if not isinstance(content, list) or not content or not all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in content):
        return None
    found = result.get("usage")
    usage: dict[str, Any] = found if isinstance(found, dict) else {}
    opening = {**usage, "output_tokens": 1} if usage else {"input_tokens": 0, "output_tokens": 1}
    start = {"id": result.get("id", "msg_cache"), "type": "message", "role": "assistant",
             "model": result.get("model", ""), "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": opening}
    out: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for i, block in enumerate(content):
        out.append({"type": "content_block_start", "index": i,
                    "content_block": {"type": "text", "text": ""}})
        if i == 0:
            out.append({"type": "ping"})
        out += [{"type": "content_block_delta", "index": i,
                 "delta": {"type": "text_delta", "text": piece}} for piece in _pieces(block["text"])]
        out.append({"type": "content_block_stop", "index": i})
    out.append({"type": "message_delta",
                "delta": {"stop_reason": result.get("stop_reason") or "end_turn",
                          "stop_sequence": result.get("stop_sequence")},
                "usage": {"output_tokens": usage.get("output_tokens", 0)}})
    out.append({"type": "message_stop"})
    return out


def replayed(operation: str, result: Any, params: Any) -> list[dict[str, Any]] | None:
    """A stored answer as the stream its route's operation sends (None: not replayable)."""
    if operation == "chat":
        return chat_chunks(result, params)
    if operation == "messages":
        return message_events(result)
    return None


# -- a relayed stream, kept and assembled ----------------------------------------------------
class Recorder:
    """The face's end of a stream (``core/sink.Reader``) that keeps every chunk it passes on.
    It offers the reader's ``raw`` shape, so an upstream's events still go as their bytes (and
    ``WritingRecorder`` its ``write_now``, the relay's write from the read callback)."""

    __slots__ = ("chunks", "raw", "reader")

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.raw: str | None = getattr(reader, "raw", None)
        self.chunks: list[Any] = []

    async def send(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        await self.reader.send(chunk)

    def send_nowait(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        self.reader.send_nowait(chunk)

    def close(self) -> None:
        self.reader.close()


class WritingRecorder(Recorder):
    """A ``Recorder`` of a reader that takes an upstream's event at once (``write_now``): the
    events the relay writes from the read callback are kept too, in the order written."""

    __slots__ = ()

    def write_now(self, chunks: list[bytes]) -> bool:
        if not self.reader.write_now(chunks):
            return False
        self.chunks += chunks
        return True


def recorder(reader: Any) -> Recorder:
    """The recorder of ``reader``: with ``write_now`` only where the reader has it."""
    return WritingRecorder(reader) if callable(getattr(reader, "write_now", None)) else Recorder(reader)


def _data(chunk: Any) -> dict[str, Any] | None:
    """One chunk's object: itself, or the JSON of an event's ``data`` lines."""
    if isinstance(chunk, dict):
        return chunk
    if isinstance(chunk, (bytes, bytearray, memoryview)):
        lines = [line[5:] for line in bytes(chunk).splitlines() if line.startswith(b"data:")]
        body = b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
        if not body or body == b"[DONE]":
            return None
        try:
            found = loads_lenient(body)
        except ValueError:
            return None
        return found if isinstance(found, dict) else None
    return None


def whole(operation: str, chunks: Iterable[Any], usage: Any) -> dict[str, Any] | None:
    """The whole answer a recorded stream adds up to, in its route's shape (``usage``: what the
    provider's outcome reported at the stream's end); None when it is not one plain text answer."""
    objects = [d for d in map(_data, chunks) if d is not None]
    if operation == "chat":
        return _whole_chat(objects, usage)
    if operation == "messages":
        return _whole_message(objects, usage)
    return None


def _whole_chat(objects: list[dict[str, Any]], usage: Any) -> dict[str, Any] | None:
    head: dict[str, Any] | None = None
    parts: list[str] = []
    finish = None
    for d in objects:
        if d.get("error") is not None:
            return None
        choices = d.get("choices")
        if not isinstance(choices, list):
            continue
        head = head or d
        if d.get("usage"):
            usage = usage or d["usage"]
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict) or delta.get("tool_calls") or delta.get("function_call") \
                    or delta.get("refusal"):
                return None
            if isinstance(delta.get("content"), str):
                parts.append(delta["content"])
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    text = "".join(parts)
    if head is None or finish is None or not text:
        return None
    out: dict[str, Any] = {
        "id": head.get("id", "chatcmpl-cache"), "object": "chat.completion",
        "created": head.get("created", 0), "model": head.get("model", ""),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish}]}
    if head.get("system_fingerprint") is not None:
        out["system_fingerprint"] = head["system_fingerprint"]
    if isinstance(usage, dict) and usage:
        out["usage"] = usage
    return out


def _whole_message(objects: list[dict[str, Any]], usage: Any) -> dict[str, Any] | None:
    start: dict[str, Any] | None = None
    texts: dict[int, list[str]] = {}
    stop_reason = stop_sequence = None
    ended = False
    seen: dict[str, Any] = {}
    for d in objects:
        kind = d.get("type")
        if kind == "message_start" and isinstance(d.get("message"), dict):
            start = d["message"]
            if isinstance(start.get("usage"), dict):
                seen.update(start["usage"])
        elif kind == "content_block_start":
            block = d.get("content_block")
            if not isinstance(block, dict) or block.get("type") != "text":
                return None  # tool use, thinking: not a text answer
            texts.setdefault(int(d.get("index", 0)), []).append(block.get("text") or "")
        elif kind == "content_block_delta":
            delta = d.get("delta")
            if not isinstance(delta, dict) or delta.get("type") != "text_delta":
                return None
            texts.setdefault(int(d.get("index", 0)), []).append(delta.get("text") or "")
        elif kind == "message_delta":
            delta = d.get("delta") or {}
            stop_reason = delta.get("stop_reason", stop_reason)
            stop_sequence = delta.get("stop_sequence", stop_sequence)
            if isinstance(d.get("usage"), dict):
                seen.update(d["usage"])
        elif kind == "message_stop":
            ended = True
        elif kind == "error":
            return None
    content = [{"type": "text", "text": "".join(texts[i])} for i in sorted(texts)]
    if start is None or not ended or stop_reason is None or not any(b["text"] for b in content):
        return None
    if isinstance(usage, dict) and usage:
        seen.update(usage)
    return {"id": start.get("id", "msg_cache"), "type": "message", "role": "assistant",
            "model": start.get("model", ""), "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": seen}
