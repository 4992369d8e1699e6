"""A deadline spent waiting for a limit names the limit (``stage: rate_limit``), not the upstream."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from multiplexer.core.call import Call, Outcome
from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.core.state import Granted
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from tests.test_gateway import Gate

pytestmark = pytest.mark.anyio


def config(limits: dict[str, Any], batch: dict[str, Any] | None = None,
           state: dict[str, Any] | None = None) -> Any:
    return parse_config({
        "providers": {"p": {"kind": "echo", "batch": batch or {"max_items": 1}, "limits": limits}},
        "routes": {"r": {"provider": "p"}},
        **({"state": state} if state else {}),
    })


async def two_calls(gw: Gateway, clock: ManualClock, second: dict[str, Any],
                    timeout_ms: float = 500) -> dict[str, Outcome]:
    """A first call that goes upstream (and waits there, at the gate) and a second one after it;
    the clock runs to the second's deadline and on to the first's (1 s)."""
    out: dict[str, Outcome] = {}

    async def call(name: str, params: dict[str, Any], timeout: float) -> None:
        out[name] = await gw.submit(Call("r", params, timeout_ms=timeout))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first", {"n": 1}, 1000)
        await clock.advance(0)
        tg.start_soon(call, "second", second, timeout_ms)
        await clock.advance(0)
        await clock.advance(timeout_ms / 1000)
        await clock.advance(1)
    return out


async def test_a_call_waiting_for_a_concurrency_slot_names_it_and_the_one_upstream_says_running() -> None:
    clock, prov = ManualClock(), Gate()
    async with Gateway(config({"concurrency": 1}), clock=clock, providers={"p": prov}) as gw:
        out = await two_calls(gw, clock, {"n": 2})
    assert out["second"].error is not None and out["second"].error.code == Code.TIMEOUT
    assert out["second"].error.data == {"stage": "rate_limit", "limit": "concurrency", "provider": "p"}
    assert out["first"].error is not None and out["first"].error.data == {"stage": "running"}
    assert prov.runs == ["r"]  # the second never went upstream


async def test_a_call_waiting_for_an_rpm_token_names_rpm() -> None:
    clock, prov = ManualClock(), Gate()
    async with Gateway(config({"rpm": 1}), clock=clock, providers={"p": prov}) as gw:
        out = await two_calls(gw, clock, {"n": 2})
    assert out["second"].error is not None
    assert out["second"].error.data == {"stage": "rate_limit", "limit": "rpm", "provider": "p"}
    assert prov.runs == ["r"]


async def test_a_call_waiting_for_tokens_names_tpm() -> None:
    clock, prov = ManualClock(), Gate()
    prov.prepare = lambda route, item: setattr(item, "tokens", 60)  # type: ignore[method-assign]
    async with Gateway(config({"tpm": 100}), clock=clock, providers={"p": prov}) as gw:
        out = await two_calls(gw, clock, {"n": 2})
    assert out["second"].error is not None
    assert out["second"].error.data == {"stage": "rate_limit", "limit": "tpm", "provider": "p"}


async def to_its_deadline(gw: Gateway, clock: ManualClock, timeout_ms: float) -> Outcome:
    """One call, the clock run to its deadline."""
    out: list[Outcome] = []

    async def call() -> None:
        out.append(await gw.submit(Call("r", {}, timeout_ms=timeout_ms)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await clock.advance(0)
        await clock.advance(timeout_ms / 1000)
    return out[0]


async def test_a_call_held_only_by_its_batch_forming_stays_queued() -> None:
    clock, prov = ManualClock(), Gate()
    batch = {"max_items": 10, "max_wait_ms": 5000, "eager": False}
    async with Gateway(config({}, batch), clock=clock, providers={"p": prov}) as gw:
        out = await to_its_deadline(gw, clock, 100)
    assert out.error is not None and out.error.data == {"stage": "queued"}


class Busy:
    """Shared state whose every limit is spent: each acquire says wait a minute for rpm."""

    replica_id = "busy"
    lease_s = 30.0
    timeout_s = 0.5

    def __init__(self) -> None:
        self.asked = 0

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def heartbeat_forever(self) -> None:
        await anyio.sleep(math.inf)

    def live_replicas(self) -> int:
        return 1

    async def acquire_many(self, *args: object) -> Granted:
        self.asked += 1
        return Granted(0, 60.0, "rpm")

    async def settle(self, *args: Sequence[object]) -> None: ...


async def test_a_call_waiting_for_a_shared_limit_names_it_though_its_batch_was_taken() -> None:
    clock, prov = ManualClock(), Gate()
    gw = Gateway(config({"rpm": 10}, state={"url": "redis://127.0.0.1:1/0"}), clock=clock,
                 providers={"p": prov})
    busy = gw.state = Busy()  # type: ignore[assignment]
    async with gw:
        out = await to_its_deadline(gw, clock, 500)
    assert busy.asked == 1 and prov.runs == []
    assert out.error is not None
    assert out.error.data == {"stage": "rate_limit", "limit": "rpm", "provider": "p"}
