"""``GET /readyz``: each provider, the shared state and the job store, 503 while one is not ready;
what is not ready, and why, only for the admin key."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from examples.jsonrpc_upstream import UpstreamState, create_app
from multiplexer import Client, RpcError
from multiplexer.access.admin import ENV
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.serve import serve_app
from tests.jsonrpc_helpers import calc_config
from tests.mcp_helpers import free_port
from tests.redis_helpers import own_redis, prefix, redis_url

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
ADMIN = "adm-readyz-" + "r" * 24
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(autouse=True)
def _admin_key_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)  # the environment's would win over the config's


def default_config(**extra: Any) -> dict[str, Any]:
    """The packaged default config without its local model (loading it is the local provider's business)."""
    conf = yaml.safe_load(DEFAULT_CONFIG.read_text())
    del conf["providers"]["local"], conf["routes"]["embed_local"]
    conf["server"]["port"] = 0
    conf["server"]["admin_key"] = ADMIN
    conf["providers"]["tools"]["cwd"] = str(DEFAULT_CONFIG.parent)  # its demo tools lie beside it
    return {**conf, **extra}


async def get(url: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """As the admin asks (every part and its error), unless ``headers`` says who else asks."""
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.get(url + path, headers=AS_ADMIN if headers is None else headers)


async def test_the_default_config_is_ready_and_healthz_keeps_its_shape() -> None:
    async with running(parse_config(default_config())) as (_, url):
        ready = await get(url, "/readyz")
        health = await get(url, "/healthz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "providers": {
        "builtin": {"status": "up"}, "mock": {"status": "up"}, "tools": {"status": "up"}}}
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()) == {"status", "lanes"}


async def test_a_dead_mcp_upstream_makes_readyz_503_naming_it_and_its_error(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="providers.mcp_transport")
    conf = default_config()
    conf["providers"]["dead"] = {
        "kind": "mcp", "command": sys.executable, "restart_backoff_ms": 20,
        "args": ["-c", "import sys; print('cannot open tools.db', file=sys.stderr); sys.exit(3)"]}
    async with running(parse_config(conf)) as (_, url):
        ready = await get(url, "/readyz")
    assert ready.status_code == 503
    body = ready.json()
    assert body["status"] == "not_ready"
    assert body["providers"]["dead"] == {
        "status": "failing", "error": "MCPError: Connection closed (its stderr: cannot open tools.db)"}
    # the child's stderr, line by line, under its provider's name
    said = [r.getMessage() for r in caplog.records if r.name == "providers.mcp_transport"]
    assert said and set(said) == {"dead: cannot open tools.db"}
    assert body["providers"]["builtin"] == {"status": "up"}
    assert body["providers"]["tools"] == {"status": "up"}


async def test_shared_state_lost_after_start_makes_readyz_503() -> None:
    """Unreachable at start, the gateway refuses to start (tests/test_startup_checks.py); lost
    later, it serves on (degraded) and /readyz says so, and says so no more once it is back."""
    with own_redis() as server:
        conf = default_config(state={"url": server.url, "timeout_ms": 200})
        async with running(parse_config(conf)) as (_, url):
            assert (await get(url, "/readyz")).status_code == 200
            server.stop()
            ready = await get(url, "/readyz")
            server.start()
            back = await get(url, "/readyz")
    assert ready.status_code == 503
    state = ready.json()["state"]
    assert state["mode"] == "redis" and state["reachable"] is False and state["error"]
    assert str(server.port) not in str(state.get("mode"))
    assert back.status_code == 200


async def test_reachable_shared_state_is_ready() -> None:
    conf = default_config(state={"url": redis_url(), "prefix": prefix()})
    async with running(parse_config(conf)) as (_, url):
        ready = await get(url, "/readyz")
    assert ready.status_code == 200
    assert ready.json()["state"] == {"mode": "redis", "reachable": True}


async def test_the_job_store_is_reported_where_jobs_are_served(tmp_path: Path) -> None:
    conf = default_config(store={"path": str(tmp_path / "jobs.db")})
    conf["providers"]["oai"] = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1",
                                "api_key": "sk-test"}
    async with running(parse_config(conf)) as (_, url):
        ready = await get(url, "/readyz")
    assert ready.status_code == 200
    assert ready.json()["store"] == {"mode": "sqlite", "reachable": True}
    assert ready.json()["providers"]["oai"] == {"status": "up"}  # no call has failed to connect


async def test_an_http_upstream_fails_after_connection_failures_and_is_up_on_its_next_answer() -> None:
    port = free_port()
    conf = calc_config(f"http://127.0.0.1:{port}/", server={"port": 0, "admin_key": ADMIN})
    async with running(parse_config(conf)) as (_, url), Client(url) as client:
        with pytest.raises(RpcError) as refused:
            await client.call("subtract", [2, 1])  # three attempts, each refused
        assert refused.value.code == -32007
        down = await get(url, "/readyz")
        async with serve_app(create_app(UpstreamState()), port=port):
            assert await client.call("subtract", [2, 1]) == 1
            up = await get(url, "/readyz")
    assert down.status_code == 503
    calc = down.json()["providers"]["calc"]
    assert calc["status"] == "failing" and "ConnectError" in calc["error"]
    assert up.status_code == 200 and up.json()["providers"]["calc"] == {"status": "up"}


WHO_ELSE = [{}, {"authorization": "Bearer not-the-admin-key"}, {"authorization": "Basic eA=="}]


async def test_anyone_but_the_admin_gets_the_status_and_no_error_text() -> None:
    conf = default_config(server={**default_config()["server"], "api_keys": {"ci": "caller-key-123"}})
    conf["providers"]["dead"] = {
        "kind": "mcp", "command": sys.executable, "restart_backoff_ms": 20,
        "args": ["-c", "import sys; print('password=hunter2 at db.internal', file=sys.stderr); sys.exit(3)"]}
    async with running(parse_config(conf)) as (_, url):
        admin = await get(url, "/readyz")
        others = [await get(url, "/readyz", h)
                  for h in [*WHO_ELSE, {"authorization": "Bearer caller-key-123"}]]
    assert admin.status_code == 503 and "hunter2" in admin.json()["providers"]["dead"]["error"]
    for other in others:
        assert (other.status_code, other.json()) == (503, {"status": "not_ready"})
        assert "hunter2" not in other.text and "dead" not in other.text


async def test_a_lost_shared_state_is_not_ready_for_all_and_its_error_is_the_admins() -> None:
    with own_redis() as server:
        conf = default_config(state={"url": server.url, "timeout_ms": 200})
        async with running(parse_config(conf)) as (_, url):
            up = [await get(url, "/readyz", h) for h in WHO_ELSE]
            server.stop()
            admin = await get(url, "/readyz")
            down = [await get(url, "/readyz", h) for h in WHO_ELSE]
            server.start()
    assert admin.status_code == 503 and admin.json()["state"]["error"]
    for ready in up:
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    for ready in down:
        assert (ready.status_code, ready.json()) == (503, {"status": "not_ready"})


async def test_without_an_admin_key_nobody_gets_the_details() -> None:
    conf = default_config()
    del conf["server"]["admin_key"]
    async with running(parse_config(conf)) as (_, url):
        ready = await get(url, "/readyz", AS_ADMIN)
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
