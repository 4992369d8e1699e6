"""What the HTTP LLM providers share: an API client, a durable job manager, body checks,
token charging, and one request per call for the operations that do not pack."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import anyio
import httpx
from httpx_sse import SSEError

from multiplexer.core.batching import CountFormation
from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, cancelled, invalid_params, upstream_error, upstream_unavailable
from multiplexer.core.json_codec import loads_lenient
from multiplexer.core.limiter import uncharged
from multiplexer.core.policy import BatchPolicy, RouteConfig
from multiplexer.core.provider import Provider, ProviderContext, stream_sink
from multiplexer.core.sink import ChunkSink

from .api_client import ApiClient, StreamedReply, run_each
from .batch.backend import BatchBackend
from .batch.jobs import JobManager
from .batch.sync_fallback import SyncFallback
from .dedup_rules import deterministic_chat
from .formations import PackOrSingle
from .sse_relay import Event, Relay, Splitter, events, plain

# In-flight requests when the config says none: a hosted API takes thousands at once and
# says what it allows in its rate-limit headers, which the lane's limiter learns; a
# small default (the lane's 16) would cap a 64-client run below the upstream's speed, and
# a stream holds its slot to its end, so 256 held a worker's 1,000 streams to 256 upstream
# at once (the rest queued for seconds, ``benchmarks/bench_streams.py``).
DEFAULT_CONCURRENCY = 10_000


class LlmProvider(Provider):
    """Subclasses name their ``paths`` (operation -> endpoint), which operations pack
    several calls into one request, and how a response body reports token usage."""

    default_concurrency = DEFAULT_CONCURRENCY
    injects_trace = True  # ApiClient puts the traceparent on each request

    paths: ClassVar[dict[str, str]]
    packable: ClassVar[frozenset[str]] = frozenset()

    @staticmethod
    def usage_total(body: Any) -> int | None:
        """Tokens a response body says it used; None when it does not say."""
        return None

    def __init__(self, ctx: ProviderContext, api: ApiClient,
                 backend: Callable[[ApiClient], BatchBackend]) -> None:
        super().__init__(ctx)
        self.api = api
        sync = SyncFallback(self.run_one, ctx.limiter, ctx.clock, ctx.config.limits.concurrency)
        self.jobs = JobManager(ctx, ctx.settings, backend(api), sync)

    async def start(self) -> None:
        await self.api.start()
        try:
            await self.jobs.start()
        except BaseException:  # a store.url that cannot be used: nothing else stays open
            await self.api.aclose()
            raise

    async def aclose(self) -> None:
        try:
            await self.jobs.aclose()
        finally:
            await self.api.aclose()

    def readiness(self) -> tuple[Literal["up", "starting", "failing"], str | None]:
        """The ``Readiness`` capability: failing after connection failures in a row."""
        return self.api.health.readiness()

    def op_path(self, operation: str, model: Any) -> str:
        """The upstream path of an operation (Azure: the deployment, ``model``, is in it)."""
        return self.paths[operation]

    def request_body(self, item: Item) -> tuple[dict[str, Any], str]:
        """The call's params as a request body, checked for what every operation needs."""
        if item.operation not in self.paths:
            raise invalid_params(f"{self.name} has no operation {item.operation!r}",
                                 operations=sorted(self.paths))
        params = item.params
        if not isinstance(params, dict):
            raise invalid_params("params must be an object (the provider's request body)")
        model = params.get("model")
        if not isinstance(model, str) or not model:
            raise invalid_params("'model' is required (in params or the route's params)",
                                 param="model")
        if params.get("stream") and stream_sink(item) is None:
            raise invalid_params("stream: true needs a streaming face (/v1/chat/completions, "
                                 "/v1/messages); /rpc answers whole", param="stream")
        return params, model

    @staticmethod
    def require_messages(params: dict[str, Any]) -> None:
        messages = params.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid_params("'messages' must be a non-empty array", param="messages")

    @staticmethod
    def charge(route: RouteConfig, item: Item, tokens: int) -> None:
        item.options["mode"] = route.mode
        if route.mode == "batch":
            item.options["tokens"] = tokens
            item.tokens = 0  # batch APIs have their own quota; keep the live lane's budget free
        else:
            item.tokens = tokens

    def idempotent(self, item: Item) -> bool:
        return bool(item.options.get("idempotent")) or deterministic_chat(item.params)

    def dedup_safe(self, item: Item) -> bool:
        return deterministic_chat(item.params)

    def formation(self, policy: BatchPolicy) -> PackOrSingle:
        count = CountFormation(policy.max_items, policy.max_wait_ms / 1000.0, policy.max_tokens)
        return PackOrSingle(count, self.packable)

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if items[0].options.get("mode") == "batch":
            with uncharged():  # the job's requests and the tasks that drive it are its own
                return await self.jobs.run_items(items)
        return await self.execute_now(operation, items)

    async def execute_now(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        return await run_each(items, self.run_one)

    async def run_one(self, item: Item) -> Outcome:
        """One synchronous request for one call."""
        try:
            path = self.op_path(item.operation, item.params.get("model"))
            body = await self.api.json("POST", path, json=item.params, key=self.api.key_of(item),
                                       idempotent=self.idempotent(item), deadline=item.deadline)
        except RpcError as e:
            return Outcome.fail(e)
        self.correct(item.tokens, body)
        return Outcome(result=body)

    def correct(self, estimated: int, body: Any) -> None:
        actual = self.usage_total(body)
        if actual is not None and estimated:
            self.ctx.limiter.correct_tokens(estimated, actual)

    # -- streaming (the ``Streamer`` capability) ----------------------------------------
    usage_key = "usage"  # where a body reports its usage (Gemini: usageMetadata)

    def stream_path(self, item: Item) -> str:
        """The upstream path of a streamed call."""
        return self.op_path(item.operation, item.params.get("model"))

    def stream_request(self, item: Item) -> dict[str, Any]:
        """The upstream body of a streamed call."""
        return {**item.params, "stream": True}

    def stream_event(self, item: Item, event: str, data: dict[str, Any],
                     usage: dict[str, Any]) -> bool:
        """Note what an upstream event says about usage; whether to pass it on. An event
        that reports a failure raises its ``RpcError``."""
        return True

    def stream_end(self, item: Item, event: str, data: dict[str, Any]) -> bool:
        """Whether an upstream event is its stream's last (``[DONE]`` always is): a stream that
        stops before one broke off, and must not reach its client as complete."""
        return False

    def passes(self, item: Item, event: Event) -> bool:
        """Whether an upstream event may go on unread: a search of its bytes shows it says
        nothing ``stream_event`` or ``stream_end`` read (usage, a failure, the last event). A
        kind that does not say reads every event."""
        return False

    async def stream(self, item: Item, sink: ChunkSink) -> Outcome:
        """One streamed request; each upstream event goes to ``sink`` as it arrives: as the
        upstream's own bytes where the face's events have its shape (``sink.raw``) and the
        event says nothing to read (``passes``), else parsed. Closing the response (a
        cancelled call, a reader gone) ends the upstream stream."""
        try:
            response = await self.api.stream("POST", self.stream_path(item), self.stream_request(item),
                                             idempotent=False, deadline=item.deadline,
                                             key=self.api.key_of(item))
        except RpcError as e:
            return Outcome.fail(e)
        usage: dict[str, Any] = {}
        ended = False
        raw = sink.raw
        splitter = Splitter()
        conn = response.connection() if isinstance(response, StreamedReply) else None
        if conn is not None and raw is not None and sink.writes_now:  # chunks from the read callback
            conn.relay = Relay(conn, splitter, sink, raw, lambda event: self.passes(item, event))
        try:
            kind = response.headers.get("content-type", "").partition(";")[0]
            if "text/event-stream" not in kind:  # as httpx_sse says it
                raise SSEError("Expected response header Content-Type to contain "
                               f"'text/event-stream', got {kind!r}")
            async for event in events(response.aiter_bytes(), splitter):
                body = event.data
                if plain(event, raw) and self.passes(item, event):
                    await sink.send(event.wire)
                    continue
                if body == b"[DONE]":
                    ended = True
                    break
                try:
                    data = loads_lenient(body)
                except ValueError:
                    return Outcome.fail(upstream_error(self.name, "malformed stream event (not JSON)"))
                if not isinstance(data, dict):
                    continue
                if self.stream_event(item, event.name, data, usage):
                    await sink.send(data)
                ended = ended or self.stream_end(item, event.name, data)
        except RpcError as e:
            return Outcome.fail(e)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return Outcome.fail(cancelled("the client stopped reading the stream"))
        except SSEError as e:
            return Outcome.fail(upstream_error(self.name, f"malformed stream: {e}"))
        except httpx.HTTPError as e:  # the upstream went mid-stream: what was sent cannot be sent again
            broke = f"the stream broke off: {type(e).__name__}: {e}"
            return Outcome.fail(upstream_unavailable(self.name, broke))
        finally:
            if conn is not None:
                conn.relay = None
            await response.aclose()
        if not ended:
            return Outcome.fail(upstream_unavailable(self.name, "the stream ended before its last event"))
        self.correct(item.tokens, {self.usage_key: usage})
        return Outcome(result={self.usage_key: usage})
