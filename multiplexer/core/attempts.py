"""One budget of upstream requests per call, over all its routes (``max_attempts``).

Retries and fallbacks compose instead of multiplying: the call's ``Budget`` rides on its
item (``options["budget"]``); a provider's retry loop asks ``tries`` how many requests it
may make now (its own policy, capped by what the call has left, less one request kept for
each route still to try) and spends one per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from multiplexer.core.call import Item
from multiplexer.core.limiter import current_items

BUDGET = "budget"  # the item option


class Budget:
    __slots__ = ("left", "reserve", "spent")

    def __init__(self, left: int) -> None:
        self.left = left  # upstream requests the call may still make
        self.reserve = 0  # of those, kept for the routes still to try
        self.spent = 0  # made so far (what the tests count)

    def tries(self, default: int) -> int:
        return max(1, min(default, self.left - self.reserve))

    def spend(self) -> None:
        self.left -= 1
        self.spent += 1


def budgets(items: Sequence[Item] | None = None) -> list[Budget]:
    """The budgets of the items being sent (the current lane batch's when ``items`` is None)."""
    out = []
    for item in current_items() if items is None else items:
        budget = item.options.get(BUDGET)
        if budget is not None:
            out.append(budget)
    return out


def tries(default: int, found: Sequence[Budget]) -> int:
    """Requests a retry loop may make for these budgets' items (``default``: its own policy)."""
    return min((b.tries(default) for b in found), default=default)


def spend(found: Sequence[Budget]) -> None:
    for b in found:
        b.spend()
