"""Running a batch job through the synchronous endpoint, for deployments without a batch API.

vLLM, Ollama and many OpenAI-compatible servers have no ``/v1/batches``; the
same job then goes out one request at a time, at most ``concurrency`` at once
and only when the lane's limiter allows, so a big job never starves or
overruns the provider's interactive traffic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from multiplexer.core.call import Item, Outcome
from multiplexer.core.clock import Clock
from multiplexer.core.limiter import Limiter, Upstream, charging

RunOne = Callable[[Item], Awaitable[Outcome]]
OnResult = Callable[[int, Outcome], Awaitable[None]]


class SyncFallback:
    def __init__(self, run_one: RunOne, limiter: Limiter, clock: Clock, concurrency: int) -> None:
        self.run_one = run_one
        self.limiter = limiter
        self.clock = clock
        self.concurrency = max(1, concurrency)

    async def run(self, items: Sequence[tuple[int, Item]], on_result: OnResult) -> None:
        """Run every item once; ``on_result`` gets each outcome as soon as it is known."""
        pending = iter(items)

        async def worker() -> None:
            for idx, item in pending:  # workers share one iterator: each item runs once
                # no lane batch charged it: each of its requests is charged as it goes
                with charging(Upstream(self.limiter, [item], paid=False, tokens=item.tokens)):
                    outcome = await self.run_one(item)
                await on_result(idx, outcome)

        async with anyio.create_task_group() as tg:
            for _ in range(min(self.concurrency, len(items))):
                tg.start_soon(worker)
