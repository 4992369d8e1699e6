"""Stored keys under ``serve --workers 2`` without ``state.url``: real worker processes on
127.0.0.1 sharing one SQLite store. A key made, or revoked, through the admin API on whichever
worker answers holds on every worker within 2 s; once the store holds a key no worker serves a
caller without one (or with a bearer it does not know), not even before it reloads; and the
dashboard shows every worker's counters, as ``/metrics`` does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from tests.test_workers import Supervisor, connections_to_both, metric_lines, rpc, write_config

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "w" * 28
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
WITHIN_S = 2.0
Conns = list[tuple[httpx.AsyncClient, int]]


@pytest.fixture(scope="module")
async def keyed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Supervisor]:
    """Two workers, an admin key, no key in the store yet, no ``state.url``."""
    config = write_config(tmp_path_factory.mktemp("keyed"), None, {"admin_key": ADMIN})
    async with anyio.create_task_group() as tg:
        yield Supervisor(tg, config)
        tg.cancel_scope.cancel()


@pytest.fixture
async def conns(keyed: Supervisor) -> AsyncIterator[tuple[str, Conns]]:
    """Connections without a key, at least one on each worker."""
    url = (await keyed.up()).url
    out = await connections_to_both(url, 16, headers={})
    yield url, out
    for client, _ in out:
        await client.aclose()


async def echo(client: httpx.AsyncClient, url: str, key: str | None) -> dict[str, Any]:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    r = await client.post(f"{url}/rpc", json=rpc("echo", {"x": 1}), headers=headers)
    return r.json()  # type: ignore[no-any-return]


def refused(reply: dict[str, Any]) -> bool:
    return reply.get("error", {}).get("code") == -32005


async def until_everywhere(url: str, conns: Conns, key: str, accepted: bool) -> tuple[float, int]:
    """Seconds until the key is accepted (or refused) on every connection, so on both workers,
    and the rounds over the connections it took (1: each one's first request); fails past
    ``WITHIN_S``."""
    start = time.perf_counter()
    pending = dict(enumerate(conns))
    rounds = 0
    while pending:
        rounds += 1
        for i, (client, _) in list(pending.items()):
            reply = await echo(client, url, key)
            if ("result" in reply) == accepted:
                assert accepted or refused(reply), reply
                del pending[i]
        elapsed = time.perf_counter() - start
        assert elapsed < WITHIN_S, f"workers {sorted({p for _, p in pending.values()})} still " \
                                   f"{'refuse' if accepted else 'accept'} the key after {elapsed:.2f} s"
        if pending:
            await anyio.sleep(0.005)
    return time.perf_counter() - start, rounds


async def make_key(client: httpx.AsyncClient, url: str, name: str) -> tuple[str, str]:
    r = await client.post(f"{url}/admin/keys", json={"name": name}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"], r.json()["id"]


async def test_the_first_key_ends_keyless_service_on_every_worker_at_once(
        conns: tuple[str, Conns]) -> None:
    """The first of the module's tests: the store holds no key until it makes one."""
    url, clients = conns
    for client, _ in clients:  # no key yet: callers without one are served everywhere
        assert "result" in await echo(client, url, None)
    key, _ = await make_key(clients[0][0], url, "first")
    # no wait: the very next request on each worker, reloaded or not, needs a key it knows
    for client, pid in clients:
        assert refused(await echo(client, url, None)), pid
        assert refused(await echo(client, url, "mx-not-a-key-of-this-gateway")), pid
    accepted_s, rounds = await until_everywhere(url, clients, key, accepted=True)
    print(f"\nfirst key accepted on both workers within {accepted_s * 1000:.1f} ms of its 201 "
          f"({rounds} round(s) over {len(clients)} connections)")


async def test_a_new_key_and_a_revocation_reach_every_worker_within_two_seconds(
        conns: tuple[str, Conns]) -> None:
    url, clients = conns
    key, kid = await make_key(clients[-1][0], url, "second")
    made_s, made_rounds = await until_everywhere(url, clients, key, accepted=True)
    r = await clients[0][0].delete(f"{url}/admin/keys/{kid}", headers=AS_ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    revoked_s, revoked_rounds = await until_everywhere(url, clients, key, accepted=False)
    print(f"\nnew key accepted on both workers within {made_s * 1000:.1f} ms of its 201 "
          f"({made_rounds} round(s)); revoked within {revoked_s * 1000:.1f} ms of the DELETE's "
          f"answer ({revoked_rounds} round(s) over {len(clients)} connections)")


async def test_the_dashboard_counts_every_workers_calls(conns: tuple[str, Conns]) -> None:
    url, clients = conns
    key, _ = await make_key(clients[0][0], url, "dash")
    await until_everywhere(url, clients, key, accepted=True)

    async def shown(client: httpx.AsyncClient) -> int:
        r = await client.get(f"{url}/ui/api/state", headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        routes = r.json()["panels"]["routes"]["routes"]
        return next((x["ok"] for x in routes if x["route"] == "echo"), 0)

    before = await shown(clients[0][0])
    for client, _ in clients:
        assert "result" in await echo(client, url, key)
    scraped = await metric_lines(url, AS_ADMIN)
    summed = float(scraped.get('multiplexer_calls_total{outcome="ok",route="echo"}', 0))
    for client, pid in clients:  # whichever worker answers shows both workers' calls
        assert await shown(client) - before == len(clients), pid
        assert await shown(client) == summed, pid
