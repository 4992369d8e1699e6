"""``kind: mock``: a stand-in model that answers offline in the real APIs' shapes, as LiteLLM's
``mock_response`` does, so a client, a tutorial or a test runs with no key and no network.

It answers OpenAI chat completions (and, on the same route, the Responses API and legacy
completions), OpenAI embeddings, and Anthropic messages and token counts; whole, or streamed a
word per chunk with the same events the ``openai`` and ``anthropic`` providers pass on. What it
sends says mock (ids, ``system_fingerprint``), so nobody takes it for a model.

Tokens are whitespace-separated words: usage counts the words of the prompt and of the reply, a
stream sends one word per chunk, and ``max_tokens`` (``max_output_tokens``) cuts the reply at that
many words. Embeddings are unit vectors drawn from SHAKE-256 of each input: the same text gives
the same vector in any process.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
from pydantic import BaseModel, ConfigDict, Field

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import RpcError, cancelled, invalid_params
from multiplexer.core.policy import RouteConfig
from multiplexer.core.provider import Provider, ProviderContext, stream_sink
from multiplexer.core.responses_api import ResponseEvents, response_object
from multiplexer.core.sink import ChunkSink

from .packing import content_text, embedding_inputs

# operation -> the API endpoint whose shapes it answers in (``paths``: what the /v1 face checks
# before it sends a route's provider another operation than the route's own)
OPERATIONS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
              "completions": "/v1/completions", "embeddings": "/v1/embeddings",
              "messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}
STREAMED = frozenset({"chat", "responses", "completions", "messages"})
FINGERPRINT = "fp_mock"


class MockSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response: str | None = Field(
        default=None, description="the reply's text; unset: a sentence that echoes the last user message")
    latency_ms: float = Field(
        default=0.0, ge=0, description="model time before each answer (a stream's first word), on the "
                                       "gateway's clock")
    dimensions: int = Field(default=384, ge=1, le=8192,
                            description="embedding size when a call names none")


def words(text: str) -> list[str]:
    """The reply as it streams: each word with the space before it, so the pieces join to the text."""
    parts = text.split(" ")
    return [p if i == 0 else " " + p for i, p in enumerate(parts)]


def count(text: str) -> int:
    """Tokens, for a mock: whitespace-separated words."""
    return len(text.split())


def unit_vector(text: str, dimensions: int) -> list[float]:
    """A unit vector from SHAKE-256 of the text: the same text, the same vector, in any process."""
    raw = hashlib.shake_256(text.encode()).digest(2 * dimensions)
    values = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{dimensions}H", raw)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32s, as OpenAI sends (and its SDK asks)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def _last_user(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def _budget(params: dict[str, Any], *keys: str) -> int | None:
    """The caller's output budget under the first of ``keys`` it sets; None: no cap."""
    for key in keys:
        value = params.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise invalid_params(f"'{key}' must be a positive integer", param=key)
            return value
    return None


@dataclass(slots=True)
class Prompt:
    """What a generation call asks: the text to echo, its words (tokens) and the output budget."""

    last: str  # the last user message (a completion's prompt)
    tokens: int
    budget: int | None


def prompt_of(operation: str, params: dict[str, Any]) -> Prompt:
    """The prompt of a chat, messages, count_tokens, responses or completions call, checked."""
    if operation in ("chat", "messages", "count_tokens"):
        messages = params.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid_params("'messages' must be a non-empty array", param="messages")
        texts = [content_text(m.get("content")) for m in messages if isinstance(m, dict)]
        texts.append(content_text(params.get("system")))
        budget = (_budget(params, "max_completion_tokens", "max_tokens") if operation == "chat"
                  else _budget(params, "max_tokens"))
        if operation == "messages" and budget is None:
            raise invalid_params("'max_tokens' must be a positive integer", param="max_tokens")
        return Prompt(_last_user(messages), sum(map(count, texts)), budget)
    if operation == "responses":
        raw = params.get("input")
        if isinstance(raw, str) and raw:
            items: list[Any] = [{"role": "user", "content": raw}]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            raise invalid_params("'input' must be a non-empty string or array", param="input")
        texts = [content_text(i.get("content")) for i in items if isinstance(i, dict)]
        texts.append(content_text(params.get("instructions")))
        return Prompt(_last_user(items), sum(map(count, texts)), _budget(params, "max_output_tokens"))
    raw = params.get("prompt")  # completions
    if not isinstance(raw, str):
        raise invalid_params("'prompt' must be a string", param="prompt")
    return Prompt(raw, count(raw), _budget(params, "max_tokens"))


@dataclass(slots=True)
class Reply:
    """A generated answer: its pieces (a word each), whether the budget cut it, and its usage."""

    pieces: list[str]
    cut: bool
    prompt_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        return len(self.pieces)

    def openai_usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}

    def anthropic_usage(self) -> dict[str, int]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.tokens}


def _id(prefix: str) -> str:
    return f"{prefix}mock{uuid.uuid4().hex[:24]}"


class MockProvider(Provider):
    """Answers every call itself; a lane's batch waits ``latency_ms`` once, as a model's batch would."""

    Settings = MockSettings
    paths: ClassVar[dict[str, str]] = OPERATIONS

    def __init__(self, ctx: ProviderContext) -> None:
        super().__init__(ctx)
        self.settings: MockSettings = ctx.settings

    # -- admission -------------------------------------------------------------
    def prepare(self, route: RouteConfig, item: Item) -> None:
        if item.operation not in OPERATIONS:
            raise invalid_params(f"{self.name} (mock) has no operation {item.operation!r}",
                                 operations=sorted(OPERATIONS))
        params = item.params
        if not isinstance(params, dict):
            raise invalid_params("params must be an object (the API's request body)")
        if params.get("stream") and (stream_sink(item) is None or item.operation not in STREAMED):
            raise invalid_params("stream: true needs a streaming face (/v1/chat/completions, "
                                 "/v1/messages, ...); /rpc answers whole", param="stream")
        model = params.get("model")
        if model is not None and not isinstance(model, str):
            raise invalid_params("'model' must be a string", param="model")
        if item.operation == "embeddings":
            inputs = embedding_inputs(params)
            self._dimensions(params)
            if params.get("encoding_format", "float") not in ("float", "base64"):
                raise invalid_params("'encoding_format' must be 'float' or 'base64'",
                                     param="encoding_format")
            item.tokens = sum(count(v) if isinstance(v, str) else len(v) for v in inputs)
        else:
            asked = prompt_of(item.operation, params)
            item.tokens = asked.tokens + (asked.budget or 0)
        item.options["model"] = model or (route.models[0] if route.models else "mock")
        item.group = (item.operation,)

    def _dimensions(self, params: dict[str, Any]) -> int:
        value = params.get("dimensions")
        if value is None:
            return self.settings.dimensions
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 8192:
            raise invalid_params("'dimensions' must be an integer from 1 to 8192", param="dimensions")
        return value

    # -- answers -----------------------------------------------------------------
    def reply(self, prompt: Prompt) -> Reply:
        text = self.settings.response
        if text is None:
            text = f"This is a mock response to: {prompt.last}" if prompt.last else "This is a mock response."
        pieces = words(text) if text else []
        cut = prompt.budget is not None and len(pieces) > prompt.budget
        return Reply(pieces[:prompt.budget] if cut else pieces, cut, prompt.tokens)

    async def _wait(self) -> None:
        if self.settings.latency_ms:
            clock = self.ctx.clock
            await clock.sleep_until(clock.now() + self.settings.latency_ms / 1000)

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        await self._wait()
        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        return [self._one(operation, item) for item in items]

    def _one(self, operation: str, item: Item) -> Outcome:
        model: str = item.options["model"]
        try:
            if operation == "embeddings":
                return self._charged(item, self.embeddings(item.params, model))
            prompt = prompt_of(operation, item.params)
            if operation == "count_tokens":
                return Outcome(result={"input_tokens": prompt.tokens})
            reply = self.reply(prompt)
            self._correct(item, reply.prompt_tokens + reply.tokens)
            return Outcome(result=WHOLE[operation](self, reply, model))
        except RpcError as e:
            return Outcome.fail(e)

    def _charged(self, item: Item, body: dict[str, Any]) -> Outcome:
        self._correct(item, body["usage"]["total_tokens"])
        return Outcome(result=body)

    def _correct(self, item: Item, actual: int) -> None:
        if item.tokens:
            self.ctx.limiter.correct_tokens(item.tokens, actual)

    def _created(self) -> int:
        return int(self.ctx.clock.wall())

    def embeddings(self, params: dict[str, Any], model: str) -> dict[str, Any]:
        inputs = embedding_inputs(params)
        dimensions = self._dimensions(params)
        encoding = params.get("encoding_format", "float")
        data = [{"object": "embedding", "index": i,
                 "embedding": encoded(unit_vector(v if isinstance(v, str) else repr(v), dimensions),
                                      encoding)}
                for i, v in enumerate(inputs)]
        tokens = sum(count(v) if isinstance(v, str) else len(v) for v in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def chat(self, reply: Reply, model: str) -> dict[str, Any]:
        return {"id": _id("chatcmpl-"), "object": "chat.completion", "created": self._created(),
                "model": model, "system_fingerprint": FINGERPRINT,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text,
                                                     "refusal": None},
                             "logprobs": None, "finish_reason": "length" if reply.cut else "stop"}],
                "usage": reply.openai_usage()}

    def completion(self, reply: Reply, model: str) -> dict[str, Any]:
        return {"id": _id("cmpl-"), "object": "text_completion", "created": self._created(),
                "model": model, "system_fingerprint": FINGERPRINT,
                "choices": [{"index": 0, "text": reply.text, "logprobs": None,
                             "finish_reason": "length" if reply.cut else "stop"}],
                "usage": reply.openai_usage()}

    def message(self, reply: Reply, model: str) -> dict[str, Any]:
        return {"id": _id("msg_"), "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": reply.text}],
                "stop_reason": "max_tokens" if reply.cut else "end_turn", "stop_sequence": None,
                "usage": reply.anthropic_usage()}

    def response(self, reply: Reply, model: str) -> dict[str, Any]:
        return response_object(_id("resp_"), _id("msg_"), self._created(), model,
                               "incomplete" if reply.cut else "completed", reply.text,
                               reply.openai_usage())

    # -- streams (the ``Streamer`` capability) ------------------------------------------
    async def stream(self, item: Item, sink: ChunkSink) -> Outcome:
        """The reply a word per chunk, in the events the real API streams; the usage it returns
        corrects the call's token charge."""
        if item.operation not in STREAMED:
            return Outcome.fail(invalid_params(f"{item.operation} does not stream", param="stream"))
        try:
            reply = self.reply(prompt_of(item.operation, item.params))
        except RpcError as e:
            return Outcome.fail(e)
        await self._wait()
        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        events = STREAMS[item.operation](self, reply, item.options["model"], item.params)
        try:
            async for event in events:
                await sink.send(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return Outcome.fail(cancelled("the client stopped reading the stream"))
        self._correct(item, reply.prompt_tokens + reply.tokens)
        return Outcome(result={"usage": reply.openai_usage() if item.operation != "messages"
                               else reply.anthropic_usage()})

    @staticmethod
    def _usage_asked(params: dict[str, Any]) -> bool:
        options = params.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    async def chat_chunks(self, reply: Reply, model: str, params: dict[str, Any]) -> AsyncIterator[Any]:
        """``chat.completion.chunk``s: the role, a word each, the finish reason, then the usage
        chunk when ``stream_options.include_usage`` asks for it (the face adds ``[DONE]``)."""
        head = {"id": _id("chatcmpl-"), "object": "chat.completion.chunk", "created": self._created(),
                "model": model, "system_fingerprint": FINGERPRINT}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        for piece in reply.pieces:
            yield chunk({"content": piece})
        yield chunk({}, "length" if reply.cut else "stop")
        if self._usage_asked(params):
            yield {**head, "choices": [], "usage": reply.openai_usage()}

    async def completion_chunks(self, reply: Reply, model: str,
                                params: dict[str, Any]) -> AsyncIterator[Any]:
        """``text_completion`` chunks: a word each, the finish reason, the usage when asked."""
        head = {"id": _id("cmpl-"), "object": "text_completion", "created": self._created(),
                "model": model, "system_fingerprint": FINGERPRINT}

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish}]}

        for piece in reply.pieces:
            yield chunk(piece)
        yield chunk("", "length" if reply.cut else "stop")
        if self._usage_asked(params):
            yield {**head, "choices": [], "usage": reply.openai_usage()}

    async def response_events(self, reply: Reply, model: str,
                              params: dict[str, Any]) -> AsyncIterator[Any]:
        """The Responses API's events: opened, a delta per word, closed with the usage."""
        events = ResponseEvents(_id("resp_"), _id("msg_"), self._created(), model)
        for event in events.opening():
            yield event
        for piece in reply.pieces:
            yield events.delta(piece)
        for event in events.closing("incomplete" if reply.cut else "completed", reply.text,
                                    reply.openai_usage()):
            yield event

    async def message_events(self, reply: Reply, model: str,
                             params: dict[str, Any]) -> AsyncIterator[Any]:
        """Anthropic's named events (the chunk's ``type`` is its name): a ``text_delta`` per word."""
        start = {**self.message(Reply([], False, reply.prompt_tokens), model), "content": [],
                 "stop_reason": None}
        start["usage"]["output_tokens"] = 1
        yield {"type": "message_start", "message": start}
        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield {"type": "ping"}
        for piece in reply.pieces:
            yield {"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": piece}}
        yield {"type": "content_block_stop", "index": 0}
        yield {"type": "message_delta",
               "delta": {"stop_reason": "max_tokens" if reply.cut else "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": reply.tokens}}
        yield {"type": "message_stop"}


WHOLE = {"chat": MockProvider.chat, "completions": MockProvider.completion,
         "messages": MockProvider.message, "responses": MockProvider.response}
STREAMS = {"chat": MockProvider.chat_chunks, "completions": MockProvider.completion_chunks,
           "messages": MockProvider.message_events, "responses": MockProvider.response_events}
