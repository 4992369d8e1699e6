"""An upstream's questions during a call (elicitation, sampling, roots), relayed to its caller.

The gateway declares elicitation (form and URL), sampling and roots to every
upstream, so an upstream asks as it would ask a client of its own; each question
goes back along the call that caused it (``multiplexer.core.asking``):

- Handshake era, a request pushed mid-call (``elicitation/create``, ...): the SDK
  hands it to ``Questions``' callbacks. Which call it belongs to is found as for log
  messages (``mcp_logs``): over Streamable HTTP the request travels on the call's
  own response stream, whose reader runs in the context of the task that sent the
  call, so ``ASKING`` names its ``Relay``; over stdio nothing names it, and it
  belongs to a call only when that call is the one ``tools/call`` in flight on the
  connection (with two, neither is asked: refused, never sent to the wrong user).
- 2026-07-28, an ``input_required`` result: ``Relay.resume`` answers each embedded
  request the same way and sends the call again with ``inputResponses`` and the
  upstream's ``requestState``; or, for a 2026-07-28 client (``Asker.passthrough``),
  the result goes back to the client, whose retry resumes the call upstream.

While its client is asked, the call's deadline pauses (``Relay`` holds it in a
cancel scope whose deadline moves), for at most the asker's ``ask_timeout_s`` in all.
A client that goes away mid-question ends the call, which cancels it upstream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import anyio
import mcp_types as types
from mcp.client.session import ClientRequestContext
from pydantic import TypeAdapter

from multiplexer.core.asking import PAUSED, Asker, ClientGone
from multiplexer.core.call import Item
from multiplexer.core.errors import RpcError, cancelled, timeout_error

__all__ = ["ASKING", "MAX_ROUNDS", "Questions", "Relay"]

MAX_ROUNDS = 10  # input_required rounds one call may take (the SDKs' own default)
ASKING: ContextVar[Relay | None] = ContextVar("multiplexer_mcp_asking", default=None)
_RESPONSES: TypeAdapter[Any] = TypeAdapter(types.InputResponses)


class Relay:
    """One upstream ``tools/call``'s way back to its caller, and its deadline, paused while asking."""

    def __init__(self, provider: str, asker: Asker | None, item: Item | None = None) -> None:
        self.provider = provider
        self.asker = asker
        # the call's item: how far the pause moved its deadline (``PAUSED``), which its callers'
        # tickets follow (``gateway/tickets.postponed``)
        self.item = item
        self.allowance = getattr(asker, "ask_timeout_s", 0.0) if asker is not None else 0.0
        self.scope: anyio.CancelScope | None = None
        self.gone = False
        self.asked = 0
        self.spent = 0.0  # seconds spent waiting for the client's answers
        self._asking = 0
        self._left = 0.0

    @contextmanager
    def deadline(self, timeout_s: float) -> Iterator[anyio.CancelScope]:
        """The call's own deadline, ``timeout_s`` from now, that stops while its client is asked."""
        scope = self.scope = anyio.CancelScope(deadline=anyio.current_time() + max(timeout_s, 0.0))
        with scope:
            yield scope
        if scope.cancelled_caught:
            if self.gone:
                raise cancelled("the client went away while it was asked a question")
            raise timeout_error("upstream")

    def _pause(self) -> None:
        scope, item = self.scope, self.item
        if self._asking == 0:
            if scope is not None:
                self._left = scope.deadline - anyio.current_time()
                scope.deadline = math.inf
            if item is not None:  # while asking, the most the asking may take
                item.options[PAUSED] = self.spent + max(self.allowance, 0.0)
        self._asking += 1

    def _resume(self) -> None:
        self._asking -= 1
        scope, item = self.scope, self.item
        if self._asking == 0:
            if scope is not None and not scope.cancel_called:
                scope.deadline = anyio.current_time() + self._left
            if item is not None:  # once answered, the time it took
                item.options[PAUSED] = self.spent

    async def answer(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """The caller's answer to one question; an ``RpcError`` the upstream is answered with."""
        asker = self.asker
        if asker is None:
            raise RpcError(types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                           f"the caller of this call cannot be asked ({method}): it reached the "
                           "gateway by a way that takes no questions",
                           {"requiredCapabilities": required(method, params)})
        refused = asker.refusal(method, params)
        if refused is not None:
            raise RpcError(*refused)
        self.asked += 1
        if asker.answers_here(method, params):  # the gateway's own route: a call under its deadline
            return await asker.ask(method, params)
        self._pause()
        began = anyio.current_time()
        try:
            with anyio.move_on_after(max(self.allowance, 0.0)):
                return await asker.ask(method, params)
            raise RpcError(types.REQUEST_TIMEOUT, "the client did not answer in time",
                           {"detail": "server.mcp.ask_timeout_s ran out while the client was asked",
                            "method": method})
        except ClientGone:
            self.gone = True
            if self.scope is not None:
                self.scope.cancel()
            raise RpcError(types.CONNECTION_CLOSED, "the client went away", {"method": method}) from None
        finally:
            waited_s = anyio.current_time() - began
            self.allowance -= waited_s
            self.spent += waited_s
            self._resume()

    async def resume(self, params: types.CallToolRequestParams,
                     result: types.InputRequiredResult) -> types.CallToolRequestParams | None:
        """The call sent again with the answers to an ``input_required`` result's requests; None
        where the result goes back to the client as it is (a 2026-07-28 client answers it)."""
        asker = self.asker
        requests = result.input_requests or {}
        if asker is not None and asker.passthrough and not any(
                asker.answers_here(r.method, _params(r)) for r in requests.values()):
            for r in requests.values():
                refused = asker.refusal(r.method, _params(r))
                if refused is not None:
                    raise as_protocol(*refused)
            return None
        responses: dict[str, Any] = {}
        for key, request in requests.items():
            if asker is not None and asker.passthrough and not asker.answers_here(request.method,
                                                                                  _params(request)):
                continue  # asked of the client in a later round, with what the upstream asks then
            try:
                responses[key] = await self.answer(request.method, _params(request))
            except RpcError as e:  # the call fails as the upstream would fail it, as an MCP error
                raise as_protocol(int(e.code), e.message, e.data) from None
        return params.model_copy(update={
            "input_responses": _responses(responses) if responses else None,
            "request_state": result.request_state})


def as_protocol(code: int, message: str, data: Any) -> RpcError:
    """An error the MCP face answers as the protocol error it is (not as a tool's failure)."""
    return RpcError(code, message, {"mcp_protocol_error": True, "upstream_data": data})


def _params(request: Any) -> dict[str, Any]:
    params = getattr(request, "params", None)
    if params is None:
        return {}
    return params.model_dump(by_alias=True, mode="json", exclude_none=True)


def _responses(answers: dict[str, Any]) -> Any:
    return _RESPONSES.validate_python(answers)


def required(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """The client capability a question needs, as ``requiredCapabilities`` names it."""
    if method == "sampling/createMessage":
        return {"sampling": {}}
    if method == "roots/list":
        return {"roots": {}}
    mode = params.get("mode", "form")
    return {"elicitation": {mode if mode in ("form", "url") else "form": {}}}


class Questions:
    """Per upstream: the SDK client's callbacks for the questions it is asked, and the relays of
    the calls in flight (stdio tells a question's call by there being one)."""

    def __init__(self, name: str, by_stream: bool) -> None:
        self.name = name
        # Streamable HTTP: a question names its call by the stream it came on; one that came on
        # none (the standalone stream) belongs to no call. stdio: by being the one in flight.
        self.by_stream = by_stream
        self._inflight: dict[int, Relay] = {}

    @contextmanager
    def carrying(self, relay: Relay) -> Iterator[None]:
        """While ``relay``'s request is on the wire: its questions find it."""
        token = ASKING.set(relay)
        self._inflight[id(relay)] = relay
        try:
            yield
        finally:
            self._inflight.pop(id(relay), None)
            ASKING.reset(token)

    def _relay(self) -> Relay | None:
        relay = ASKING.get()
        if relay is not None or self.by_stream:
            return relay
        live = list(self._inflight.values())
        return live[0] if len(live) == 1 else None

    async def _relayed(self, method: str, params: dict[str, Any]) -> dict[str, Any] | types.ErrorData:
        relay = self._relay()
        if relay is None:
            why = ("it came on no call's stream" if self.by_stream
                   else "several calls are in flight on this connection")
            message = f"{method}: the gateway cannot tell which of its calls asked ({why})"
            return types.ErrorData(code=types.INVALID_REQUEST, message=message)
        try:
            return await relay.answer(method, params)
        except RpcError as e:
            return types.ErrorData(code=int(e.code), message=e.message, data=e.data)

    async def sampling(self, context: ClientRequestContext, params: types.CreateMessageRequestParams
                       ) -> types.CreateMessageResult | types.CreateMessageResultWithTools | types.ErrorData:
        answer = await self._relayed("sampling/createMessage", _dump(params))
        if isinstance(answer, types.ErrorData):
            return answer
        if isinstance(answer.get("content"), list):
            return types.CreateMessageResultWithTools.model_validate(answer)
        return types.CreateMessageResult.model_validate(answer)

    async def elicitation(self, context: ClientRequestContext,
                          params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
        answer = await self._relayed("elicitation/create", _dump(params))
        return answer if isinstance(answer, types.ErrorData) else types.ElicitResult.model_validate(answer)

    async def roots(self, context: ClientRequestContext) -> types.ListRootsResult | types.ErrorData:
        answer = await self._relayed("roots/list", {})
        return answer if isinstance(answer, types.ErrorData) else types.ListRootsResult.model_validate(answer)


def _dump(params: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = params.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dumped
