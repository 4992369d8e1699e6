"""MCP over Streamable HTTP at ``server.mcp.path``, beside ``/rpc`` on the same port.

The SDK's ``StreamableHTTPSessionManager`` serves both protocol eras. In front
of it this face checks ``Origin`` (DNS rebinding) and the bearer key (401 with a
JSON-RPC error body), and handles JSON-RPC batch arrays by revision: current
revisions refuse them (batching happens inside the gateway, not on the wire),
2025-03-26 sessions get them split and answered as one array. A 2026-07-28 POST
goes to ``exchange.SingleExchange``, which serves it in the request's own task
(and hands the SDK's entry whatever it would refuse).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.routes import create_protected_resource_routes
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import AnyHttpUrl
from starlette.datastructures import URL, Headers
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive, Scope, Send

from multiplexer.access.bearer import InsufficientScope, InvalidToken, challenge
from multiplexer.core.errors import Code, RpcError, invalid_request, parse_error
from multiplexer.core.json_codec import loads
from multiplexer.core.startup import StartupError
from multiplexer.faces.access import note_of
from multiplexer.faces.auth import Authenticator
from multiplexer.faces.body import BodyTooLarge, ClientGone, read_body
from multiplexer.faces.http import rpc_error, too_large, unauthorized
from multiplexer.faces.mcp.batch import BATCH_REVISIONS, serve_batch
from multiplexer.faces.mcp.exchange import SingleExchange
from multiplexer.faces.mcp.replica_sessions import ReplicaSessionManager, session_manager
from multiplexer.faces.mcp.server import IDENTITY_SCOPE_KEY, McpFace
from multiplexer.faces.reply import Reply
from multiplexer.gateway.gateway import Gateway

if TYPE_CHECKING:
    from multiplexer.access.oauth import TokenVerifier

_ARRAY_DETAIL = ("JSON-RPC batch arrays are not accepted on /mcp at this protocol revision; "
                 "send one message per request (the gateway batches upstream calls itself)")


def origin_allowed(origin: str | None, allowed: list[str]) -> bool:
    """No Origin (not a browser) passes; otherwise scheme://host must be listed, any port."""
    if not origin:
        return True
    if "*" in allowed:
        return True
    origin = origin.rstrip("/").lower()
    for entry in allowed:
        entry = entry.rstrip("/").lower()
        if origin == entry or (origin.startswith(entry + ":") and origin[len(entry) + 1:].isdigit()):
            return True
    return False


class McpEndpoint:
    """The ASGI app at the MCP path: checks, then the SDK's session manager."""

    def __init__(self, face: McpFace, manager: StreamableHTTPSessionManager, auth: Authenticator,
                 allowed_origins: list[str], max_body: int, max_batch: int,
                 max_sessions_per_key: int | None = None,
                 admits: Callable[[str | None, Any], bool] | None = None,
                 oauth: TokenVerifier | None = None) -> None:
        self.face = face
        self.oauth = oauth  # server.oauth: bearer JWTs (or introspected tokens) besides API keys
        self.admits = admits  # a virtual server's keys and teams; None: every authenticated caller
        # The one read of the manager's private state: what it entered ``app.lifespan`` for.
        self.exchange = SingleExchange(face.server, manager.handle_request, lambda: manager._lifespan_state)
        self.max_sessions_per_key = max_sessions_per_key
        self._opening: Counter[str | None] = Counter()  # initialize requests in flight, per identity
        self.manager = manager
        self.auth = auth
        self.allowed_origins = allowed_origins
        self.max_body = max_body
        self.max_batch = max_batch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if not origin_allowed(origin, self.allowed_origins):
            err = RpcError(Code.INVALID_REQUEST, "Forbidden: origin not allowed",
                           {"origin": origin[:200] if origin else None})
            await rpc_error(403, err)(scope, receive, send)
            return
        if scope.get("method") == "GET" and "mcp-session-id" not in headers:
            await not_a_page(scope)(scope, receive, send)
            return
        note = note_of(scope)
        try:
            identity = await self._identify(headers.get("authorization"))
        except RpcError as e:
            if note is not None:
                note.code = e.code
            await unauthorized(e)(scope, receive, send)
            return
        except Refused as e:
            if note is not None:
                note.code = Code.UNAUTHORIZED
            await e.response()(scope, receive, send)
            return
        if note is not None:
            note.key = identity
        if self.admits is not None and not self.admits(identity, scope):
            refusal = RpcError(Code.RATE_LIMITED, "Permission denied",
                               {"reason": "permission_denied",
                                "detail": "this key may not use this MCP server"})
            await rpc_error(403, refusal)(scope, receive, send)
            return
        scope = dict(scope)
        scope[IDENTITY_SCOPE_KEY] = identity
        if identity is not None:
            # The session manager binds each session to the credential that opened it.
            scope["user"] = AuthenticatedUser(AccessToken(token="", client_id=identity, scopes=[]))
        if scope.get("method") == "POST":
            try:
                body = await read_body(headers.get("content-length"), receive, self.max_body)
            except BodyTooLarge:
                await too_large(self.max_body, headers.get("content-length"))(scope, receive, send)
                return
            except ClientGone:
                return
            if body.lstrip()[:1] == b"[":
                await self._array(scope, headers, body, receive, send)
                return
            receive = _replay(body, receive)
            if self.max_sessions_per_key is not None and _is_initialize(headers, body):
                await self._open_session(identity, scope, receive, send)
                return
            version = headers.get("mcp-protocol-version")
            if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
                await self.exchange(scope, receive, send, headers, body)
                return
        await self.manager.handle_request(scope, receive, send)

    async def _identify(self, authorization: str | None) -> str | None:
        """An API key's identity; with ``server.oauth``, else a valid token's (``oauth:<sub>``)."""
        if self.oauth is None:
            return self.auth.identify(authorization)
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Refused(self.oauth, 401, None, "a bearer token is required")
        if self.auth.enabled:
            try:
                return self.auth.identify(authorization)
            except RpcError:
                pass  # not one of our keys: a token, perhaps
        try:
            found = await self.oauth.verify(token)
        except InvalidToken as e:
            raise Refused(self.oauth, 401, "invalid_token", str(e)) from None
        except InsufficientScope as e:
            raise Refused(self.oauth, 403, "insufficient_scope", "the token lacks a required scope",
                          scope=str(e)) from None
        self.face.gateway.keys.bind(found.identity, found.team)
        return found.identity

    async def _open_session(self, identity: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        """A new handshake-era session, unless this key holds its cap (one client must not hold them all).

        Sessions being opened count too, so a burst of ``initialize`` cannot overshoot the cap.
        """
        cap = self.max_sessions_per_key
        assert cap is not None
        held = self.face.sessions_of(identity) + self._opening[identity]
        if held >= cap:
            refusal = RpcError(Code.RATE_LIMITED, "Rate limited: too many open MCP sessions for this key",
                               {"limit": "mcp_sessions", "max": cap, "open": held})
            await rpc_error(429, refusal)(scope, receive, send)
            return
        self._opening[identity] += 1
        try:
            await self.manager.handle_request(scope, receive, send)  # counted by the face once open
        finally:
            self._opening[identity] -= 1
            if self._opening[identity] <= 0:
                del self._opening[identity]

    async def _array(self, scope: Scope, headers: Headers, body: bytes, receive: Receive,
                     send: Send) -> None:
        """Batches exist only at 2025-03-26 (the revision the header or the session names)."""
        session_id = headers.get("mcp-session-id")
        version = headers.get("mcp-protocol-version") or self.face.session_version(session_id)
        if version is None and session_id and isinstance(self.manager, ReplicaSessionManager):
            version = await self.manager.revision(session_id)  # a session another replica opened
        if version not in BATCH_REVISIONS:
            await rpc_error(400, invalid_request(_ARRAY_DETAIL))(scope, receive, send)
            return
        try:
            items = loads(body)
        except (ValueError, RecursionError) as e:
            await rpc_error(400, parse_error(str(e)[:200]))(scope, receive, send)
            return
        if len(items) > self.max_batch:
            detail = (f"batch of {len(items)} items exceeds the limit of {self.max_batch} "
                      "(server.max_batch_items); send it in smaller batches")
            await rpc_error(400, invalid_request(detail))(scope, receive, send)
            return
        await serve_batch(self.manager.handle_request, scope, items, receive, send)


def not_a_page(scope: Scope) -> Reply:
    """``GET`` without a session (a browser): 405 saying what this URL is for, no session opened
    (a GET stream belongs to a session an MCP client opened with a POST)."""
    url = str(URL(scope=scope).replace(query="", fragment=""))
    error = RpcError(Code.INVALID_REQUEST, f"This is an MCP endpoint, not a page: point an MCP client "
                                           f"(Streamable HTTP) at {url}; it speaks POST")
    return rpc_error(405, error, [(b"allow", b"POST")])


class Refused(Exception):
    """A request without a valid bearer under ``server.oauth``: 401 (or 403 for scopes) with the
    challenge that tells an MCP client where to find the authorization server."""

    def __init__(self, oauth: TokenVerifier, status: int, error: str | None, description: str,
                 scope: str | None = None) -> None:
        super().__init__(description)
        self.status = status
        self.header = challenge(oauth.metadata_url, error, description if error else None,
                                scope or (" ".join(oauth.settings.scopes) or None))

    def response(self) -> JSONResponse:
        code = Code.UNAUTHORIZED
        body = {"jsonrpc": "2.0", "id": None,
                "error": {"code": int(code), "message": "Unauthorized", "data": {"detail": str(self)}}}
        return JSONResponse(body, status_code=self.status, headers={"WWW-Authenticate": self.header})


def _is_initialize(headers: Headers, body: bytes) -> bool:
    """A request that opens a handshake-era session (the cheap checks first)."""
    if headers.get("mcp-session-id") or b'"initialize"' not in body:
        return False
    try:
        message = loads(body)
    except (ValueError, RecursionError):
        return False  # the SDK answers malformed JSON itself
    return isinstance(message, dict) and message.get("method") == "initialize"


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def mount_mcp(gateway: Gateway, authenticator: Authenticator) -> tuple[list[BaseRoute], Any]:
    """Routes for the HTTP app and the lifespan that runs the session managers: the gateway's MCP
    server at ``server.mcp.path``, and each virtual server (``mcp_servers``) under it."""
    from multiplexer.access.compose import key_store_on
    from multiplexer.faces.mcp.virtual import StoredServers, stored_face, virtual_faces

    path = gateway.config.server.mcp.path
    settings = gateway.config.server.oauth
    oauth = None
    if settings is not None:
        try:
            from multiplexer.access.oauth import TokenVerifier  # joserfc: the oauth extra
        except ImportError as e:
            raise StartupError("server.oauth", settings.issuer,
                               f"needs joserfc ({e}); pip install 'multiplexer[oauth]'") from None
        oauth = TokenVerifier(settings)
    mounts = [mount_one(gateway, authenticator, path, McpFace(gateway), None, "mcp", oauth)]
    for name, face, admits in virtual_faces(gateway):
        mounts.append(mount_one(gateway, authenticator, f"{path.rstrip('/')}/{name}", face, admits,
                                f"mcp/{name}", oauth))
    if key_store_on(gateway.config):  # virtual servers made through the admin API, after the config's
        face, admits = stored_face(gateway)
        mounts.append(mount_one(gateway, authenticator, f"{path.rstrip('/')}/{{name}}", face, admits,
                                "mcp/*", oauth, wrap=lambda app: StoredServers(gateway, app)))

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if oauth is not None:
                stack.push_async_callback(oauth.aclose)
            for _, running in mounts:
                await stack.enter_async_context(running())
            yield

    routes = [route for routes, _ in mounts for route in routes]
    if settings is not None and oauth is not None:  # RFC 9728 metadata, from the SDK
        routes += create_protected_resource_routes(
            resource_url=AnyHttpUrl(oauth.resource), authorization_servers=[AnyHttpUrl(settings.issuer)],
            scopes_supported=settings.scopes or None)
    return routes, lifespan


def mount_one(gateway: Gateway, authenticator: Authenticator, path: str, face: McpFace,
              admits: Callable[[str | None, Any], bool] | None, name: str,
              oauth: TokenVerifier | None = None, wrap: Callable[[Any], Any] | None = None
              ) -> tuple[list[BaseRoute], Callable[[], AbstractAsyncContextManager[None]]]:
    """One MCP server at ``path``: its routes, and what runs while the app does."""
    server = gateway.config.server
    gateway.faces[name] = face
    manager = session_manager(  # the SDK's, shared by the replicas with state.url
        face, name,
        max_request_body_size=server.max_body_bytes,
        max_sessions=server.mcp.max_sessions,
        session_idle_timeout=server.mcp.session_idle_s,
        security_settings=None,  # Origin is checked above against server.mcp.allowed_origins
    )
    endpoint = McpEndpoint(face, manager, authenticator, server.mcp.allowed_origins,
                           server.max_body_bytes, server.max_batch_items, server.mcp.max_sessions_per_key,
                           admits, oauth)

    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        async with manager.run(), face.running(), endpoint.exchange.running():
            yield

    # POST listed on its own so ``ExactPaths`` sends it straight here, past Starlette's stack; the
    # route for every method keeps the SDK's answers to the rest (a 405 with its body).
    app: Any = endpoint if wrap is None else wrap(endpoint)
    routes: list[BaseRoute] = [Route(path, app, methods=["POST"]), Route(path, app)]
    return routes, running
