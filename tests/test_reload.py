"""Config reload without a restart (``gateway/reload.py``): ``POST /admin/reload`` and SIGHUP.

Each test runs a real gateway on 127.0.0.1 from a config file in ``tmp_path``, rewrites the file
and reloads. The provider kind ``gated`` (registered here) answers with its settings' ``tag`` and,
for a call that asks, waits on an event the test sets: a call is held in flight on one provider
while the config changes, with no sleeps."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from multiplexer.core.call import Item, Outcome
from multiplexer.core.errors import Code
from multiplexer.core.provider import Provider
from multiplexer.gateway import registry
from multiplexer.gateway.config import load_config
from multiplexer.server import running

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "r" * 28
KEY = "caller-key-reload-0123"
AUTH = {"authorization": f"Bearer {ADMIN}"}


class GatedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "a"


class Gated(Provider):
    """Answers ``{"tag": ..., "params": ...}``; a call with ``hold`` in its params waits for
    ``GATE`` (``ENTERED`` set as it does)."""

    Settings = GatedSettings
    GATE: anyio.Event | None = None
    ENTERED: anyio.Event | None = None
    started: list[str] = []
    closed: list[str] = []

    async def start(self) -> None:
        """A task group left open until ``aclose``, as an MCP upstream's session supervisor is:
        its start and its close must run in one task. Tag ``boom`` does not start."""
        if self.ctx.settings.tag == "boom":
            raise RuntimeError("upstream unreachable")
        self._stack = AsyncExitStack()
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        tg.start_soon(anyio.sleep_forever)
        Gated.started.append(self.ctx.settings.tag)

    async def aclose(self) -> None:
        if self.ctx.settings.tag == "boom":
            return
        await self._stack.aclose()
        Gated.closed.append(self.ctx.settings.tag)

    async def execute(self, operation: str, items: Sequence[Item]) -> list[Outcome]:
        if any(isinstance(i.params, dict) and i.params.get("hold") for i in items):
            assert Gated.GATE is not None and Gated.ENTERED is not None
            Gated.ENTERED.set()
            await Gated.GATE.wait()
        return [Outcome(result={"tag": self.ctx.settings.tag, "params": i.params}) for i in items]


@pytest.fixture(autouse=True)
def gated_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.KINDS, "gated", "tests.test_reload:Gated")
    monkeypatch.delenv("MULTIPLEXER_MASTER_KEY", raising=False)
    Gated.started, Gated.closed = [], []
    Gated.GATE, Gated.ENTERED = anyio.Event(), anyio.Event()


def conf(tmp_path: Path, *, tag: str = "a", routes: dict[str, Any] | None = None,
         extra: dict[str, Any] | None = None, keys: dict[str, Any] | None = None) -> dict[str, Any]:
    server: dict[str, Any] = {"admin_key": ADMIN, "key_store": {"enabled": True}}
    if keys is not None:
        server["api_keys"] = keys
    data: dict[str, Any] = {
        "server": server,
        "store": {"path": str(tmp_path / "mux.db")},
        "providers": {"g": {"kind": "gated", "tag": tag}, "e": {"kind": "echo"}, "m": {"kind": "mock"}},
        "routes": routes if routes is not None else {"one": {"provider": "g"}},
    }
    data.update(extra or {})
    return data


def write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data))


async def rpc(http: httpx.AsyncClient, method: str, params: Any = None, **kw: Any) -> dict[str, Any]:
    r = await http.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": method,
                                      "params": params if params is not None else {}}, **kw)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_a_route_change_is_served_at_once_and_audited(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    write(path, conf(tmp_path))
    async with running(load_config(path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        assert (await rpc(http, "one"))["result"]["tag"] == "a"
        assert (await rpc(http, "two"))["error"]["code"] == -32601
        write(path, conf(tmp_path, routes={"one": {"provider": "e"}, "two": {"provider": "g"},
                                           "chat": {"provider": "m", "operation": "chat",
                                                    "models": ["fresh-model"]}}))
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["result"] == "ok"
        assert body["routes"] == {"added": ["chat", "two"], "removed": [], "changed": ["one"]}
        assert body["providers"] == {"started": [], "draining": [], "kept": ["e", "g", "m"]}
        chat = await http.post("/v1/chat/completions", json={
            "model": "fresh-model", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text  # /v1's model names read again
        assert (await rpc(http, "one", {"x": 1}))["result"] == {"x": 1}  # echo now
        assert (await rpc(http, "two"))["result"]["tag"] == "a"
        assert Gated.started == ["a"]  # the unchanged provider was kept, not started again
        store = gw.keys.store
        assert store is not None
        rows = await store.run(store.audit, 10, "config")
        assert [(r.action, r.actor, r.detail["result"]) for r in rows] == [("config.reload", "admin", "ok")]
        listed = (await http.get("/admin/audit?target=config", headers=AUTH)).json()["data"]
        assert [(a["action"], a["detail"]["routes"]["added"]) for a in listed] == [
            ("config.reload", ["chat", "two"])]
        metrics = (await http.get("/metrics")).text
        assert 'multiplexer_config_reloads_total{result="ok"} 1.0' in metrics


async def test_an_in_flight_call_finishes_on_the_old_provider_which_is_then_closed(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    write(path, conf(tmp_path))
    async with running(load_config(path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        held: dict[str, Any] = {}

        async def hold() -> None:
            held.update(await rpc(http, "one", {"hold": True}))

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            assert Gated.ENTERED is not None and Gated.GATE is not None
            await Gated.ENTERED.wait()  # in flight on the provider tagged a
            write(path, conf(tmp_path, tag="b"))
            r = await http.post("/admin/reload", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json()["providers"] == {"started": ["g"], "draining": ["g"], "kept": ["e", "m"]}
            assert (await rpc(http, "one"))["result"]["tag"] == "b"  # new calls: the new provider
            assert Gated.closed == []  # the old one still runs its call
            reloader = gw.faces["reloader"]
            assert reloader.draining == {"g"}
            Gated.GATE.set()
        assert held["result"]["tag"] == "a"  # finished where it was admitted
        with anyio.fail_after(5):  # drained: the provider the gateway started is closed now
            await reloader.wait_until(lambda: not reloader.draining)
        assert Gated.closed == ["a"]
        assert [life.provider.ctx.settings.tag for life in gw.lives.open
                if life.provider.name == "g"] == ["b"]
        write(path, conf(tmp_path, tag="c"))
        assert (await http.post("/admin/reload", headers=AUTH)).status_code == 200
        with anyio.fail_after(5):  # one a reload started: closed once drained too
            await reloader.wait_until(lambda: "b" in Gated.closed)
        assert (await rpc(http, "one"))["result"]["tag"] == "c"
        assert Gated.closed == ["a", "b"]
    assert Gated.closed == ["a", "b", "c"]


async def test_an_invalid_config_is_refused_with_check_configs_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gw.yaml"
    write(path, conf(tmp_path))
    async with running(load_config(path), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        bad = conf(tmp_path, routes={"one": {"provder": "g"}})
        write(path, bad)
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["detail"]["errors"][0] == "invalid config:"
        assert "routes.one.provder: unknown key (did you mean 'provider'?)" in error["message"]
        # the same lines as `multiplexer check-config`
        from multiplexer.cli import main

        assert main(["check-config", str(path)]) != 0
        assert error["message"] in capsys.readouterr().err
        assert (await rpc(http, "one"))["result"]["tag"] == "a"  # the running config stays
        path.write_text("")  # read while an editor rewrites it: refused, never "no routes"
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.status_code == 400 and "is empty" in r.json()["error"]["message"], r.text
        assert (await rpc(http, "one"))["result"]["tag"] == "a"
        metrics = (await http.get("/metrics")).text
        assert 'multiplexer_config_reloads_total{result="invalid"} 2.0' in metrics
        assert (await http.post("/admin/reload")).status_code == 401  # admin only
        write(path, conf(tmp_path, tag="boom"))  # valid, but its new provider does not start
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["detail"]["errors"] == [
            "providers.g: did not start: RuntimeError: upstream unreachable"]
        assert (await rpc(http, "one"))["result"]["tag"] == "a"  # the running config stays


async def test_keys_quotas_and_prices_reload(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    data = conf(tmp_path, keys={"alice": KEY})
    data["server"]["key_store"] = {"enabled": False}
    write(path, data)
    async with running(load_config(path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        assert gw.money is not None
        assert gw.money.budgets.prices.rates("one", "g", None) is None  # nobody prices it yet
        alice = {"headers": {"authorization": f"Bearer {KEY}"}}
        assert (await rpc(http, "one", **alice))["result"]["tag"] == "a"
        data["server"]["api_keys"] = {"alice": {"key": KEY, "routes": ["none"]}, "bob": "bob-key-0123456789"}
        data["server"]["quotas"] = {"bob": {"rpm": 1}}
        data["routes"]["one"]["price"] = {"input_per_mtok": 5, "output_per_mtok": 7}
        write(path, data)
        assert (await http.post("/admin/reload", headers=AUTH)).status_code == 200
        refused = await rpc(http, "one", **alice)  # its access narrowed: no route for it now
        assert refused["error"]["code"] != 0 and "result" not in refused
        bob = {"headers": {"authorization": "Bearer bob-key-0123456789"}}
        assert (await rpc(http, "one", **bob))["result"]["tag"] == "a"  # a key added
        assert (await rpc(http, "one", **bob))["error"]["code"] == Code.RATE_LIMITED  # its quota: rpm 1
        rates = gw.money.budgets.prices.rates("one", "g", None)
        assert rates is not None and (rates.input, rates.output) == (5, 7)
        assert gw.money.meter.prices is gw.money.budgets.prices


async def test_reloads_under_a_steady_stream_of_calls_lose_none(tmp_path: Path) -> None:
    """Eight callers call without pause while the provider is replaced five times (each reload
    after the callers answered 20 more calls): every call answered, none with an error or a 5xx."""
    path = tmp_path / "gw.yaml"
    write(path, conf(tmp_path))
    sent = answered = 0
    bad: list[Any] = []
    tags: set[str] = set()
    progress = anyio.Event()
    stop = False
    async with running(load_config(path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:

        async def caller() -> None:
            nonlocal sent, answered, progress
            while not stop:
                sent += 1
                r = await http.post("/rpc", json={"jsonrpc": "2.0", "id": sent, "method": "one",
                                                  "params": {"n": sent}})
                body = r.json() if r.status_code == 200 else None
                if body is None or "result" not in body:
                    bad.append((r.status_code, r.text))
                else:
                    tags.add(body["result"]["tag"])
                answered += 1
                progress.set()
                progress = anyio.Event()

        async def until(n: int) -> None:
            while answered < n:
                await progress.wait()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(caller)
                for i in range(5):
                    await until(answered + 20)
                    write(path, conf(tmp_path, tag=f"t{i}"))
                    r = await http.post("/admin/reload", headers=AUTH)
                    assert r.status_code == 200 and r.json()["providers"]["started"] == ["g"], r.text
                await until(answered + 20)
                stop = True
        reloader = gw.faces["reloader"]
        with anyio.fail_after(5):
            await reloader.wait_until(lambda: not reloader.draining)
    assert bad == []
    assert answered == sent and answered >= 120
    assert {"a", "t4"} <= tags
    assert sorted(Gated.closed) == ["a", "t0", "t1", "t2", "t3", "t4"]


async def test_request_log_and_tool_audit_settings_reload(tmp_path: Path) -> None:
    """``log:`` and ``audit:`` apply at once (bodies kept from the next call on), all but
    ``log.enabled`` and ``audit.tools``, which are named in ``restart_needed``."""
    path = tmp_path / "gw.yaml"
    data = conf(tmp_path, routes={"one": {"provider": "e"}})
    write(path, data)
    async with running(load_config(path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        assert gw.requests is not None
        audit = gw.faces["tool_audit"]  # the /mcp face's tool-call audit
        assert (await rpc(http, "one", {"before": 1}))["result"] == {"before": 1}
        data["log"] = {"bodies": True, "queue": 500, "batch": 10, "flush_interval_s": 0.5,
                       "retention_days": 3}
        data["audit"] = {"tools": False, "arguments": True, "max_argument_bytes": 128, "queue": 77}
        write(path, data)
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["restart_needed"] == ["audit.tools"]
        log_conf = gw.requests.config
        assert (log_conf.bodies, log_conf.retention_days, log_conf.enabled) == (True, 3, True)
        sink = gw.requests.sink
        assert (sink.capacity, sink.batch, sink.interval_s) == (500, 10, 0.5)
        assert (audit.settings.arguments, audit.settings.max_argument_bytes) == (True, 128)
        assert audit.settings.tools is True and gw.config.audit.tools is True  # until a restart
        assert audit.sink.capacity == 77
        assert (await rpc(http, "one", {"after": 2}))["result"] == {"after": 2}
        listed = (await http.get("/admin/requests", headers=AUTH)).json()["requests"]
        bodies = []
        for row in listed:
            one = (await http.get(f"/admin/requests/{row['id']}", headers=AUTH)).json()
            bodies.append(one["request_body"])
        assert bodies[1] is None and bodies[0] is not None and '"after"' in bodies[0], bodies
        data["log"]["enabled"] = False
        write(path, data)
        r = await http.post("/admin/reload", headers=AUTH)
        assert r.json()["restart_needed"] == ["audit.tools", "log.enabled"], r.text
        assert gw.requests.config.enabled is True and gw.requests.config.bodies is True


async def test_a_routes_tool_limits_reload_on_a_kept_mcp_provider(tmp_path: Path) -> None:
    """An MCP upstream kept by a reload (its settings unchanged) takes a route's new
    ``tool_limits`` from the route's next call."""
    from multiplexer.core.clock import ManualClock
    from multiplexer.gateway.gateway import Gateway
    from multiplexer.gateway.reload import ConfigReloader
    from tests.mcp_helpers import call
    from tests.pin_helpers import config_data, upstream_url

    async with upstream_url() as url:
        path = tmp_path / "gw.yaml"
        data = config_data(url, tmp_path)
        data["routes"]["rug_*"]["tool_limits"] = {"look*": {"rpm": 1}}
        write(path, data)
        async with Gateway(load_config(path), clock=ManualClock()) as gw:
            reloader = ConfigReloader(gw, path)
            assert [(await call(gw, "rug_lookup", {"word": str(i)})).ok for i in range(2)] == [True, False]
            data["routes"]["rug_*"]["tool_limits"] = {"look*": {"rpm": 3}}
            write(path, data)
            done = await reloader.reload("test")
            assert done.result == "ok", done.errors
            assert done.providers["kept"] == ["rug"] and done.routes["changed"] == ["rug_*"]
            outcomes = [await call(gw, "rug_lookup", {"word": str(i)}) for i in range(4)]
            assert [o.ok for o in outcomes] == [True, True, True, False]
            assert outcomes[3].error.code == Code.RATE_LIMITED
            del data["routes"]["rug_*"]["tool_limits"]
            write(path, data)
            assert (await reloader.reload("test")).result == "ok"
            assert all([(await call(gw, "rug_lookup", {"word": str(i)})).ok for i in range(5)])


async def test_providers_start_in_their_own_tasks_and_close_in_reverse_or_on_a_failed_start(
        tmp_path: Path) -> None:
    """At start-up each provider starts in a task of its own (``gateway/provider_life.py``): one
    whose start fails fails the gateway's start with its own error, closing those started before
    it; as the gateway stops they close in the reverse order of their starts."""
    from multiplexer.gateway.gateway import Gateway

    data = conf(tmp_path)
    data["providers"] = {"g": {"kind": "gated", "tag": "first"}, "h": {"kind": "gated", "tag": "second"}}
    async with Gateway(load_config_data(tmp_path, data)) as gw:
        assert Gated.started == ["first", "second"] and len(gw.lives.open) == 2
    assert Gated.closed == ["second", "first"]
    Gated.started, Gated.closed = [], []
    data["providers"]["h"]["tag"] = "boom"
    with pytest.raises(RuntimeError, match="upstream unreachable"):
        async with Gateway(load_config_data(tmp_path, data)):
            pass
    assert Gated.started == ["first"] and Gated.closed == ["first"]


def load_config_data(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "gw.yaml"
    write(path, data)
    return load_config(path)
