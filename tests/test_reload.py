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
