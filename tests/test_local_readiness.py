"""Local models load and run a warm-up forward when the provider starts, not at the first call;
``LocalProvider.readiness`` says where that stands, while the HTTP server already answers."""

from __future__ import annotations

import threading

import httpx
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.local_helpers import MINILM, local_config

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")




async def test_readiness_goes_from_starting_to_up_after_one_warm_up_forward(
        held_load: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    from local_models.pool import ModelHandle

    forwards: list[object] = []
    real_task = ModelHandle._task

    def counted(self: ModelHandle, model, packed, rows, loaded):
        forwards.append(model)
        return real_task(self, model, packed, rows, loaded)

    monkeypatch.setattr(ModelHandle, "_task", counted)
    async with Gateway(local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu"}})) as gw:
        provider = gw.providers["local"]
        assert provider.readiness() == ("starting", "loading minilm")  # started with the provider
        held_load.set()
        handle = await provider.pool.ready("minilm")
        assert provider.readiness() == ("up", None)
        assert forwards == [handle.onednn_model or handle.loaded.model]  # the forward calls will run
        assert handle.stats.batches == 0  # before any call
        outcome = await gw.submit(Call("minilm", {"input": "served"}))
        assert outcome.ok, outcome.error
        assert len(forwards) == 2
    assert provider.readiness() == ("starting", "not started")  # closed


async def test_a_broken_model_source_makes_the_provider_failing_with_its_error() -> None:
    config = local_config({"good": {"source": MINILM, "task": "embed", "device": "cpu"},
                           "broken": {"source": "/nonexistent/model", "task": "embed"}})
    async with Gateway(config) as gw:
        provider = gw.providers["local"]
        for handle in provider.pool.handles.values():
            await handle.ready.wait()
        assert provider.readiness() == (
            "failing", "broken: SourceError: model directory '/nonexistent/model' does not exist")
        outcome = await gw.submit(Call("good", {"input": "still served"}))
        assert outcome.ok, outcome.error


async def test_the_http_server_answers_healthz_while_a_model_loads(held_load: threading.Event) -> None:
    config = local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu"}})
    async with running(config, port=0) as (gw, url), httpx.AsyncClient() as client:
        provider = gw.providers["local"]
        reply = await client.get(f"{url}/healthz")
        assert reply.status_code == 200 and reply.json()["status"] == "ok"
        assert provider.readiness() == ("starting", "loading minilm")
        held_load.set()
        await provider.pool.ready("minilm")
        assert provider.readiness() == ("up", None)
