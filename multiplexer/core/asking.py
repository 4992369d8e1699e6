"""A question an upstream puts to the client whose call it is running, and the way back to it.

An MCP upstream may ask, in the middle of a ``tools/call``, for something only the
caller has: a user's answer (``elicitation/create``), a model's reply
(``sampling/createMessage``), the client's roots (``roots/list``). The question
travels back along the call's own correlation: the upstream request the provider
sent for this item, the item, and the ``Asker`` its face put on the call, which
knows the one client session that made it. A relay is a return path, not a
channel of its own.

Messages are plain JSON here (the method and its params, the result), so the core
knows no SDK and either end may speak any protocol revision.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from multiplexer.core.call import Item

__all__ = ["ASK_OPTION", "PAUSED", "Asker", "ClientGone", "carry"]

ASK_OPTION = "ask"  # an item's ``options`` key for its ``Asker`` (set from ``Call.ask``)
# An item's ``options`` key: the seconds its call's deadline has moved for its client's questions
# (while one is out, the most the asking may take); its callers' tickets follow it.
PAUSED = "ask_paused_s"


class ClientGone(Exception):
    """The client that was asked is no longer there (it disconnected mid-question): the call
    it made ends, upstream too."""


@runtime_checkable
class Asker(Protocol):
    """The face's side of a relay: how to put one question to the client that made the call."""

    # A 2026-07-28 client: an upstream's ``input_required`` result goes back to it as its own,
    # and its retry (``inputResponses`` with ``requestState``) resumes the call upstream.
    passthrough: bool
    # The longest the call may spend waiting for this client's answers, in all: its deadline
    # pauses while it is asked, for at most this long.
    ask_timeout_s: float
    # A 2026-07-28 client's retry: ``inputResponses`` and ``requestState`` to send upstream
    # with the call (the answers to the ``input_required`` result it was handed); else None.
    resume: dict[str, Any] | None

    def refusal(self, method: str, params: dict[str, Any]) -> tuple[int, str, Any] | None:
        """Why this question cannot be put to this client (it did not declare the capability):
        the JSON-RPC error (code, message, data) the upstream is answered with; None: it can."""
        ...

    def answers_here(self, method: str, params: dict[str, Any]) -> bool:
        """Whether the gateway answers this question itself (sampling by one of its routes)."""
        ...

    async def ask(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """The answer (the result's JSON). Raises ``ClientGone`` when the client went away, or an
        ``RpcError`` that the upstream is answered with (the client's error, or a refusal)."""
        ...


def carry(item: Item, asker: Asker) -> None:
    """The item takes its caller's ``Asker``; its provider pauses the item's deadline (which the
    caller's ticket follows) while the client is asked."""
    item.options[ASK_OPTION] = asker
