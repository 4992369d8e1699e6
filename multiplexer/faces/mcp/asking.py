"""The MCP face's side of a relayed question: the one client session whose ``tools/call`` asked.

An upstream's ``elicitation/create``, ``sampling/createMessage`` or ``roots/list``
during a call reaches this ``ClientAsker`` (``multiplexer.core.asking``), made per
``tools/call`` from the request's own context:

- a handshake-era client is asked with a request of its own, related to its call
  (on Streamable HTTP it travels on that call's response stream);
- a 2026-07-28 client takes an upstream's ``input_required`` result as its call's
  result and retries with its answers (``passthrough``), which resume the call
  upstream.

A client that did not declare the capability a question needs is never asked: the
upstream is answered with -32021 naming it, as an upstream would answer itself.
Sampling may be answered by one of the gateway's own chat routes instead
(``server.mcp.sampling``, ``sampling.py``).
"""

from __future__ import annotations

import uuid
from typing import Any, cast

import anyio
import mcp_types as types
from mcp import MCPError
from mcp.server import ServerRequestContext
from mcp.shared.message import ServerMessageMetadata
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from multiplexer.core.asking import ClientGone
from multiplexer.core.errors import RpcError
from multiplexer.faces.mcp.held import Held
from multiplexer.faces.mcp.sampling import Sampler

__all__ = ["ClientAsker", "missing_capability"]

# method -> (the request model, the result model) a handshake-era client is asked with
_WIRE: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "elicitation/create": (types.ElicitRequest, types.ElicitResult),
    "roots/list": (types.ListRootsRequest, types.ListRootsResult),
    "sampling/createMessage": (types.CreateMessageRequest, types.CreateMessageResult),
}


def missing_capability(method: str, params: dict[str, Any],
                       caps: types.ClientCapabilities | None) -> tuple[int, str, Any] | None:
    """The -32021 error for a question this client's declared capabilities do not cover."""
    need: str | None = None
    required: dict[str, Any] = {}
    if method == "sampling/createMessage":
        if caps is None or caps.sampling is None:
            need, required = "sampling", {"sampling": {}}
        elif params.get("tools") and caps.sampling.tools is None:
            need, required = "sampling.tools", {"sampling": {"tools": {}}}
    elif method == "roots/list":
        if caps is None or caps.roots is None:
            need, required = "roots", {"roots": {}}
    elif method == "elicitation/create":
        mode = "url" if params.get("mode") == "url" else "form"
        elicitation = caps.elicitation if caps is not None else None
        # A client that declares ``elicitation: {}`` takes forms (the 2025-06-18 shape).
        declared = elicitation is not None and (
            getattr(elicitation, mode) is not None
            or (mode == "form" and elicitation.form is None and elicitation.url is None))
        if not declared:
            need, required = f"elicitation.{mode}", {"elicitation": {mode: {}}}
    else:
        return types.METHOD_NOT_FOUND, f"Method not found: {method}", {"method": method}
    if need is None:
        return None
    return (types.MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"Client did not declare the {need} capability, which {method} needs",
            {"requiredCapabilities": required})


class ClientAsker:
    """How one ``tools/call``'s upstream questions reach the client session that made it."""

    def __init__(self, ctx: ServerRequestContext[Any, Any], ask_timeout_s: float,
                 sampler: Sampler | None, resume: dict[str, Any] | None, connection: Any = None) -> None:
        self.session = ctx.session
        self.connection = connection  # the client's SDK connection: its end ends a question to it
        self.gone = False
        self.request_id = ctx.request_id
        self.capabilities: types.ClientCapabilities | None = getattr(ctx.session, "client_capabilities", None)
        self.passthrough = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        self.ask_timeout_s = ask_timeout_s
        self.sampler = sampler
        self.resume = resume
        self.held: Held | None = None  # where a 2026-07-28 client's call waits for its answers

    def _on_end(self, scope: anyio.CancelScope) -> None:
        """Stop waiting for an answer when the client's connection ends (registered only when a
        question is put, on the connection's own teardown)."""
        stack = getattr(self.connection, "exit_stack", None)
        if stack is None:
            return

        def ended() -> None:
            self.gone = True
            scope.cancel()

        stack.callback(ended)

    def answers_here(self, method: str, params: dict[str, Any]) -> bool:
        sampler = self.sampler
        if sampler is None or method != "sampling/createMessage" or params.get("tools"):
            return False  # sampling with tools is the client's to answer (the routes take none)
        return sampler.always or missing_capability(method, params, self.capabilities) is not None

    def refusal(self, method: str, params: dict[str, Any]) -> tuple[int, str, Any] | None:
        if self.answers_here(method, params):
            return None
        return missing_capability(method, params, self.capabilities)

    async def ask(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if self.answers_here(method, params):
            assert self.sampler is not None
            return await self.sampler.sample(params)
        if self.passthrough:
            # A 2026-07-28 client answers only through input_required results: a question pushed
            # mid-call (a handshake-era upstream) waits in its held call for the client's retry.
            if self.held is not None:
                return await self.held.ask(method, params)
            raise RpcError(types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                           f"{method}: the calling client speaks 2026-07-28, which takes questions only "
                           "as input_required results, and this upstream asked mid-call",
                           {"requiredCapabilities": {}})
        if method == "elicitation/create" and params.get("mode") == "url" and "elicitationId" not in params:
            # 2026-07-28 dropped the id a handshake-era URL elicitation must carry
            params = {**params, "elicitationId": f"mux-{uuid.uuid4().hex}"}
        request_type, result_type = _WIRE[method]
        if method == "sampling/createMessage" and (params.get("tools") or params.get("toolChoice")):
            result_type = types.CreateMessageResultWithTools
        request = request_type.model_validate({"method": method, "params": params or None})
        try:
            with anyio.CancelScope() as scope:
                self._on_end(scope)
                result = await self.session.send_request(
                    cast("types.ServerRequest", request), result_type,
                    metadata=ServerMessageMetadata(related_request_id=self.request_id))
            if self.gone:
                raise ClientGone("the client's connection ended")
        except MCPError as e:
            if e.code == types.CONNECTION_CLOSED:
                raise ClientGone(e.message) from None
            raise RpcError(e.code, e.message, e.data) from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as e:
            raise ClientGone(type(e).__name__) from None
        dumped: dict[str, Any] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        return dumped
