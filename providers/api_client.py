"""One pooled HTTP client per remote provider: auth, retries, and limits learned from every reply.

Every response, success or not, teaches the lane's limiter what the upstream
says is left; a 429/529 also pauses the lane for Retry-After (or, when the
upstream omits it, until the exhausted bucket resets) before the retry. The client
never charges the limiter: each request (first try, retry, a batch's next request)
asks the charge its lane handed in (``core/limiter.upstream_request``).
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from multiplexer.core.after import after
from multiplexer.core.attempts import budgets, spend, tries
from multiplexer.core.cache_affinity import moves_tally
from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, upstream_error, upstream_unavailable
from multiplexer.core.failures import UNWELL, reason_of
from multiplexer.core.gather import gather
from multiplexer.core.json_codec import dumps, loads_lenient
from multiplexer.core.limiter import upstream_request
from multiplexer.core.metrics import status_label
from multiplexer.core.provider import ProviderContext
from multiplexer.core.retry import Retryable, with_retries
from multiplexer.transport.connection import Conn
from multiplexer.transport.http1 import Http1Transport, Opened

from .endpoints import BreakerOpen, Endpoints
from .health import CONNECT_FAILURES, ConnectionHealth
from .http_util import classify, make_client
from .ratelimit_headers import Parser, apply, wait_hint

log = logging.getLogger(__name__)

PAUSE_STATUSES = {429, 529}
T = TypeVar("T")
# Batch jobs and their files live on one endpoint: with several base_urls they use the first.
PINNED = ("/files", "/batches", "/messages/batches")


class ApiClient:
    """Requests go straight to the transport (the lean HTTP/1.1 one unless the context hands in
    another): the httpx client only builds the cold-path requests (multipart uploads, query
    params), and its per-request flows (auth, redirects, cookies) are not needed."""

    def __init__(self, ctx: ProviderContext, base_url: str, headers: Mapping[str, str],
                 parse_limits: Parser) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers)
        self._parse_limits = parse_limits
        self._client: httpx.AsyncClient | None = None
        self._transport: httpx.AsyncBaseTransport | None = None
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._targets: dict[tuple[str, str], tuple[httpx.URL, list[tuple[bytes, bytes]]]] = {}
        self._requests = ctx.metrics.upstream_requests.labels(self.name)
        self.health = ConnectionHealth()  # the provider's readiness
        bases = getattr(ctx.settings, "base_urls", None)  # several endpoints: spread over them
        self.endpoints = Endpoints(bases, ctx.clock, ctx.settings, self._endpoint_event) if bases else None
        if bases:
            self.base_url = bases[0].rstrip("/")
        if self.endpoints is not None and self.endpoints.mode != "off":
            moves, group = moves_tally(ctx.metrics), f"{self.name}@base_urls"
            self.endpoints.on_move = lambda why: moves.add((group, why))

    def key_of(self, item: Item) -> int | None:
        """A request's prompt-cache key among several ``base_urls`` (None: none, or one endpoint)."""
        return self.endpoints.key_of(item) if self.endpoints is not None else None

    def _endpoint_event(self, event: str) -> None:
        self.ctx.metrics.events.labels(self.name, event).inc()

    async def start(self) -> None:
        conf = self.ctx.config
        if self.endpoints is not None and conf.breaker is not None and self.ctx.breakers is not None:
            for ep in self.endpoints.all:  # one breaker per endpoint, in the gateway's set
                ep.breaker = self.ctx.breakers.get(f"{self.name}@{ep.base}") or \
                    self.ctx.breakers.add(f"{self.name}@{ep.base}", conf.breaker)
        connections = max(conf.limits.concurrency * 2, 8)
        self._transport = self.ctx.transport or Http1Transport(connections)
        self._client = make_client(conf.timeout_ms / 1000, connections, headers=self._headers,
                                   transport=self._transport)
        self._json_headers = httpx.Headers({**self._client.headers,
                                            "content-type": "application/json"})
        self._timeouts = self._client.timeout.as_dict()
        self._extensions = {"timeout": self._timeouts}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()  # closes the transport too
            self._client = self._transport = None

    def url(self, path: str, base: str | None = None) -> str:
        return path if path.startswith(("http://", "https://")) else (base or self.base_url) + path

    def learn(self, response: httpx.Response) -> None:
        """Feed the limiter from one response's headers (also used by callers that stream)."""
        # one dict: each httpx header lookup scans them all
        self._learn(response.status_code, dict(response.headers.multi_items()))

    def _learn(self, status: int, headers: dict[str, str]) -> None:
        observations = self._parse_limits(headers, self.ctx.clock.wall)
        apply(self.ctx.limiter, observations)
        if status in PAUSE_STATUSES:
            wait = wait_hint(headers, observations, self.ctx.clock.wall)
            if wait is not None:
                self.ctx.limiter.pause(wait)

    def build(self, method: str, path: str, base: str | None = None, **kwargs: Any) -> httpx.Request:
        """A request for ``path``; a JSON body (the hot path) skips the client's merging."""
        assert self._client is not None, "ApiClient used before start()"
        if kwargs.keys() == {"json"}:
            url = self._urls.get((base or "", path))
            if url is None:
                url = self._urls[(base or "", path)] = httpx.URL(self.url(path, base))
            request = httpx.Request(method, url, headers=self._json_headers,
                                    content=dumps(kwargs["json"]), extensions=self._extensions)
        else:
            request = self._client.build_request(method, self.url(path, base), **kwargs)
        if self.ctx.tracer.enabled:
            self.ctx.tracer.inject(request.headers)  # the upstream batch's traceparent
        return request

    async def _attempt(self, request: httpx.Request, idempotent: bool,
                       stream: bool) -> httpx.Response:
        assert self._transport is not None, "ApiClient used before start()"
        self._requests.inc()
        try:
            response = await self._transport.handle_async_request(request)
            if not stream:
                await response.aread()
        except httpx.HTTPError as e:
            raise self._unreachable(e, idempotent) from None
        self.health.reached()
        response.request = request
        self._learn(response.status_code, dict(response.headers.multi_items()))
        if response.status_code < 400:
            return response
        if stream:
            await response.aread()
            await response.aclose()
        raise self._refused(response, idempotent)

    def _head(self, path: str, base: str | None, content: bytes
              ) -> tuple[httpx.URL, list[tuple[bytes, bytes]]]:
        """A JSON request's URL and headers (the lean transport's parts), the upstream batch's
        ``traceparent`` among them when traces are on."""
        key = (base or "", path)
        target = self._targets.get(key)
        if target is None:
            url = httpx.URL(self.url(path, base))
            head = [(b"host", url.netloc), *self._json_headers.raw]
            target = self._targets[key] = (url, head)
        url, head = target
        headers = [*head, (b"content-length", str(len(content)).encode())]
        if self.ctx.tracer.enabled:
            carrier: dict[str, str] = {}
            self.ctx.tracer.inject(carrier)  # the upstream batch's traceparent
            headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        return url, headers

    def _heard(self, status: int, raw: list[tuple[bytes, bytes]],
               headers: dict[str, str] | None = None) -> None:
        """A reply's head reached us: the endpoint is healthy and the limiter learns from it, from
        a success once the answer is written (core/after.py: its headers decoded then too, unless
        the caller has ``headers`` decoded already), from a refusal at once (a retry must see its
        pause)."""
        self.health.reached()
        if status < 400:
            after(self._learn_raw, status, raw, headers)
        else:
            self._learn_raw(status, raw, headers)

    def _learn_raw(self, status: int, raw: list[tuple[bytes, bytes]],
                   headers: dict[str, str] | None) -> None:
        self._learn(status, decoded(raw) if headers is None else headers)

    def _refused_reply(self, method: str, url: httpx.URL, status: int,
                       headers: list[tuple[bytes, bytes]], content: bytes,
                       idempotent: bool) -> Exception:
        response = httpx.Response(status, headers=headers, content=content,
                                  request=httpx.Request(method, url))
        return self._refused(response, idempotent)

    async def _fetch_json(self, method: str, path: str, base: str | None, body: Any,
                          idempotent: bool) -> dict[str, Any]:
        """The hot path: a JSON request through the lean transport without httpx's Request and
        Response objects (built only for an error)."""
        assert isinstance(self._transport, Http1Transport), "ApiClient used before start()"
        content = dumps(body)
        url, headers = self._head(path, base, content)
        self._requests.inc()
        try:
            reply = await self._transport.fetch(method, url, headers, content, self._timeouts)
        except httpx.HTTPError as e:
            raise self._unreachable(e, idempotent) from None
        self._heard(reply.status, reply.headers)
        if reply.status >= 400:
            raise self._refused_reply(method, url, reply.status, reply.headers, reply.content,
                                      idempotent)
        return decode_body(self.name, reply.status, reply.content)

    async def _open(self, method: str, path: str, base: str | None, body: Any,
                    idempotent: bool) -> StreamedReply:
        """A streamed request through the lean transport, as ``_fetch_json``; the caller reads
        and closes the reply."""
        assert isinstance(self._transport, Http1Transport), "ApiClient used before start()"
        content = dumps(body)
        url, headers = self._head(path, base, content)
        self._requests.inc()
        try:
            opened = await self._transport.open(method, url, headers, content, self._timeouts)
        except httpx.HTTPError as e:
            raise self._unreachable(e, idempotent) from None
        heard = decoded(opened.headers)  # the stream's reader needs them too
        try:
            self._heard(opened.status, opened.headers, heard)
            if opened.status >= 400:
                content = await opened.read()
                raise self._refused_reply(method, url, opened.status, opened.headers, content,
                                          idempotent)
        except BaseException:
            await opened.aclose()
            raise
        return StreamedReply(heard, opened)

    async def stream(self, method: str, path: str, body: Any, *, idempotent: bool,
                     deadline: float | None, key: int | None = None) -> StreamedReply | httpx.Response:
        """A 2xx reply to a JSON request, to read as it comes (server-sent events) and close,
        after retries, or the final ``RpcError``. Through the lean transport it skips httpx's
        ``Request`` and ``Response``; either reply is what httpx_sse's ``EventSource`` reads."""
        if isinstance(self._transport, Http1Transport):
            return await self._retrying(path, deadline, lambda base: self._open(
                method, path, base, body, idempotent), key)
        return await self.request(method, path, idempotent=idempotent, deadline=deadline,
                                  stream=True, key=key, json=body)

    def _unreachable(self, e: httpx.HTTPError, idempotent: bool) -> Exception:
        self.health.failed(e)
        self.ctx.metrics.upstream_errors.labels(self.name, type(e).__name__).inc()
        return classify(self.name, e, None, idempotent, self.ctx.clock.wall)

    def _refused(self, response: httpx.Response, idempotent: bool) -> Exception:
        """An error status as Retryable (with the wait the upstream asks for) or final."""
        self.ctx.metrics.upstream_errors.labels(self.name, status_label(response.status_code)).inc()
        error = classify(self.name, None, response, idempotent, self.ctx.clock.wall)
        refused_body(error.final if isinstance(error, Retryable) else error, response.content)
        if (isinstance(error, Retryable) and error.retry_after is None
                and response.status_code in PAUSE_STATUSES):
            wall = self.ctx.clock.wall
            error.retry_after = wait_hint(response.headers, self._parse_limits(response.headers, wall), wall)
        return error

    async def request(self, method: str, path: str, *, idempotent: bool, deadline: float | None,
                      stream: bool = False, key: int | None = None, **kwargs: Any) -> httpx.Response:
        """A 2xx response after retries, or the final ``RpcError``.

        With ``stream=True`` the caller reads and closes the body (large result files,
        server-sent events); such a body has no size cap.
        """
        async def send(base: str | None) -> httpx.Response:
            request = self.build(method, path, base, **kwargs)
            if stream:
                request.extensions = {**request.extensions, "max_response_bytes": None}
            return await self._attempt(request, idempotent, stream)

        return await self._retrying(path, deadline, send, key)

    async def _retrying(self, path: str, deadline: float | None,
                        send: Callable[[str | None], Awaitable[T]], key: int | None = None) -> T:
        """``send`` (given the endpoint's base URL) under the retry policy, spread over the
        endpoints when there are several (``key``: the request's prompt-cache key, ``key_of``)."""
        retry = self.ctx.config.retry
        endpoints = None if path.startswith(PINNED) else self.endpoints
        found = budgets()  # calls with fallbacks: one budget of requests over all their routes

        async def attempt() -> T:
            if endpoints is None:
                await upstream_request()  # each try is one upstream request: charged by its lane
                if found:
                    spend(found)
                return await send(None)
            try:
                endpoint = await endpoints.take(key)
            except BreakerOpen as e:  # no request goes: the route's fallback takes the call
                raise self._breaker_open(e.retry_after) from None
            await upstream_request()
            if found:
                spend(found)
            connected = False
            unwell: bool | None = None  # None: no verdict (cancelled)
            try:
                result = await send(endpoint.base)
                connected, unwell = True, False
                return result
            except Exception as e:
                connected = not isinstance(e.__context__, CONNECT_FAILURES)
                unwell = isinstance(e, Retryable) or (
                    isinstance(e, RpcError) and reason_of(e) in UNWELL)
                raise
            finally:
                endpoints.done(endpoint, connected)
                if endpoint.breaker is not None and self.ctx.breakers is not None:
                    if unwell is None:
                        endpoint.breaker.release()
                    else:
                        self.ctx.breakers.record(endpoint.breaker.name, unwell)

        return await with_retries(
            attempt, clock=self.ctx.clock, deadline=deadline,
            attempts=tries(retry.attempts, found) if found else retry.attempts,
            base_wait=retry.base_wait_ms / 1000, max_wait=retry.max_wait_ms / 1000,
            on_retry=lambda e: self.ctx.metrics.retries.labels(self.name).inc(),
        )

    def _breaker_open(self, retry_after: float) -> RpcError:
        error = upstream_unavailable(self.name, f"circuit breaker open for every endpoint of "
                                                f"{self.name}; none takes calls for {retry_after:.1f} s")
        assert error.data is not None
        error.data.update(breaker="open", retry_after=round(max(retry_after, 0.001), 3))
        return error

    async def json(self, method: str, path: str, *, idempotent: bool, deadline: float | None,
                   key: int | None = None, **kwargs: Any) -> Any:
        """A decoded JSON object; a malformed body is an ``RpcError`` naming the provider."""
        if kwargs.keys() == {"json"} and isinstance(self._transport, Http1Transport):
            body = kwargs["json"]
            return await self._retrying(path, deadline, lambda base: self._fetch_json(
                method, path, base, body, idempotent), key)
        response = await self.request(method, path, idempotent=idempotent, deadline=deadline,
                                      key=key, **kwargs)
        return decode_json(self.name, response)


class StreamedReply:
    """A streamed reply from the lean transport as httpx_sse's ``EventSource`` reads one (its
    ``headers`` and ``aiter_text``), without httpx's ``Response`` and its stream layers. An
    event stream is UTF-8 (the spec says so; no charset to sniff)."""

    __slots__ = ("_opened", "headers")

    def __init__(self, headers: dict[str, str], opened: Opened) -> None:
        self.headers = headers
        self._opened = opened

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come (what ``providers/sse_relay.py`` splits into events):
        the body's own iterator where nothing came with the head, one generator fewer a chunk."""
        opened = self._opened
        if not opened.first and opened.rest is not None:
            return opened.rest.__aiter__()
        return opened.__aiter__()

    def connection(self) -> Conn | None:
        """The connection the body comes on (``Opened.connection``)."""
        return self._opened.connection()

    async def aiter_text(self) -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for chunk in self._opened:
            if text := decoder.decode(chunk):
                yield text
        if text := decoder.decode(b"", final=True):
            yield text

    async def aclose(self) -> None:
        await self._opened.aclose()


def decode_json(provider: str, response: httpx.Response) -> dict[str, Any]:
    return decode_body(provider, response.status_code, response.content)


def decoded(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """A reply's raw header pairs as text, as httpx decodes them."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}


def decode_body(provider: str, status: int, content: bytes) -> dict[str, Any]:
    try:
        body = loads_lenient(content)
    except ValueError:
        raise upstream_error(provider, "upstream sent a malformed (non-JSON) body", status) from None
    if not isinstance(body, dict):
        raise upstream_error(provider, "upstream sent a malformed body (JSON, but not an object)",
                             status)
    return body


def error_detail(body: Any) -> tuple[str, str | None]:
    """(message, code) from an OpenAI or Anthropic error body, tolerating odd shapes."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            if isinstance(err.get("error"), dict):  # Anthropic envelope inside a batch result
                err = err["error"]
            message = err.get("message")
            code = err.get("code") or err.get("type")
            return (str(message) if message is not None else "upstream error",
                    str(code) if code is not None else None)
    return "upstream error", None


def refused_body(error: Exception, content: bytes) -> None:
    """An OpenAI or Anthropic error body as the error's detail, ``upstream_code`` and ``param``,
    which the ``/v1`` faces hand on to the SDKs (tools branch on codes such as
    ``context_length_exceeded``); other bodies stay as the raw text ``classify`` kept."""
    try:
        body = loads_lenient(content)
    except ValueError:
        return
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, RpcError) or error.data is None or not isinstance(err, dict) \
            or not isinstance(err.get("message"), str):
        return
    error.data["detail"] = err["message"]
    code = err.get("code") if body.get("type") != "error" else err.get("type")  # Anthropic: its type
    if isinstance(code, str) and code:
        error.data["upstream_code"] = code
    if isinstance(err.get("param"), str):
        error.data["param"] = err["param"]


def item_error(provider: str, body: Any, status: int | None) -> RpcError:
    message, code = error_detail(body)
    extra = {"upstream_code": code} if code else {}
    return upstream_error(provider, message, status, **extra)


async def run_each(items: Sequence[Item], run_one: Callable[[Item], Awaitable[Outcome]]) -> list[Outcome]:
    """One request per item, concurrently, inside the batch's one slot; the lane charges each."""
    if len(items) == 1:
        return [await run_one(items[0])]
    return await gather(lambda i: run_one(items[i]), range(len(items)))
