"""A local model's stage, as the dashboard shows it, says ``ready`` exactly when ``/readyz`` counts
the model up (loaded and warmed up), and ``failed`` when its load failed."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import httpx
import pytest
from pydantic import SecretStr

from multiplexer.access.admin import ENV
from multiplexer.server import running
from tests.local_helpers import MINILM, local_config

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")
ADMIN = "adm-" + "s" * 28


@pytest.fixture(autouse=True)
def no_master_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def _model(state: dict[str, Any], name: str) -> dict[str, Any]:
    [provider] = state["panels"]["local"]["providers"]
    return provider["models"][name]  # type: ignore[no-any-return]


async def test_the_dashboard_says_ready_when_readiness_says_up(held_load: threading.Event) -> None:
    config = local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu"}})
    config.server.admin_key = SecretStr(ADMIN)
    async with running(config, port=0) as (gw, url), httpx.AsyncClient(base_url=url) as http:
        provider = gw.providers["local"]
        admin = {"authorization": f"Bearer {ADMIN}"}
        loading = (await http.get("/ui/api/state", headers=admin)).json()
        assert _model(loading, "minilm")["stage"] == "loading"
        assert provider.readiness() == ("starting", "loading minilm")
        held_load.set()
        seen: set[tuple[str, str]] = set()
        with anyio.fail_after(60):  # every reading on the loop agrees, until the model is up
            while True:
                status, stage = provider.readiness()[0], provider.describe()["models"]["minilm"]["stage"]
                seen.add((status, stage))
                assert (status == "up") == (stage == "ready"), (status, stage)
                if status == "up":
                    break
                await anyio.sleep(0.005)
        assert ("up", "ready") in seen
        state = (await http.get("/ui/api/state", headers=admin)).json()
        ready = await http.get("/readyz", headers=admin)
    model = _model(state, "minilm")
    assert model["stage"] == "ready" and model["error"] is None and model["device"] == "cpu"
    assert state["panels"]["local"]["providers"][0]["status"] == "up"
    assert ready.status_code == 200


async def test_a_model_that_failed_to_load_is_failed_not_warming_up() -> None:
    config = local_config({"good": {"source": MINILM, "task": "embed", "device": "cpu"},
                           "broken": {"source": "/nonexistent/model", "task": "embed"}})
    async with running(config, port=0) as (gw, _):
        pool = gw.providers["local"].pool
        with anyio.fail_after(60):
            for handle in pool.handles.values():
                await handle.ready.wait()
        models = gw.providers["local"].describe()["models"]
    assert models["good"]["stage"] == "ready"
    assert models["broken"]["stage"] == "failed" and "does not exist" in models["broken"]["error"]
