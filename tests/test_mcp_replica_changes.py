"""List changes heard by every replica's listeners once (``faces/mcp/changes.py``): a change only one
replica hears reaches a 2026-07-28 ``subscriptions/listen`` stream held by another (two gateways on
one Redis), and the same change heard by both reaches it once (whichever replica heard it first:
the unit test below takes both orders on one replica's clock)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from multiplexer.faces.mcp.changes import WINDOW_S, ListChanges, change_id
from multiplexer.faces.mcp.server import McpFace
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.mcp_helpers import mcp_http_client, wait_until
from tests.redis_helpers import prefix, redis_url
from tests.test_mcp_replicas import together

pytestmark = pytest.mark.anyio

KEY = "key-a-" + "x" * 20


def config(state_prefix: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0, "api_keys": {"alice": KEY}},
        "state": {"url": redis_url(), "prefix": state_prefix},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}},
    }


def change(n: int) -> dict[str, Any]:
    return {"provider": "up", "tools": ["lookup"], "digest": str(n)}


async def test_a_change_one_replica_hears_reaches_a_listener_on_another_once() -> None:
    pre = prefix()
    async with together([running(parse_config(config(pre))) for _ in range(2)]) as replicas:
        (a, _), (b, b_url) = replicas
        face = b.faces["mcp"]
        assert isinstance(face, McpFace)
        async with mcp_http_client(b_url + "/mcp", "auto", key=KEY) as client:
            assert client.protocol_version == "2026-07-28"
            async with client.listen(tools_list_changed=True) as events:
                async def subscribed() -> bool:
                    return bool(face.bus._listeners)

                await wait_until(subscribed)
                heard = aiter(events)

                async def next_event() -> None:
                    with anyio.fail_after(5):
                        await anext(heard)

                a.notify("tools_changed", change(1))  # only a hears it
                await next_event()
                a.notify("tools_changed", change(2))  # a hears it first, then b does too
                await next_event()
                b.notify("tools_changed", change(2))
                assert face.changes.dropped == 1  # b's own copy of 2: its listener had it
                a.notify("tools_changed", change(3))
                await next_event()
                b.notify("tools_changed", change(4))  # b's own: its listener has it at once
                await next_event()
                assert face.changes.dropped == 1


def test_one_change_passes_once_whichever_replica_hears_it_first() -> None:
    now = [0.0]
    here = ListChanges(lambda: now[0])
    shared: list[tuple[str, str]] = []
    here.share = lambda event, cid: shared.append((event, cid))
    first = change_id("tools_changed", change(1))
    assert here.heard_here("tools_changed", change(1))  # heard here: passed on to the others
    assert shared == [("tools_changed", first)]
    assert not here.heard_there(first)  # another replica's copy of it
    assert here.heard_there(change_id("tools_changed", change(2)))
    assert not here.heard_here("tools_changed", change(2))  # the other's came first
    assert here.heard_here("tools_changed", change(1))  # heard here again: a change of its own
    now[0] += WINDOW_S
    assert here.heard_there(change_id("tools_changed", change(2)))  # later: a change again
    assert here.dropped == 2
    assert change_id("tools_changed", change(1)) != change_id("tools_changed", change(3))
