"""The token budget after out-of-memory: halve at once, win it back slowly.

An OOM halves the budget below the batch that failed (the pool forms smaller
batches at once). Memory pressure is often passing (another process, a
fragmented cache), so a budget that stays lowered forever wastes the device:
after ``recover_after`` clean passes that used at least half of the budget it
grows by ``step``, up to just under the smallest size that failed. A further
clean streak at that cap forgets the failure and probes up to the configured
budget; a new OOM starts over. A pure state machine: the pool holds the lock.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_BUDGET = 64


@dataclass(slots=True)
class BudgetControl:
    configured: int
    current: int
    recover_after: int = 32
    step: float = 1.25
    ceiling: int | None = None  # the smallest padded cost that did not fit
    clean: int = 0

    def failed(self, cost: int) -> int | None:
        """A pass of ``cost`` padded tokens ran out of memory; the lowered budget, if it changed."""
        self.ceiling = cost if self.ceiling is None else min(self.ceiling, cost)
        self.clean = 0
        lowered = max(MIN_BUDGET, cost // 2)
        if lowered >= self.current:
            return None
        self.current = lowered
        return lowered

    def passed(self, cost: int) -> int | None:
        """A pass of ``cost`` padded tokens fitted; the raised budget, if it changed."""
        if self.current >= self.configured or 2 * cost < self.current:
            return None  # nothing to win back, or no evidence about the current budget
        self.clean += 1
        if self.clean < self.recover_after:
            return None
        self.clean = 0
        cap = self.configured
        if self.ceiling is not None:
            if self.current >= self.ceiling - 1:
                self.ceiling = None  # a clean streak right under the failure: probe past it next
                return None
            cap = min(cap, self.ceiling - 1)
        raised = min(cap, max(self.current + 1, int(self.current * self.step)))
        if raised <= self.current:
            return None
        self.current = raised
        return raised
