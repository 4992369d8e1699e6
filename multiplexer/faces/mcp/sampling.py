"""An upstream's ``sampling/createMessage`` answered by one of this gateway's chat routes.

With ``server.mcp.sampling: {route: chat, when: always | client_lacks}`` the request
becomes a call of the calling key on a chat route, born in admission like any other
(``Gateway.submit``): the key's access to that route, its quotas and its budget
decide it, and it is priced and booked to that key. Its face is ``mcp_sampling``
(the source its traces and access checks name), so a key that may not use the route
is refused, and the upstream gets that refusal as its answer.

Which route answers (the request's ``modelPreferences``):

| the request's hints | the route |
|---|---|
| a hint's ``name`` is a route or model group the key may use | that one (first hint first) |
| a hint's ``name`` is part of such a name | the first such, in config order |
| no hint matches (or none given) | ``sampling.route`` |

The cost, speed and intelligence priorities are not used: the config's groups say that.
"""

from __future__ import annotations

from typing import Any

from multiplexer.core.call import Call
from multiplexer.core.errors import Code, RpcError, invalid_params
from multiplexer.gateway.config import McpSamplingConfig
from multiplexer.gateway.gateway import Gateway

__all__ = ["FACE", "Sampler", "chat_body", "sampling_result"]

FACE = "mcp_sampling"  # the call's face: its source in traces and in access checks


def _text(content: Any) -> Any:
    """A sampling message's content as chat content: text, or parts (text and images)."""
    blocks = content if isinstance(content, list) else [content]
    parts: list[dict[str, Any]] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            url = f"data:{block.get('mimeType', 'image/png')};base64,{block.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid_params(f"sampling through the gateway takes text and image content, not {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def chat_body(params: dict[str, Any]) -> dict[str, Any]:
    """``CreateMessageRequestParams`` (JSON) as an OpenAI chat completions body."""
    if params.get("tools"):
        raise invalid_params("sampling with tools is not answered by the gateway's routes")
    messages: list[dict[str, Any]] = []
    if params.get("systemPrompt"):
        messages.append({"role": "system", "content": params["systemPrompt"]})
    for message in params.get("messages") or []:
        messages.append({"role": message.get("role", "user"), "content": _text(message.get("content"))})
    body: dict[str, Any] = {"messages": messages, "max_tokens": params.get("maxTokens", 1)}
    if params.get("temperature") is not None:
        body["temperature"] = params["temperature"]
    if params.get("stopSequences"):
        body["stop"] = params["stopSequences"]
    return body


def sampling_result(result: Any, route: str) -> dict[str, Any]:
    """A chat completion as ``CreateMessageResult`` (JSON)."""
    try:
        choice = result["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise RpcError(Code.INTERNAL_ERROR, "the sampling route's answer is not a chat completion",
                       {"route": route}) from None
    stop = {"length": "maxTokens", "stop": "endTurn"}.get(choice.get("finish_reason"), "endTurn")
    return {"role": "assistant", "content": {"type": "text", "text": text},
            "model": str(result.get("model") or route), "stopReason": stop}


class Sampler:
    """One caller's sampling requests, answered by the gateway's routes under its key."""

    def __init__(self, gateway: Gateway, config: McpSamplingConfig, identity: str | None) -> None:
        self.gateway = gateway
        self.config = config
        self.identity = identity
        self.always = config.when == "always"

    def _may_use(self, name: str) -> bool:
        identity = self.identity
        return identity is None or self.gateway.attempt_refusal(identity, name, None, FACE) is None

    def route_for(self, preferences: Any) -> str:
        """The route the request's model hints name (the table above), else the configured one."""
        hints = preferences.get("hints") if isinstance(preferences, dict) else None
        names: list[str] = [h["name"] for h in hints or [] if isinstance(h, dict)
                            and isinstance(h.get("name"), str)]
        if names:
            config = self.gateway.config
            known = [*config.routes, *config.groups]
            for hint in names:
                if hint in known and self._may_use(hint):
                    return hint
            for hint in names:
                for name in known:
                    if hint in name and "*" not in name and self._may_use(name):
                        return name
        return self.config.route

    async def sample(self, params: dict[str, Any]) -> dict[str, Any]:
        """The answer, or the call's error (a refusal of the key, the route's failure)."""
        route = self.route_for(params.get("modelPreferences"))
        call = Call(route, chat_body(params), identity=self.identity)
        call.face = FACE
        outcome = await self.gateway.submit(call)
        error = outcome.error
        if error is not None:  # the upstream hears why, in its message too (the data may not reach it)
            detail = (error.data or {}).get("detail") if isinstance(error.data, dict) else None
            why = f"{error.message}: {detail}" if isinstance(detail, str) else error.message
            raise RpcError(error.code, f"sampling on route {route!r} refused or failed: {why}", error.data)
        return sampling_result(outcome.result, call.route or route)
