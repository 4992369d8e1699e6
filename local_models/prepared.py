"""What ``prepare`` learned about a call, carried on the item to the formation and the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from multiplexer.core.call import Item

KEY = "_local"


@dataclass(eq=False, slots=True)
class Prepared:
    """One call's inputs; ``ids`` is None until tokenised (the tokenizer may still be loading).

    Only ``prepare`` creates it, and the provider checks its type, so a value a
    client smuggles into ``item.options`` through ``_meta`` is never trusted.
    """

    model: str
    texts: list[str]
    truncate: bool
    ids: list[list[int]] | None = None
    estimate: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.texts)

    @property
    def longest(self) -> int:
        return max(map(len, self.ids)) if self.ids else self.estimate

    @property
    def real(self) -> int:
        return sum(map(len, self.ids)) if self.ids else self.estimate * len(self.texts)


def prepared_of(item: Item) -> Prepared | None:
    p = item.options.get(KEY)
    return p if isinstance(p, Prepared) else None


def shape(item: Item) -> tuple[int, int, int]:
    """(rows, longest, real tokens) of an item; a plain item is one row of ``item.tokens``."""
    p = prepared_of(item)
    if p is None:
        return 1, max(item.tokens, 1), max(item.tokens, 1)
    return p.rows, p.longest, p.real
