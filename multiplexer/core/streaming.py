"""Streamed calls in a lane's batch: each runs through the provider's ``stream``, the rest
through ``execute``, and every item still gets exactly one outcome, in order."""

from __future__ import annotations

from collections.abc import Sequence

from multiplexer.core.call import Item, Outcome
from multiplexer.core.gather import gather
from multiplexer.core.lane import Execute
from multiplexer.core.provider import Provider, Streamer, stream_sink


def with_streams(provider: Provider) -> Execute:
    """The lane's execute for a provider that can stream (its own ``execute`` otherwise)."""
    if not isinstance(provider, Streamer):
        return provider.execute
    streamer = provider

    async def execute(operation: str, items: Sequence[Item]) -> list[Outcome]:
        sinks = [stream_sink(item) for item in items]
        if not any(sinks):
            return await provider.execute(operation, items)
        plain = [i for i, s in enumerate(sinks) if s is None]
        out: list[Outcome | None] = [None] * len(items)
        if plain:
            done = await provider.execute(operation, [items[i] for i in plain])
            for i, o in zip(plain, done, strict=True):
                out[i] = o

        async def one(i: int) -> Outcome:
            sink = sinks[i]
            assert sink is not None
            with sink:  # the reader sees the end of the stream when the call's stream ends
                return await streamer.stream(items[i], sink)

        streamed = [i for i, s in enumerate(sinks) if s is not None]
        for i, o in zip(streamed, await gather(one, streamed), strict=True):
            out[i] = o
        return out  # type: ignore[return-value]

    return execute
