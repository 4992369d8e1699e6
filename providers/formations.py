"""Batch formation for remote providers: pack what one request can carry, send the rest singly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from multiplexer.core.batching import CountFormation, Decision, Pending

_SINGLE = CountFormation(max_items=1, max_wait=0.0)


@dataclass(frozen=True, slots=True)
class PackOrSingle:
    """Operations in ``packable`` (embeddings) and batch-mode items use the lane's policy;
    others (chat, messages) leave one by one at once, so each is its own request and the
    lane's concurrency and rate limits count every one of them."""

    policy: CountFormation
    packable: frozenset[str]

    def decide(self, pending: Sequence[Pending], now: float) -> Decision:
        if not pending:
            return Decision()
        first = pending[0].item
        if first.operation in self.packable or first.options.get("mode") == "batch":
            return self.policy.decide(pending, now)
        return _SINGLE.decide(pending, now)
