"""A ``/v1`` request body as a gateway call: which route its model picks, the params it sends,
and how the result is shaped back; shared by the live endpoints and batch input lines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from multiplexer.core.errors import RpcError, invalid_params
from multiplexer.core.foreign import Translation
from multiplexer.core.policy import RouteConfig
from multiplexer.faces.v1.common import V1, HttpError, status_of
from multiplexer.faces.v1.local_chat import (
    chat_params,
    chat_result,
    completion_params,
    completion_result,
    responses_params,
    responses_result,
)

CHAT, EMBEDDINGS, MESSAGES = "/v1/chat/completions", "/v1/embeddings", "/v1/messages"
RESPONSES, COMPLETIONS = "/v1/responses", "/v1/completions"
# endpoint -> what a route must answer to serve it (``Provider.answers``: its operation, or a
# local model's task); these are also the endpoints a Batch API file may name. Responses API
# calls go to the chat routes of providers that know the upstream endpoint, or to local generate
# models (answered in the Responses API's shapes here). Any other route (echo, jsonrpc, an MCP
# tool, a classifier) is refused with a 400 that names it, never sent a body it cannot answer.
GENERATE = "generate"
OPERATIONS = {CHAT: ("chat", GENERATE), EMBEDDINGS: ("embeddings", "embed"), MESSAGES: ("messages",),
              RESPONSES: ("chat", GENERATE), COMPLETIONS: ("chat", GENERATE)}
# endpoints a remote chat route serves through another operation of its provider
_OTHER = {RESPONSES: ("responses", "Responses API"), COMPLETIONS: ("completions", "legacy completions API")}

Shape = Callable[[Any], Any]
# endpoints a local generate route answers in their own shapes: (params from the body, result)
LOCAL: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[Any, str], Any]]] = {
    CHAT: (chat_params, chat_result), RESPONSES: (responses_params, responses_result),
    COMPLETIONS: (completion_params, completion_result)}


def plan(v1: V1, endpoint: str, body: dict[str, Any], identity: str | None = None,
         ) -> tuple[str, dict[str, Any], Shape | None]:
    """(route name, params, result shaper or None) for a body sent to ``endpoint``. A route that
    does not serve ``endpoint`` is refused (400) after the caller's access to it (403,
    ``refused_first``); ``identity`` None (a batch's lines): each line's access is checked as it is
    admitted."""
    name, route = v1.route_for(body.get("model"))
    params = v1.params_for(upstream_body(body, route), name, route)
    serves = v1.serves(name)
    translation = v1.translation(name, endpoint)
    if translation is not None and serves == translation.operation:
        return name, *translated(translation, params, body)
    if serves not in OPERATIONS[endpoint]:
        refused_first(v1, identity, name, params)
        what = endpoint.removeprefix("/v1/").replace("/", " ")
        raise HttpError(400, invalid_params(f"model {body['model']!r} is served by route {name} "
                                            f"({serves}), not {what}", route=name, serves=serves),
                        param="model")
    if endpoint in LOCAL and serves == GENERATE:
        model = body["model"]
        to_params, to_result = LOCAL[endpoint]
        return name, to_params(params), lambda result: to_result(result, model)
    if endpoint in _OTHER:  # a remote route: the upstream's own endpoint for it
        operation, what = _OTHER[endpoint]
        require_operation(v1, identity, name, body, params, operation, what)
    return name, params, None


def upstream_body(body: dict[str, Any], route: RouteConfig) -> dict[str, Any]:
    """The body without the fields the gateway reads itself, which a provider that refuses unknown
    fields would answer with a 400: ``_meta``, and ``service_tier: "flex"`` on a ``mode: auto``
    route (its deadline, ``deadline.py``). A body with neither is returned as it is (no copy)."""
    flex = route.mode == "auto" and body.get("service_tier") == "flex"
    if "_meta" not in body and not flex:
        return body
    return {k: v for k, v in body.items() if k != "_meta" and not (flex and k == "service_tier")}


def require_operation(v1: V1, identity: str | None, name: str, body: dict[str, Any], params: Any,
                      operation: str, what: str) -> None:
    """``V1.require_operation``, after the caller's access to the route (``refused_first``)."""
    try:
        v1.require_operation(name, operation, body.get("model"), what)
    except HttpError:
        refused_first(v1, identity, name, params)
        raise


def refused_first(v1: V1, identity: str | None, name: str, params: Any) -> None:
    """Raise the key's refusal of route ``name`` (403), if it has one: a key learns it may not use
    a route before it learns what the route serves. A call it may make is checked (and counted)
    at admission, as every call is."""
    if identity is not None and (refused := v1.gateway.attempt_refusal(identity, name, params, "v1")):
        raise HttpError(status_of(refused), refused)


def translated(translation: Translation, params: dict[str, Any],
               body: dict[str, Any]) -> tuple[dict[str, Any], Shape]:
    """The body in the provider's own API, and the shaper of its result back (``core/foreign``)."""
    try:
        native = translation.params(params)
    except RpcError as e:
        param = (e.data or {}).get("param")
        raise HttpError(400, e, param=param if isinstance(param, str) else None) from None
    return native, lambda result: translation.result(result, body)


def operation_for(endpoint: str, shape: Shape | None) -> str | None:
    """The provider operation a call for ``endpoint`` asks for when it is not its route's own
    (``responses``, ``completions`` on a remote chat route; a local one answers in their shapes)."""
    return _OTHER[endpoint][0] if endpoint in _OTHER and shape is None else None


def stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise HttpError(400, invalid_params("'stream' must be a boolean"), param="stream")
    return bool(stream)
