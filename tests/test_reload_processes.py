"""Config reload in real processes: ``serve --workers 2`` (an admin reload relayed to the sibling,
SIGHUP relayed by the parent to both workers), and SIGHUP on a lone gateway's own process."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from multiplexer.gateway.config import load_config
from multiplexer.server import serve_forever
from tests.test_workers import connections_to_both, rpc, supervised

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "w" * 28
OPEN_KEY = "open-key-0123456789"


def config(tmp_path: Path, routes: dict[str, Any]) -> dict[str, Any]:
    return {"server": {"port": 0, "grace_period_s": 5, "access_log": False, "admin_key": ADMIN,
                       "api_keys": {"open": OPEN_KEY}},
            "store": {"path": str(tmp_path / "mux.db")},
            "providers": {"e": {"kind": "echo"}},
            "routes": routes}


async def test_two_workers_both_reload_on_an_admin_reload_and_on_sighup(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, {"echo": {"provider": "e"}})))
    async with supervised(path) as (parent, url, log):
        path.write_text(yaml.safe_dump(config(tmp_path, {"echo": {"provider": "e"},
                                                          "again": {"provider": "e"}})))
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{url}/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert r.json()["workers"]["count"] == 2 and r.json()["workers"]["reloaded"] == 2, r.text
        clients = await connections_to_both(url, headers={"authorization": f"Bearer {OPEN_KEY}"})
        try:
            seen = {}
            for client, pid in clients:
                if pid not in seen:
                    seen[pid] = (await client.post(f"{url}/rpc", json=rpc("again", {"n": 1}))).json()
            assert list(seen.values()) == [{"jsonrpc": "2.0", "result": {"n": 1}, "id": 1}] * 2
            # SIGHUP to the parent: every worker reads the file again
            path.write_text(yaml.safe_dump(config(tmp_path, {"echo": {"provider": "e"},
                                                              "third": {"provider": "e"}})))
            before = log.count("config reloaded from")
            parent.send_signal(signal.SIGHUP)
            await log.wait_for("config reloaded from", before + 2, timeout=60)
            assert log.count("received SIGHUP: 2 of 2 workers reload the config") == 1
            done: dict[int, Any] = {}
            for client, pid in clients:
                if pid not in done:
                    done[pid] = (await client.post(f"{url}/rpc", json=rpc("third", [7]))).json()
                    assert "error" in (await client.post(f"{url}/rpc", json=rpc("again", [7]))).json()
            assert [d.get("result") for d in done.values()] == [[7], [7]], done
        finally:
            for client, _ in clients:
                await client.aclose()
        assert parent.returncode is None  # SIGHUP no longer ends the gateway


async def test_sighup_reloads_a_lone_gateway(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    data = config(tmp_path, {"echo": {"provider": "e"}})
    data["server"].pop("admin_key")
    path.write_text(yaml.safe_dump(data))
    ready: dict[str, Any] = {}
    up = anyio.Event()

    async def on_ready(gw: Any, url: str) -> None:
        ready.update(gw=gw, url=url)
        up.set()

    headers = {"authorization": f"Bearer {OPEN_KEY}"}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve_forever(load_config(path), port=0, on_ready=on_ready))
            await up.wait()
            gw, url = ready["gw"], ready["url"]
            data["routes"]["later"] = {"provider": "e"}
            path.write_text(yaml.safe_dump(data))
            reloader = gw.faces["reloader"]
            os.kill(os.getpid(), signal.SIGHUP)
            await reloader.wait_until(lambda: reloader.finished == 1)
            async with httpx.AsyncClient(base_url=url, headers=headers) as http:
                assert (await http.post("/rpc", json=rpc("later", [1]))).json()["result"] == [1]
            os.kill(os.getpid(), signal.SIGTERM)  # and SIGTERM still drains and stops it
