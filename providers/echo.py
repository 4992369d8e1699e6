"""A built-in provider that answers locally: for demos, smoke tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import invalid_params
from multiplexer.core.provider import Provider


class EchoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EchoProvider(Provider):
    """``echo`` returns its params; ``sum`` adds a list of numbers."""

    Settings = EchoSettings

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        self.ctx.metrics.upstream_requests.labels(self.name).inc()
        return [self._one(item) for item in items]

    def _one(self, item: Item) -> Outcome:
        if item.method == "sum":
            values = item.params.get("values") if isinstance(item.params, dict) else item.params
            if not isinstance(values, list) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in values
            ):
                return Outcome.fail(invalid_params("sum takes a list of numbers"))
            return Outcome(result=sum(values))
        return Outcome(result=item.params)
