"""The OpenAI Responses API's objects and stream events, built from plain text: by the ``/v1``
face for local generate models and by the mock provider, which answer in them without an
upstream to copy them from. Pure dicts; usage comes in chat's terms (``prompt_tokens``,
``completion_tokens``) and leaves in the Responses API's."""

from __future__ import annotations

from typing import Any

# the events that end a Responses stream, the last with the response's usage
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    """The assistant's output message with its one text part."""
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def response_object(rid: str, mid: str, created: int, model: str, status: str, text: str | None,
                    usage: Any = None) -> dict[str, Any]:
    """A ``response``: ``text`` None while it is in progress (no output yet); ``incomplete`` says
    the output budget cut it."""
    output = [] if text is None else [message_item(mid, text, "completed")]
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    out: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": incomplete, "parallel_tool_calls": False,
        "tool_choice": "none", "tools": [], "usage": None,
    }
    if isinstance(usage, dict):
        spent_in, spent_out = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        out["usage"] = {"input_tokens": spent_in, "output_tokens": spent_out,
                        "total_tokens": spent_in + spent_out, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}}
    return out


class ResponseEvents:
    """One stream's events, numbered in order (``sequence_number``); each is a dict whose ``type``
    is the SSE event's name."""

    def __init__(self, rid: str, mid: str, created: int, model: str) -> None:
        self.rid, self.mid, self.created, self.model = rid, mid, created, model
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return data

    def opening(self) -> list[dict[str, Any]]:
        """The response created and in progress, its message and text part added."""
        started = response_object(self.rid, self.mid, self.created, self.model, "in_progress", None)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.created", response=started),
                self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0,
                           item={**message_item(self.mid, "", "in_progress"), "content": []}),
                self.event("response.content_part.added", item_id=self.mid, output_index=0,
                           content_index=0, part=part)]

    def delta(self, text: str) -> dict[str, Any]:
        return self.event("response.output_text.delta", item_id=self.mid, output_index=0,
                          content_index=0, delta=text, logprobs=[])

    def closing(self, status: str, text: str, usage: Any) -> list[dict[str, Any]]:
        """The text, its part and its message done, then ``response.completed`` (or ``incomplete``)."""
        message = message_item(self.mid, text, "completed")
        return [self.event("response.output_text.done", item_id=self.mid, output_index=0,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.mid, output_index=0,
                           content_index=0, part=message["content"][0]),
                self.event("response.output_item.done", output_index=0, item=message),
                self.event(f"response.{status}", response=response_object(
                    self.rid, self.mid, self.created, self.model, status, text, usage))]
