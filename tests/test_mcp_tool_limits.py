"""Per-tool limits (``tool_limits`` under an MCP provider or a route): rpm and concurrency refuse
the excess at once in the face's shape (-32003, ``tool_rpm`` / ``tool_concurrency``), a tool's
``timeout_ms`` ends its calls; other tools of the same upstream are not held back."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from multiplexer.core.clock import ManualClock
from multiplexer.core.errors import Code
from multiplexer.gateway.config import ConfigError, parse_config
from multiplexer.gateway.gateway import Gateway
from tests.mcp_helpers import call, wait_until
from tests.pin_helpers import HELD, config_data, upstream_url

pytestmark = pytest.mark.anyio


async def test_a_tools_rpm_refuses_the_excess_and_refills_on_the_clock(tmp_path: Path) -> None:
    async with upstream_url() as url:
        data = config_data(url, tmp_path, tool_limits={"look*": {"rpm": 2}})
        clock = ManualClock()
        async with Gateway(parse_config(data), clock=clock) as gw:
            outcomes = [await call(gw, "rug_lookup", {"word": str(i)}) for i in range(3)]
            assert [o.ok for o in outcomes] == [True, True, False]
            error = outcomes[2].error
            assert error.code == Code.RATE_LIMITED
            assert error.data["limit"] == "tool_rpm" and error.data["tool"] == "lookup"
            assert error.data["rule"] == "look*" and 29 <= error.data["retry_after"] <= 30
            # the exact route to the same tool shares the provider's share
            assert (await call(gw, "word", {"word": "y"})).error.code == Code.RATE_LIMITED
            assert (await call(gw, "rug_unrug", {})).ok  # another tool: not held back
            await clock.advance(30)
            assert (await call(gw, "rug_lookup", {"word": "z"})).ok


async def test_a_routes_concurrency_and_timeout(tmp_path: Path) -> None:
    async with upstream_url() as url:
        data = config_data(url, tmp_path)
        data["routes"]["rug_*"]["tool_limits"] = {"hold": {"concurrency": 1}}
        data["routes"]["slow"] = {"provider": "rug", "method": "hold",
                                  "tool_limits": {"ho*": {"timeout_ms": 50}}}
        async with Gateway(parse_config(data)) as gw:
            results: list[object] = []
            async with anyio.create_task_group() as tg:
                async def first() -> None:
                    results.append(await call(gw, "rug_hold", {}))

                async def holding() -> bool:
                    return bool(HELD["running"] == 1)

                tg.start_soon(first)
                await wait_until(holding)
                refused = await call(gw, "rug_hold", {})
                assert refused.error.code == Code.RATE_LIMITED
                assert refused.error.data["limit"] == "tool_concurrency"
                timed = await call(gw, "slow", {})  # its own route: not this route's share; 50 ms
                assert timed.error.code == Code.TIMEOUT, timed.error
                HELD["go"].set()
            assert results[0].ok  # type: ignore[attr-defined]
            assert (await call(gw, "rug_hold", {})).ok  # the slot came back


def test_bad_tool_limits_are_config_errors(tmp_path: Path) -> None:
    data = config_data("http://127.0.0.1:9/mcp", tmp_path, tool_limits={"x": {"rpm": 0}})
    with pytest.raises(ConfigError, match="rpm"):
        parse_config(data)
    data = config_data("http://127.0.0.1:9/mcp", tmp_path)
    data["routes"]["rug_*"]["tool_limits"] = {"x": {"burst": 1}}
    with pytest.raises(ConfigError, match="burst"):
        parse_config(data)
