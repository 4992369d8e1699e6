"""Machinery shared by the provider fakes: fault injection, a fixed-window limiter, request counters.

Each fake supplies a `Dialect` (how its errors, auth and rate-limit headers look); everything
else, including the order in which faults are applied, is the same for both so tests can rely
on one mental model.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class ApiError(Exception):
    """Raised by handlers; the dialect renders it as the provider's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}


@dataclass
class Limiter:
    """Fixed-window request/token limiter.

    Off by default (`enforce=False`): headers are still sent so clients can parse them, but only
    tests that opt in see 429s. Rejected requests do not consume the window.
    """

    requests_per_window: int = 10_000
    tokens_per_window: int = 2_000_000
    window_s: float = 60.0
    enforce: bool = False
    send_retry_after: bool = True
    window_start: float | None = None
    used_requests: int = 0
    used_input_tokens: int = 0
    used_output_tokens: int = 0

    def roll(self, now: float) -> None:
        if self.window_start is None or now >= self.window_start + self.window_s:
            self.window_start = now
            self.used_requests = self.used_input_tokens = self.used_output_tokens = 0

    def reset_in(self, now: float) -> float:
        self.roll(now)
        assert self.window_start is not None
        return max(0.0, self.window_start + self.window_s - now)

    def reset_at(self, now: float) -> float:
        return now + self.reset_in(now)

    @property
    def used_tokens(self) -> int:
        return self.used_input_tokens + self.used_output_tokens

    @property
    def remaining_requests(self) -> int:
        return max(0, self.requests_per_window - self.used_requests)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.tokens_per_window - self.used_tokens)

    def blocked_by(self, now: float) -> str | None:
        """Which limit ("requests" or "tokens") rejects a request now, if any."""
        self.roll(now)
        if not self.enforce:
            return None
        if self.used_requests >= self.requests_per_window:
            return "requests"
        if self.used_tokens >= self.tokens_per_window:
            return "tokens"
        return None

    def add_tokens(self, input_tokens: int, output_tokens: int = 0) -> None:
        self.used_input_tokens += input_tokens
        self.used_output_tokens += output_tokens


@dataclass
class FakeState:
    """What a test can tune and inspect; shared by both fakes.

    `fail_next` holds HTTP statuses returned, in order, by the next requests to any endpoint.
    `requests` counts every request received per route template (e.g. "/v1/embeddings"),
    including rejected ones; `statuses` counts the statuses answered.
    `retry_after_s` is the `retry-after` on injected 429s (None: omitted). `clock` (wall seconds)
    drives the limiter window and timestamps. Batches end on the `polls_to_complete`-th poll;
    items whose user text holds `fail_marker` or whose id is in `fail_custom_ids` fail.
    """

    fail_next: list[int] = field(default_factory=list)
    retry_after_s: float | None = 1.0
    requests: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    limiter: Limiter = field(default_factory=Limiter)
    clock: Callable[[], float] = time.time
    seed: int = 0
    polls_to_complete: int = 2
    fail_marker: str | None = "FAIL"
    fail_custom_ids: set[str] = field(default_factory=set)
    expire_after_items: int | None = None
    cancel_after_items: int = 0
    latency_s: float = 0.0  # model time added to every answer (benchmarks)
    strict_keys: bool = False  # refuse a body (or batch line) with a key its API lacks (strict.py)
    gate: anyio.Event | None = None  # every request waits here until it is set (tests)
    held: anyio.Event = field(default_factory=anyio.Event)  # set when a request waits at the gate
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    def marked_to_fail(self, text: str) -> bool:
        marker = self.fail_marker
        return marker is not None and marker != "" and marker in text

    def expired_cut(self, total: int) -> int:
        """How many items finish before a forced expiry (default: the first half)."""
        n = total // 2 if self.expire_after_items is None else self.expire_after_items
        return max(0, min(total, n))

    def rng(self, salt: str) -> random.Random:
        return random.Random(f"{self.seed}:{salt}")


@dataclass(frozen=True)
class Dialect:
    """How one provider spells auth failures, error bodies and rate-limit headers."""

    check_auth: Callable[[Request], ApiError | None]
    render_error: Callable[[ApiError], Response]
    limit_headers: Callable[[Limiter, float], dict[str, str]]
    request_id_header: str


def guarded_route(
    path: str, methods: Sequence[str], handler: Handler, state: FakeState, dialect: Dialect
) -> Route:
    """Wrap a handler in: count -> auth -> injected fault -> limiter -> handler -> headers."""

    async def endpoint(request: Request) -> Response:
        state.requests[path] += 1
        if state.latency_s:
            await anyio.sleep(state.latency_s)
        if state.gate is not None:
            state.held.set()
            await state.gate.wait()
        now = state.clock()
        try:
            response = await _answer(request, handler, state, dialect, now)
        except ApiError as exc:
            response = dialect.render_error(exc)
            response.headers.update(exc.headers)
        state.statuses[response.status_code] += 1
        response.headers.update(dialect.limit_headers(state.limiter, now))
        response.headers[dialect.request_id_header] = state.next_id("req_")
        return response

    return Route(path, endpoint, methods=list(methods))


async def _answer(
    request: Request, handler: Handler, state: FakeState, dialect: Dialect, now: float
) -> Response:
    if (auth_error := dialect.check_auth(request)) is not None:
        raise auth_error
    if state.fail_next:
        status = state.fail_next.pop(0)
        headers = {}
        if status == 429 and state.retry_after_s is not None:
            headers["retry-after"] = format_seconds(state.retry_after_s)
        raise ApiError(status, f"injected fault {status}", headers=headers)
    limiter = state.limiter
    if (which := limiter.blocked_by(now)) is not None:
        headers = {}
        if limiter.send_retry_after:
            headers["retry-after"] = str(max(1, math.ceil(limiter.reset_in(now))))
        raise ApiError(429, f"rate limit reached on {which}", which, headers=headers)
    limiter.used_requests += 1
    try:
        return await handler(request)
    except HTTPException as exc:  # e.g. a malformed multipart body
        raise ApiError(exc.status_code, str(exc.detail)) from exc


def not_found_handlers(dialect: Dialect) -> dict[Any, Any]:
    """Routing misses (404/405) answered in the provider's error format rather than plain text."""

    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return dialect.render_error(
            ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        )

    return {404: handle, 405: handle}


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def require(body: dict[str, Any], key: str, kind: type[T]) -> T:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(400, f"'{key}' is required and must be {kind.__name__}", param=key)
    return value


def word_count(text: str) -> int:
    """Token estimate: whitespace-separated words. Crude, but exact and easy to predict in tests."""
    return len(text.split())


def text_of(content: Any) -> str:
    """Plain text of a message `content`: a string, or a list of `{"type": "text", "text"}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return text_of(message.get("content"))
    return ""


def shuffled(items: list[T], rng: random.Random) -> list[T]:
    """Seeded shuffle that never returns input order (for 2+ items): callers must match by id."""
    out = list(items)
    rng.shuffle(out)
    if len(out) > 1 and out == items:
        out = out[1:] + out[:1]
    return out


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def format_seconds(seconds: float) -> str:
    return str(max(0, math.ceil(seconds)))


def format_duration(seconds: float) -> str:
    """OpenAI-style reset durations: `12ms`, `6s`, `1m30s`, `2h0m5.5s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    secs_text = f"{round(secs, 3):g}s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{secs_text}"
    if minutes:
        return f"{int(minutes)}m{secs_text}"
    return secs_text


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat().replace("+00:00", "Z")
