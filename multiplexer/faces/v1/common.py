"""What the OpenAI- and Anthropic-compatible faces share: keys from either header, model to
route, the body, request ids, the caller's quota headers, and gateway errors as HTTP statuses.

Each surface supplies a ``Surface``: how its error body looks and which header carries the
request id, so the official SDKs raise their own exception classes for our errors.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from multiplexer.core.call import Call, Outcome
from multiplexer.core.errors import (
    Code,
    RpcError,
    body_too_large,
    closest,
    invalid_params,
    invalid_request,
    not_served,
)
from multiplexer.core.foreign import Translates, Translation
from multiplexer.core.json_codec import dumps, loads
from multiplexer.core.policy import RouteConfig
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.body import BodyTooLarge, ClientGone, read_body
from multiplexer.gateway.config import Config
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.reload import on_reload

JSON = b"application/json"
# The trace context of the HTTP request being served (set by the endpoint when tracing).
REQUEST_TRACE: ContextVar[dict[str, str] | None] = ContextVar("v1_request_trace", default=None)
# The key of the request being served (set by ``V1.identify``): an unknown model's refusal
# points it only at models it may use. ANYONE: no request identified here (nothing is suggested).
ANYONE = "\0"
CALLER: ContextVar[str | None] = ContextVar("v1_caller", default=ANYONE)


class HttpError(Exception):
    """An answer already decided (status, error): raised inside a handler, rendered by the surface."""

    def __init__(self, status: int, error: RpcError, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(error.message)
        self.status, self.error, self.param, self.code = status, error, param, code


def status_of(error: RpcError, overloaded: int = 503) -> int:
    """The HTTP status the SDKs map to the right exception (and retry policy) for an error."""
    data = error.data or {}
    if error.code == Code.UPSTREAM_ERROR:
        status = data.get("upstream_status")
        if isinstance(status, int) and 400 <= status <= 599 and status not in (401, 403):
            return status  # the upstream's own verdict on this call's body
        return 502  # a bad gateway key upstream, or no status at all, is the gateway's fault
    if error.code == Code.RATE_LIMITED and data.get("reason") == "permission_denied":
        return 403  # the key may not use this model or route (access.rules)
    return {
        Code.PARSE_ERROR: 400, Code.INVALID_REQUEST: 400, Code.INVALID_PARAMS: 400,
        Code.METHOD_NOT_FOUND: 404, Code.NOT_FOUND: 404, Code.UNAUTHORIZED: 401,
        Code.RATE_LIMITED: 429, Code.OVERLOADED: overloaded, Code.TIMEOUT: 504,
        Code.TOO_LARGE: 413, Code.UPSTREAM_UNAVAILABLE: 503, Code.SHUTTING_DOWN: 503,
        Code.CANCELLED: 499,
    }.get(error.code, 500)  # type: ignore[call-overload]


def message_of(error: RpcError) -> str:
    """``Invalid params: 'messages' must be ...``: the code's name and the precise detail; a
    quota's refusal names its limit and the wait (``Rate limited: tpm; retry after 12 s``), which
    the body has no field for. A budget's message says it all (the period, when it resets)."""
    data = error.data or {}
    detail = data.get("detail")
    budget = data.get("limit") == "budget_usd"
    if not (isinstance(detail, str) and detail) and error.code == Code.RATE_LIMITED and not budget:
        detail = data.get("limit")
    said = f"{error.message}: {detail}" if isinstance(detail, str) and detail else error.message
    after = data.get("retry_after")
    if error.code in WAITS and not budget and isinstance(after, int | float) and math.isfinite(after):
        said += f"; retry after {max(1, math.ceil(after))} s"
    return said


WAITS = (Code.RATE_LIMITED, Code.OVERLOADED, Code.SHUTTING_DOWN)  # refusals that pass with time


def retry_headers(error: RpcError) -> list[tuple[bytes, bytes]]:
    after = (error.data or {}).get("retry_after")
    if not isinstance(after, int | float) or not math.isfinite(after):
        return []
    return [(b"retry-after", str(max(1, math.ceil(after))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(after * 1000))).encode())]


@dataclass(frozen=True, slots=True)
class Surface:
    """One wire dialect: its error body and its request-id header."""

    request_id_header: bytes
    error_body: Callable[[int, RpcError, str | None, str | None], dict[str, Any]]
    overloaded_status: int = 503


class V1:
    """Per-app state: the gateway, the key check, and the model names the routes list."""

    def __init__(self, gateway: Gateway, auth: Authenticator) -> None:
        self.gateway = gateway
        self.auth = auth
        self.limit = gateway.config.server.max_body_bytes
        self.models: dict[str, str] = {}  # model name -> route name
        self._serves: dict[str, str] = {}  # route name -> what it answers (Provider.answers)
        # (route name, endpoint) -> its translation: a runtime Protocol check costs ~10 µs a call
        self._translations: dict[tuple[str, str], Translation | None] = {}
        self.reconfigured(gateway.config)
        on_reload(gateway, self.reconfigured)

    def reconfigured(self, config: Config) -> None:
        """The model names of ``config``'s routes and groups (at start and on a config reload);
        what each route answers asked of its provider again."""
        models: dict[str, str] = {}
        for name, route in config.routes.items():
            if not name.endswith("*"):
                for model in route.models:
                    models.setdefault(model, name)
        for group in config.groups:  # a model group's name is a public model
            models[group] = group
        self.models, self._serves, self._translations = models, {}, {}

    def route_for(self, model: Any) -> tuple[str, RouteConfig]:
        """The route a request's ``model`` selects: one that lists it, or the route of that name."""
        if not isinstance(model, str) or not model:
            raise HttpError(400, invalid_request("'model' is required"), param="model")
        routes = self.gateway.config.routes
        name = self.models.get(model) or (model if model in routes and not model.endswith("*")
                                          else None)
        if name is None:
            raise self.unknown_model(model, CALLER.get())
        return name, self.gateway.resolve(name).route  # a group's: its first route

    def visible(self, identity: str | None, model: str, route: str) -> bool:
        """Whether ``/v1/models`` shows this model to this key (its models and routes globs)."""
        rules = self.gateway.keys.rules_of(identity)
        return rules is None or (rules.route_ok(route) and rules.model_ok(route, model))

    def unknown_model(self, model: str, identity: str | None = ANYONE) -> HttpError:
        """404 naming the models there are and the closest name a request may use (a model, a
        route or a model group): of those ``identity`` may see; none when it is not known."""
        if identity == ANYONE and self.auth.enabled:
            known: list[str] = []
            hint = None
        else:
            who = None if identity == ANYONE else identity
            known = sorted(m for m, r in self.models.items() if self.visible(who, m, r))
            routes = [r for r in self.gateway.config.routes
                      if not r.endswith("*") and r not in self.models and self.visible(who, r, r)]
            hint = closest(model, [*known, *routes])
        data: dict[str, Any] = {"model": model, "known": known}
        if hint is not None:
            data["did_you_mean"] = hint
        error = RpcError(Code.NOT_FOUND, not_served("model", model, hint), data)
        return HttpError(404, error, param="model", code="model_not_found")

    def serves(self, name: str) -> str:
        """What route ``name`` answers (``chat``, ``embed``, ``call``, ...), asked of its kind once."""
        found = self._serves.get(name)
        if found is None:
            route = self.gateway.resolve(name).route
            provider = self.gateway.providers[route.provider]
            ctx = getattr(provider, "ctx", None)  # a stand-in made without one (tests) has none
            found = self._serves[name] = type(provider).answers(route, getattr(ctx, "settings", None))
        return found

    def translation(self, name: str, endpoint: str) -> Translation | None:
        """How route ``name``'s provider takes ``endpoint``'s body, when its own API differs
        (the ``Translates`` capability: Gemini); None when it takes the body as it is."""
        key = (name, endpoint)
        if key in self._translations:
            return self._translations[key]
        provider = self.gateway.providers[self.gateway.resolve(name).route.provider]
        found = provider.translation(endpoint) if isinstance(provider, Translates) else None
        self._translations[key] = found
        return found

    def require_operation(self, name: str, operation: str, model: Any, what: str) -> None:
        """400 unless route ``name``'s provider has an upstream path for ``operation`` (an endpoint
        that asks for an operation other than the route's, like ``/v1/responses``)."""
        provider = self.gateway.providers[self.gateway.resolve(name).route.provider]
        if operation not in getattr(provider, "paths", {}):
            raise HttpError(400, invalid_params(f"model {model!r} is served by route {name}, whose "
                                                f"provider has no {what}"), param="model")

    def params_for(self, body: dict[str, Any], name: str, route: RouteConfig) -> dict[str, Any]:
        """The body as the call's params; a route chosen by its own name sends its configured model
        (``params.model``, else its first listed model; the name itself only when it is listed as a
        model and no ``params.model`` says otherwise)."""
        if body["model"] != name or (name in route.models and "model" not in route.params):
            return body
        params = {k: v for k, v in body.items() if k != "model"}
        if "model" not in route.params and route.models:
            params["model"] = route.models[0]
        return params

    def identify(self, headers: dict[bytes, bytes]) -> str | None:
        """``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (what the Anthropic SDK sends)."""
        auth = headers.get(b"authorization")
        if auth is None and (key := headers.get(b"x-api-key")) is not None:
            auth = b"Bearer " + key
        try:
            identity = self.auth.identify(auth.decode("latin-1") if auth else None)
        except RpcError as e:  # its message says it whole: the detail is for /rpc's data
            raise HttpError(401, RpcError(e.code, e.message), code="invalid_api_key") from None
        CALLER.set(identity)
        return identity

    async def read_json(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        """The request body as a JSON object, within ``server.max_body_bytes``."""
        try:
            raw = await read_body(dict(scope["headers"]).get(b"content-length"), receive, self.limit)
        except BodyTooLarge:
            length = dict(scope["headers"]).get(b"content-length")
            raise HttpError(413, body_too_large(self.limit, length)) from None
        except ClientGone:
            raise HttpError(499, RpcError(Code.CANCELLED, "Client closed the request")) from None
        return self.json_object(raw)

    @staticmethod
    def json_object(raw: bytes) -> dict[str, Any]:
        try:
            body = loads(raw)
        except (ValueError, RecursionError) as e:
            raise HttpError(400, invalid_request(f"the body is not valid JSON ({e})")) from None
        if not isinstance(body, dict):
            raise HttpError(400, invalid_request("the body must be a JSON object"))
        return body

    def quota_headers(self, identity: str | None) -> list[tuple[bytes, bytes]]:
        """The caller's own rpm and tpm quotas as ``x-ratelimit-*`` (OpenAI's names and formats);
        a quota shared by replicas shows as its last shared decision left it (no round trip)."""
        quotas = self.gateway.quotas
        quota = quotas.limits(identity)
        if quota is None:
            return []
        out: list[tuple[bytes, bytes]] = []
        for kind, unit, limit in (("rpm", b"requests", quota.rpm), ("tpm", b"tokens", quota.tpm)):
            state = None if limit is None else quotas.window(identity, kind)
            if state is None:
                continue
            limit, left, reset = state
            out.append((b"x-ratelimit-limit-" + unit, str(int(limit)).encode()))
            if left is not None and reset is not None:
                out += [(b"x-ratelimit-remaining-" + unit, str(int(left)).encode()),
                        (b"x-ratelimit-reset-" + unit, f"{reset:.3f}s".encode())]
        return out

    async def submit(self, call: Call) -> Outcome:
        call.face = "v1"  # a key's models are checked against the model this face was asked for
        if self.gateway.tracer.enabled:
            call.trace = REQUEST_TRACE.get()
        return await self.gateway.submit(call)


def page_limit(query: Any, maximum: int, default: int = 20) -> int:
    """A list endpoint's ``limit`` query parameter, from 1 to ``maximum`` (400 otherwise)."""
    try:
        limit = int(query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= maximum:
        raise HttpError(400, invalid_params(f"limit must be an integer from 1 to {maximum}"),
                        param="limit")
    return limit


async def send_json(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    await send_encoded(send, status, dumps(body), headers)


async def send_encoded(send: Send, status: int, raw: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """A body that is JSON already."""
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", JSON), (b"content-length", str(len(raw)).encode()), *headers]})
    await send({"type": "http.response.body", "body": raw})


async def send_chunks(send: Send, content_type: bytes, chunks: AsyncIterator[bytes],
                      headers: list[tuple[bytes, bytes]]) -> None:
    """A body made a chunk at a time (a 50,000-line results file), sent as it is made. The first
    chunk is made before anything is sent, so what fails early still gets its error reply."""
    first = await anext(chunks, b"")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", content_type), *headers]})
    await send({"type": "http.response.body", "body": first, "more_body": True})
    async for chunk in chunks:
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def send_error(send: Send, surface: Surface, e: HttpError,
                     headers: list[tuple[bytes, bytes]]) -> None:
    extra = list(headers) + retry_headers(e.error)
    if e.status == 401:
        extra.append((b"www-authenticate", b'Bearer realm="multiplexer"'))
    await send_json(send, e.status, surface.error_body(e.status, e.error, e.param, e.code), extra)


def http_error(error: RpcError, surface: Surface) -> HttpError:
    """A gateway outcome's error as this surface's status, with the param it names."""
    param = (error.data or {}).get("param")
    code = (error.data or {}).get("upstream_code")
    return HttpError(status_of(error, surface.overloaded_status), error,
                     param=param if isinstance(param, str) else None,
                     code=code if isinstance(code, str) else None)
