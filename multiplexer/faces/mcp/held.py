"""A 2026-07-28 client's call held open across ``input_required`` rounds.

A handshake-era upstream asks mid-call, with a request pushed on its connection;
a 2026-07-28 client takes questions only as an ``input_required`` result of its
call, and answers by calling again with ``inputResponses`` and the
``requestState`` it was handed. So for such a call the gateway runs the upstream
call in a task of the MCP face, answers the client's request with the question
the moment one is asked, and keeps the call (its lane slot, its quota, its
upstream request) open until the client's retry brings the answer: that retry
resumes the same upstream call, and is answered with its result or its next
question. ``requestState`` names the held call (``mux-held:`` and a random
token, bound to the caller's identity); a retry with an unknown one (the call
ended, its questions timed out, or another replica holds it) is refused, unless
the replicas share ``state.url``: then the replica holding it resumes it
(``replica_sessions.py``).

A client that never comes back leaves its question unanswered: the upstream is
answered with a timeout after ``server.mcp.ask_timeout_s`` and the call ends.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import mcp_types as types
from mcp import MCPError

from multiplexer.core.call import Outcome

__all__ = ["PREFIX", "Held", "Holds"]

PREFIX = "mux-held:"
Spawn = Callable[..., Any]
# A retry for a call another replica holds: (requestState, identity, inputResponses, the refusal if
# no replica does) -> what the holder's ``Held.next`` returned (``replica_sessions.py``).
Elsewhere = Callable[[str, str | None, dict[str, Any], MCPError],
                     Awaitable["Outcome | types.InputRequiredResult"]]


class Held:
    """One held call: its questions not yet answered, and its outcome once it has one."""

    def __init__(self, token: str, identity: str | None) -> None:
        self.token = token
        self.identity = identity
        self.outcome: Outcome | None = None
        self._asked: dict[str, tuple[str, dict[str, Any]]] = {}  # key -> the question, not yet sent
        self._waiting: dict[str, tuple[anyio.Event, list[dict[str, Any]]]] = {}  # key -> its answer slot
        self._changed = anyio.Event()
        self.collected = anyio.Event()  # the client has its outcome
        self.scope = anyio.CancelScope()  # the call's task: cancelled when its client abandons it
        self._n = 0

    async def ask(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A question from the upstream: handed to the client at its next request; its answer."""
        self._n += 1
        key = f"q{self._n}"
        done, slot = anyio.Event(), cast("list[dict[str, Any]]", [])
        self._asked[key] = (method, params)
        self._waiting[key] = (done, slot)
        self._changed.set()
        try:
            await done.wait()
        finally:
            self._asked.pop(key, None)
            self._waiting.pop(key, None)
        return slot[0]

    def answer(self, responses: dict[str, Any]) -> None:
        for key, response in responses.items():
            waiting = self._waiting.get(key)
            if waiting is not None and isinstance(response, dict):
                waiting[1].append(response)
                waiting[0].set()

    def finish(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._changed.set()

    async def next(self) -> Outcome | types.InputRequiredResult:
        """The call's outcome, or the questions asked since the client last heard from it."""
        while True:
            if self.outcome is not None:
                return self.outcome
            if self._asked:
                requests = {key: {"method": method, "params": params}
                            for key, (method, params) in self._asked.items()}
                self._asked.clear()
                return types.InputRequiredResult.model_validate(
                    {"resultType": "input_required", "inputRequests": requests,
                     "requestState": PREFIX + self.token})
            self._changed = anyio.Event()
            await self._changed.wait()


class Holds:
    """The calls this face holds for their clients' answers, by token."""

    def __init__(self, collect_s: float) -> None:
        self.collect_s = collect_s  # how long a finished call waits for its client to collect it
        self.spawn: Spawn | None = None  # the face's task group (``McpFace.running``)
        self.elsewhere: Elsewhere | None = None  # with state.url: resumed on the replica holding it
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def resuming(self, state: str | None, identity: str | None) -> Held | None:
        """The held call a retry's ``requestState`` names; None: not a held call's state."""
        if not state or not state.startswith(PREFIX):
            return None
        held = self._held.get(state[len(PREFIX):])
        if held is None or held.identity != identity:
            raise MCPError(types.INVALID_PARAMS, "requestState names no call held here: it ended, its "
                           "question timed out, or another gateway replica holds it", {"requestState": state})
        return held

    def start(self, identity: str | None, submit: Callable[[], Awaitable[Outcome]]) -> Held | None:
        """A call run in the face's task group, held for its client; None: nowhere to hold it."""
        if self.spawn is None:
            return None
        held = Held(secrets.token_urlsafe(18), identity)
        self._held[held.token] = held
        self.spawn(self._run, held, submit)
        return held

    async def _run(self, held: Held, submit: Callable[[], Awaitable[Outcome]]) -> None:
        try:
            with held.scope:
                held.finish(await submit())
            if held.outcome is None:
                return  # cancelled: its client abandoned the call
            with anyio.move_on_after(self.collect_s):  # its client may still come for it
                await held.collected.wait()
        finally:
            self._held.pop(held.token, None)
