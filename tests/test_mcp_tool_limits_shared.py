"""Per-tool limits shared as the provider's own limits are: two gateways on one Redis (``state.url``)
count a tool's rpm and concurrency together, and the workers of ``serve --workers N`` without
shared state each keep their part of each limit, never the whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import anyio
import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.core.limiter import RateLimiter
from multiplexer.core.metrics import Metrics
from multiplexer.core.policy import ProviderConfig
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.gateway.replicas import limiter_for
from tests.mcp_helpers import call, wait_until
from tests.pin_helpers import HELD, config_data, upstream_url
from tests.redis_helpers import prefix, redis_url

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def two_replicas(tmp_path: Path, url: str, route_limits: dict[str, Any] | None = None,
                       **provider: Any) -> AsyncIterator[list[Gateway]]:
    state = {"url": redis_url(), "prefix": prefix()}
    async with AsyncExitStack() as stack:
        gateways = []
        for n in range(2):
            data = config_data(url, tmp_path / str(n), **provider)
            (tmp_path / str(n)).mkdir()
            data["state"] = state
            if route_limits is not None:
                data["routes"]["rug_*"]["tool_limits"] = route_limits
            gateways.append(await stack.enter_async_context(Gateway(parse_config(data))))
        yield gateways


async def test_a_tools_rpm_is_counted_across_replicas(tmp_path: Path) -> None:
    async with upstream_url() as url, two_replicas(tmp_path, url, tool_limits={"look*": {"rpm": 3}}) as gws:
        outcomes = [await call(gws[i % 2], "rug_lookup", {"word": str(i)}) for i in range(6)]
        assert sum(o.ok for o in outcomes) == 3  # not 3 on each
        assert [o.ok for o in outcomes[:3]] == [True, True, True]
        refused = outcomes[3].error
        assert refused.code == Code.RATE_LIMITED and refused.data["limit"] == "tool_rpm"
        assert refused.data["tool"] == "lookup" and refused.data["rule"] == "look*"
        assert 0 < refused.data["retry_after"] <= 20
        assert (await call(gws[1], "rug_unrug", {})).ok  # another tool: not held back


async def test_a_routes_tool_concurrency_is_one_slot_across_replicas(tmp_path: Path) -> None:
    async with upstream_url() as url, two_replicas(tmp_path, url, {"hold": {"concurrency": 1}}) as gws:
        first: list[Any] = []
        async with anyio.create_task_group() as tg:
            async def hold() -> None:
                first.append(await call(gws[0], "rug_hold", {}))

            async def running() -> bool:
                return bool(HELD["running"] == 1)

            tg.start_soon(hold)
            await wait_until(running)
            refused = await call(gws[1], "rug_hold", {})  # the other replica: the one slot is taken
            assert refused.error.code == Code.RATE_LIMITED
            assert refused.error.data["limit"] == "tool_concurrency"
            HELD["go"].set()
        assert first[0].ok

        async def freed() -> bool:
            got = await call(gws[1], "rug_hold", {})
            return bool(got.ok)

        await wait_until(freed)  # the slot is freed off the caller's path, then served elsewhere


@pytest.mark.parametrize(("share", "slots"), [(1, 4), (2, 4), (3, 3)])
async def test_workers_without_shared_state_keep_their_part_of_a_tools_limits(share: int,
                                                                              slots: int) -> None:
    clock = ManualClock()
    pconf = ProviderConfig.model_validate({"kind": "echo"})
    workers = [limiter_for("p", pconf, clock, None, Metrics(), share) for _ in range(share)]
    assert all(isinstance(w, RateLimiter) for w in workers)

    def glob(g: str, n: str) -> bool:
        return fnmatchcase(n, g)

    # concurrency 4: each worker its part (at least one slot), never more than 4 in all
    capped = [w.named("provider", [("t*", None, 4)], glob) for w in workers]
    assert sum(t.take("tool")[0] is not None for _ in range(8) for t in capped) == slots
    # rpm 6: 6 / share each, exactly 6 across the workers until the buckets refill
    rpm = [w.named("provider", [("t*", 6.0, 0)], glob) for w in workers]
    assert sum(t.take("tool")[0] is not None for _ in range(12) for t in rpm) == 6
    await clock.advance(60)
    assert sum(t.take("tool")[0] is not None for _ in range(12) for t in rpm) == 6


class _Down:
    """A shared state that never answers, seen by two live replicas at the last heartbeat."""

    replica_id = "r1"
    lease_s = 30.0
    timeout_s = 0.1

    def live_replicas(self) -> int:
        return 2

    async def acquire_many(self, *args: Any) -> Any:
        from multiplexer.core.state import StateUnavailable

        raise StateUnavailable("down")


async def test_redis_unreachable_each_replica_keeps_its_share_of_a_tools_limits() -> None:
    from multiplexer.core.shared_limiter import SharedLimiter
    from multiplexer.core.state import LimitSpec

    degraded: list[str] = []
    limiter = SharedLimiter(ManualClock(), "p", LimitSpec(), _Down(),  # type: ignore[arg-type]
                            on_degraded=degraded.append)
    tools = limiter.named("provider", [("t*", 4.0, 0)], lambda g, n: fnmatchcase(n, g))
    got = [await tools.acquire("tool") for _ in range(3)]
    assert [limit is not None for limit, _, _ in got] == [True, True, False]  # 4 over 2 replicas
    assert got[2][1] == "rpm" and degraded == ["limits"] * 3
    assert await tools.acquire("other") == (None, None, 0.0)  # no glob matches: not limited
