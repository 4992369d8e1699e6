"""Generic JSON-RPC 2.0 upstream over HTTP: a lane's batch goes up as ONE batch array."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, upstream_error
from multiplexer.core.gather import gather
from multiplexer.core.limiter import upstream_request
from multiplexer.core.provider import Provider, ProviderContext
from multiplexer.core.retry import with_retries
from multiplexer.transport.http1 import Http1Transport

from .health import ConnectionHealth
from .http_util import all_idempotent, batch_deadline, make_client, send

_MALFORMED = object()
log = logging.getLogger(__name__)


class JsonRpcSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    batch_arrays: bool = True
    # After an upstream refuses an array, singles for this long, then one array again (a refusal
    # may be transient); each refusal in a row doubles the pause, up to an hour.
    batch_arrays_reprobe_s: float = Field(default=300.0, gt=0)
    # lean: the lean connection layer (multiplexer/transport/http1.py; "h11" is its former
    # name); httpx: httpx's own pool.
    transport: Literal["lean", "h11", "httpx"] = "lean"


class JsonRpcProvider(Provider):
    Settings = JsonRpcSettings
    injects_trace = True  # each request carries the traceparent (``tracer.inject``)

    def __init__(self, ctx: ProviderContext) -> None:
        super().__init__(ctx)
        self.settings: JsonRpcSettings = ctx.settings
        self._arrays_off_until: float | None = None  # clock time when arrays are tried again
        self._array_refusals = 0
        self._ids = itertools.count(1)
        self._client: httpx.AsyncClient | None = None
        self._requests = ctx.metrics.upstream_requests.labels(self.name)
        self.health = ConnectionHealth()

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        """The ``Readiness`` capability: failing after connection failures in a row."""
        return self.health.readiness()

    async def start(self) -> None:
        conf = self.ctx.config
        connections = conf.limits.concurrency * 2
        if self.settings.transport != "httpx":
            # The hot path hands prepared requests straight to the transport: the client's
            # per-request work (URL merging, cookies, auth and redirect flows) is not needed.
            transport = Http1Transport(connections)
            self._client = make_client(conf.timeout_ms / 1000, connections, transport=transport,
                                       headers=self.settings.headers)

            async def sender(request: httpx.Request) -> httpx.Response:
                response = await transport.handle_async_request(request)
                await response.aread()  # at once for a reply whole in its first read
                return response

            self._sender = sender
        else:
            self._client = make_client(conf.timeout_ms / 1000, connections,
                                       headers=self.settings.headers)
            self._sender = self._client.send
        self._url = httpx.URL(self.settings.url)
        self._headers = httpx.Headers({**self._client.headers, "content-type": "application/json"})
        self._extensions = {"timeout": self._client.timeout.as_dict()}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def prepare(self, route: Any, item: Item) -> None:
        item.group = None  # any methods may share a batch array

    @property
    def arrays_ok(self) -> bool:
        """Whether the next multi-item batch goes up as one array."""
        if not self.settings.batch_arrays:
            return False
        return self._arrays_off_until is None or self.ctx.clock.now() >= self._arrays_off_until

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if len(items) > 1 and self.arrays_ok:
            outcomes = await self._batch(items)
            if outcomes is not None:
                if self._array_refusals:
                    log.info("%s: the upstream takes batch arrays again", self.name)
                self._arrays_off_until, self._array_refusals = None, 0
                return outcomes
            self._arrays_refused()
        return await self._singles(items)

    def _arrays_refused(self) -> None:
        pause = min(3600.0, self.settings.batch_arrays_reprobe_s * 2 ** self._array_refusals)
        self._array_refusals += 1
        self._arrays_off_until = self.ctx.clock.now() + pause
        log.warning("%s: the upstream refused a batch array; single requests for %.0f s, then "
                    "an array again", self.name, pause)
        self.ctx.metrics.events.labels(self.name, "batch_arrays_refused").inc()

    async def _singles(self, items: Sequence[Item]) -> list[Outcome]:
        return await gather(self._single, items)

    def _message(self, item: Item, rid: int) -> dict[str, Any]:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": item.method}
        if item.params is not None:
            msg["params"] = item.params
        if not item.notification:
            msg["id"] = rid
        return msg

    async def _post(self, payload: Any, items: Sequence[Item]) -> httpx.Response:
        assert self._client is not None
        body = json.dumps(payload, separators=(",", ":")).encode()
        idempotent = all_idempotent(items)

        async def attempt() -> httpx.Response:
            await upstream_request()  # each try is one upstream request: charged by its lane
            request = httpx.Request("POST", self._url, headers=self._headers, content=body,
                                    extensions=self._extensions)
            if self.ctx.tracer.enabled:
                self.ctx.tracer.inject(request.headers)
            self._requests.inc()
            return await send(self._sender, request, self.name, idempotent, self.ctx.clock.wall,
                              self.health)

        retry = self.ctx.config.retry
        return await with_retries(
            attempt, clock=self.ctx.clock, deadline=batch_deadline(items),
            attempts=retry.attempts, base_wait=retry.base_wait_ms / 1000,
            max_wait=retry.max_wait_ms / 1000,
            on_retry=lambda e: self.ctx.metrics.retries.labels(self.name).inc(),
        )

    async def _batch(self, items: Sequence[Item]) -> list[Outcome] | None:
        """One array upstream; None when the upstream does not take arrays."""
        ids = [next(self._ids) for _ in items]
        try:
            response = await self._post([self._message(i, r) for i, r in zip(items, ids,
                                                                               strict=True)], items)
        except RpcError as e:
            status = (e.data or {}).get("upstream_status")
            if status in (400, 404, 405, 415, 422, 501):
                return None
            return [Outcome.fail(e)] * len(items)
        body = self._json(response)
        if isinstance(body, dict) and "error" in body and len(items) > 1:
            return None  # a single error object for an array: arrays are not supported
        if body is None and all(i.notification for i in items):
            return [Outcome(result=None)] * len(items)
        if not isinstance(body, list):
            err = upstream_error(self.name, "upstream sent a malformed batch response",
                                 response.status_code)
            return [Outcome(result=None) if i.notification else Outcome.fail(err) for i in items]
        by_id: dict[Any, Any] = {}
        for reply in body:
            if isinstance(reply, dict) and "id" in reply:
                by_id[reply["id"]] = reply
        return [self._outcome(by_id.get(rid), item) for item, rid in zip(items, ids, strict=True)]

    async def _single(self, item: Item) -> Outcome:
        rid = next(self._ids)
        try:
            response = await self._post(self._message(item, rid), [item])
        except RpcError as e:
            return Outcome.fail(e)
        if item.notification:
            return Outcome(result=None)
        body = self._json(response)
        if isinstance(body, dict) and body.get("id") != rid:
            body = None
        return self._outcome(body, item)

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return _MALFORMED

    def _outcome(self, reply: Any, item: Item) -> Outcome:
        if item.notification:
            return Outcome(result=None)
        if not isinstance(reply, dict):
            return Outcome.fail(upstream_error(self.name, "upstream sent no response for this call"))
        if "error" in reply:
            return Outcome.fail(RpcError.from_dict(reply["error"]))
        if "result" not in reply:
            return Outcome.fail(upstream_error(self.name, "upstream response has no result"))
        return Outcome(result=reply["result"])
