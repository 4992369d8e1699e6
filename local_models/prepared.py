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
    ``ids`` is set through ``tokenized``, which keeps ``dims`` true to it.
    """

    model: str
    texts: list[str]
    truncate: bool
    ids: list[list[int]] | None = None
    estimate: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    _dims: tuple[int, int, int] | None = field(default=None, init=False, repr=False)

    def tokenized(self, ids: list[list[int]]) -> None:
        self.ids, self._dims = ids, None

    @property
    def dims(self) -> tuple[int, int, int]:
        """(rows, longest, real tokens), counted once: the formation reads them for every queued
        call each time it forms a batch."""
        dims = self._dims
        if dims is None:
            ids = self.ids
            if ids:
                dims = (len(self.texts), max(map(len, ids)), sum(map(len, ids)))
            else:
                dims = (len(self.texts), self.estimate, self.estimate * len(self.texts))
            self._dims = dims
        return dims

    @property
    def rows(self) -> int:
        return len(self.texts)

    @property
    def longest(self) -> int:
        return self.dims[1]

    @property
    def real(self) -> int:
        return self.dims[2]


def prepared_of(item: Item) -> Prepared | None:
    p = item.options.get(KEY)
    return p if isinstance(p, Prepared) else None


def shape(item: Item) -> tuple[int, int, int]:
    """(rows, longest, real tokens) of an item; a plain item is one row of ``item.tokens``."""
    p = prepared_of(item)
    if p is None:
        return 1, max(item.tokens, 1), max(item.tokens, 1)
    return p.dims
