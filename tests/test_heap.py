"""The serving gateway's heap is frozen: full collections walk only what came after start-up."""

from __future__ import annotations

import gc

import httpx
import pytest

from multiplexer.gateway.config import ConfigError, parse_config
from multiplexer.gateway.heap import SETTLED
from multiplexer.server import running

pytestmark = pytest.mark.anyio


def walked(marker: object) -> bool:
    """Whether the collector still walks ``marker`` (frozen objects are in no generation)."""
    return any(o is marker for o in gc.get_objects())


def _config(freeze: bool):  # type: ignore[no-untyped-def]
    return parse_config({"server": {"freeze_heap": freeze},
                         "providers": {"builtin": {"kind": "echo"}},
                         "routes": {"echo": {"provider": "builtin"}}})


@pytest.mark.parametrize("freeze", [True, False])
async def test_what_lives_before_serving_is_never_walked_again(freeze: bool) -> None:
    before = [[]]  # tracked by the collector, alive for the whole test
    assert walked(before)
    async with running(_config(freeze), port=0) as (gateway, url), httpx.AsyncClient() as http:
        r = await http.post(f"{url}/rpc", json={"jsonrpc": "2.0", "method": "echo", "params": [1], "id": 7})
        after = [[]]
        assert r.json() == {"jsonrpc": "2.0", "result": [1], "id": 7}  # serving as usual
        assert walked(before) is not freeze
        assert walked(after)  # what comes later is collected as usual
        gateway.notify("local.compile_started", {})  # not an event after which objects settle
        assert walked(after)
        gateway.notify("local.model_loaded", {"provider": "local", "model": "m"})
        assert walked(after) is not freeze  # a loaded model's objects are frozen too
    assert "local.model_loaded" in SETTLED


def test_config_refuses_a_non_boolean_freeze() -> None:
    with pytest.raises(ConfigError, match=r"server\.freeze_heap"):
        parse_config({"server": {"freeze_heap": "sometimes"}})
