"""The request log: every call's end recorded off the call path, in SQLite or PostgreSQL; the
listing's filters and cursor, one record's path, pruning by age and by count, a caller's key
seeing only its own calls, and bodies only when asked for, redacted."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from multiplexer.gateway.config import parse_config
from multiplexer.records import request_store
from multiplexer.records.redact import MASK, redact, redacted_text
from multiplexer.records.request_store import COLUMNS, STEP, PgRequestStore, Query, RequestStore
from multiplexer.server import running
from tests.pg_helpers import throwaway_schema

pytestmark = pytest.mark.anyio
ADMIN = "adm-" + "r" * 28
ALICE, BOB = "sk-log-alice-0123456789", "sk-log-bob-0123456789"


def row(at: float, key: str, status: str = "ok", route: str = "echo",
        error: str | None = None) -> tuple[Any, ...]:
    values: dict[str, Any] = dict.fromkeys(COLUMNS)
    values.update(at=at, key=key, team="t" if key == "alice" else None, route=route, model="m",
                  status=status, code=None if status == "ok" else -32000, error=error, attempts=1,
                  fallbacks=0, latency_ms=1.5, path="{}")
    return tuple(values[c] for c in COLUMNS)


def listed(store: RequestStore, q: Query) -> list[tuple[Any, ...]]:
    rows, stopped = store.page(q)
    assert stopped is None  # these tables are small: no listing stops before its page is full
    return rows


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RequestStore]:
    if request.param == "sqlite":
        s = RequestStore(tmp_path / "jobs.db")
        yield s
        s.close()
        return
    with throwaway_schema() as (url, schema, _):
        s = PgRequestStore(url, schema)
        yield s
        s.close()


def test_filters_and_the_cursor_walk_every_row_once(store: RequestStore) -> None:
    store.add([row(1000.0 + i, "alice" if i % 2 else "bob", "error" if i % 5 == 0 else "ok",
                   error="Upstream said NO" if i % 5 == 0 else None) for i in range(23)])
    seen: list[int] = []
    q = Query(limit=5)
    while True:
        page = listed(store, q)
        seen += [r[0] for r in page]
        if len(page) < q.limit:
            break
        q.cursor = (page[-1][1], page[-1][0])
    assert len(seen) == 23 == len(set(seen)) and seen == sorted(seen, reverse=True)
    assert {r[3] for r in listed(store, Query(key="alice", limit=50))} == {"alice"}
    assert len(listed(store, Query(team="t", limit=50))) == 11
    assert len(listed(store, Query(status="error", limit=50))) == 5
    assert len(listed(store, Query(code=-32000, limit=50))) == 5
    assert len(listed(store, Query(error="said no", limit=50))) == 5  # any case
    assert len(listed(store, Query(error="100%", limit=50))) == 0  # a LIKE wildcard is a character
    assert [r[1] for r in listed(store, Query(since=1010.0, until=1012.0))] == [1011.0, 1010.0]
    # a filter beside a status, a text or neither: one index range, or each status's merged
    alice = [r[1] for r in listed(store, Query(key="alice", limit=4))]
    assert alice == [1021.0, 1019.0, 1017.0, 1015.0]  # 1015 failed: both statuses, in order
    later = listed(store, Query(key="alice", limit=4, cursor=(1015.0, 16)))
    assert [r[1] for r in later] == [1013.0, 1011.0, 1009.0, 1007.0]
    assert [r[1] for r in listed(store, Query(key="alice", status="error"))] == [1015.0, 1005.0]
    assert [r[1] for r in listed(store, Query(key="alice", error="said"))] == [1015.0, 1005.0]
    assert listed(store, Query(team="t", code=-32000, route="nowhere")) == []
    first = listed(store, Query(limit=1))[0]
    got = store.get(first[0])
    assert got is not None and got["path"] == "{}" and got["at"] == 1022.0
    assert store.get(10**12) is None


def walk(store: RequestStore, q: Query) -> tuple[list[float], int]:
    """Every page of ``q`` through its cursors: the rows' times, and how many pages stopped early."""
    seen: list[float] = []
    stops = 0
    while True:
        rows, stopped = store.page(q)
        seen += [r[1] for r in rows]
        if stopped is not None:
            stops += 1
            q = replace(q, cursor=stopped)
        elif len(rows) == q.limit:
            q = replace(q, cursor=(rows[-1][1], rows[-1][0]))
        else:
            return seen, stops


def test_filters_no_one_index_holds_stop_after_a_bounded_read_and_go_on(
        store: RequestStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two filters whose calls seldom meet (no index holds both) read the lead's rows a step at a
    time, at most ``SCAN``; a page that stops there says where, and its cursor goes on: walking
    the pages finds every matching row once, newest first."""
    monkeypatch.setattr(request_store, "STEPS", (2, 3, 4))
    monkeypatch.setattr(request_store, "SCAN", 9)
    store.add([row(1000.0 + i, "alice", route="rare" if i in (3, 25) else "echo") for i in range(30)]
              + [row(2000.0, "bob", route="rare")])
    first, stopped = store.page(Query(key="alice", route="rare", limit=5))
    assert [r[1] for r in first] == [1025.0]  # 9 rows read, 1029 to 1021: stopped there
    assert stopped is not None and stopped[0] == 1021.0
    assert walk(store, Query(key="alice", route="rare", limit=5)) == ([1025.0, 1003.0], 3)
    # a filter in its index alone is a range read: never stops
    assert walk(store, Query(key="alice", limit=7))[1] == 0
    # a text too: the newest errors read until the page is full, or a stop
    store.add([row(3000.0 + i, "carol", "error", error="disk full" if i == 1 else "busy")
               for i in range(12)])
    assert walk(store, Query(error="DISK", limit=2))[0] == [3001.0]


def test_a_text_few_errors_hold_is_found_by_its_index_past_the_scan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL: a text that no recent error holds is looked up in the errors' trigram index,
    so its page is whole, not stopped; a text too many errors hold is left to the scan."""
    monkeypatch.setattr(request_store, "STEPS", (2, 3, 4))
    monkeypatch.setattr(request_store, "SCAN", 9)
    with throwaway_schema() as (url, schema, _):
        store = PgRequestStore(url, schema)
        try:
            assert store.trigrams
            store.add([row(1000.0 + i, "alice", "error",
                           error="certificate expired" if i < 3 else "upstream overloaded")
                       for i in range(40)])
            rows, stopped = store.page(Query(error="Certificate", limit=10))
            assert [r[1] for r in rows] == [1002.0, 1001.0, 1000.0] and stopped is None
            assert store.page(Query(error="certificate", key="bob")) == ([], None)
            monkeypatch.setattr(request_store, "MATCHES", 2)  # more hold it than it sorts
            rows, stopped = store.page(Query(error="certificate", limit=10))
            assert rows == [] and stopped is not None
            assert walk(store, Query(error="certificate", limit=10)) == ([1002.0, 1001.0, 1000.0], 4)
        finally:
            store.close()


def test_pruning_goes_in_steps_by_age_and_by_count(store: RequestStore) -> None:
    store.add([row(float(i), "alice") for i in range(STEP + 10)])
    assert store.prune_step(before=5.0, max_rows=None) == 5
    assert store.prune_step(before=None, max_rows=STEP + 10) == 0
    assert store.prune_step(before=None, max_rows=3) == STEP  # one step at a time
    assert store.prune_step(before=None, max_rows=3) == 2
    assert store.count() == 3
    assert [r[1] for r in listed(store, Query())] == [float(STEP + 9), float(STEP + 8), float(STEP + 7)]


def test_redaction_masks_secrets_and_keeps_the_rest() -> None:
    body = {"model": "m", "max_tokens": 5, "api_key": "k",
            "headers": {"Authorization": "Bearer abcdefghijkl"},
            "messages": [{"content": "my key is sk-abcdefghijklmnopqrstuvwx ok"}]}
    out = redact(body)
    assert out["api_key"] == MASK and out["headers"]["Authorization"] == MASK and out["max_tokens"] == 5
    assert out["messages"][0]["content"] == f"my key is {MASK} ok"
    assert body["api_key"] == "k"  # the input is left as it was
    cut = redacted_text({"text": "x" * 500}, 100)
    assert cut is not None and cut.startswith('{"text":"xxx') and "[cut:" in cut


def gateway_config(tmp_path: Path, **log: Any) -> Any:
    return parse_config({
        "server": {"admin_key": ADMIN, "key_store": {"enabled": False},
                   "api_keys": {"alice": {"key": ALICE, "team": "research"}, "bob": BOB},
                   "teams": {"research": {}}},
        "store": {"path": str(tmp_path / "jobs.db")},
        "log": {"flush_interval_s": 60, **log},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}}})


async def rpc(http: httpx.AsyncClient, key: str, method: str, params: Any) -> httpx.Response:
    return await http.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                           headers={"authorization": f"Bearer {key}",
                                    "x-request-id": f"rid-{method}-{key[7:10]}"})


async def test_every_call_is_recorded_and_only_its_key_sees_its_own(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        assert (await rpc(http, ALICE, "echo", {"x": 1, "api_key": "secret"})).status_code == 200
        await rpc(http, ALICE, "nope", {})  # refused at admission: recorded too
        await rpc(http, BOB, "echo", {"y": 2})
        admin = {"authorization": f"Bearer {ADMIN}"}
        listed = (await http.get("/admin/requests", headers=admin)).json()
        rows = listed["requests"]
        assert [(r["key"], r["method"], r["status"]) for r in rows] == [
            ("bob", "echo", "ok"), ("alice", "nope", "error"), ("alice", "echo", "ok")]
        assert listed["next_cursor"] is None
        ok = rows[2]
        assert ok["team"] == "research" and ok["route"] == "echo" and ok["face"] == "rpc"
        assert ok["request_id"] == "rid-echo-ali" and ok["attempts"] == 1 and ok["latency_ms"] > 0
        assert rows[1]["code"] == -32601 and "nope" in rows[1]["error"] and rows[1]["attempts"] == 0
        one = (await http.get(f"/admin/requests/{ok['id']}", headers=admin)).json()
        assert one["request_body"] is None and one["response_body"] is None  # log.bodies is off
        path = one["path"]
        assert path["admission"]["route"] == "echo"
        assert path["attempts"] == [{"route": "echo", "outcome": "ok"}]
        assert [e["event"] for e in path["timeline"]] == ["admitted", "answered"]
        page = (await http.get("/admin/requests", headers=admin, params={"limit": 2})).json()
        rest = (await http.get("/admin/requests", headers=admin,
                               params={"limit": 2, "cursor": page["next_cursor"]})).json()
        assert [r["id"] for r in page["requests"] + rest["requests"]] == [r["id"] for r in rows]
        errors = (await http.get("/admin/requests", headers=admin, params={"status": "error"})).json()
        assert [r["method"] for r in errors["requests"]] == ["nope"]
        assert (await http.get("/admin/requests", headers=admin, params={"error": "NOPE"})).json()[
            "requests"][0]["method"] == "nope"

        # a caller's key: its own calls only, whatever it filters on; another's record is not found
        mine = await http.get("/ui/api/requests", headers={"authorization": f"Bearer {BOB}"},
                              params={"key": "alice"})
        assert [r["key"] for r in mine.json()["requests"]] == ["bob"]
        theirs = await http.get(f"/ui/api/requests/{ok['id']}", headers={"authorization": f"Bearer {BOB}"})
        assert theirs.status_code == 404
        assert (await http.get(f"/ui/api/requests/{ok['id']}",
                               headers={"authorization": f"Bearer {ALICE}"})).status_code == 200
        # the admin API answers the admin key only; no key, no view
        r = await http.get("/admin/requests", headers={"authorization": f"Bearer {BOB}"})
        assert r.status_code == 401
        assert (await http.get("/ui/api/requests")).status_code == 401


BAD = [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"since": "yesterday"}, "since"),
       ({"until": "nan"}, "until"), ({"status": "bad"}, "status"), ({"cursor": "x"}, "cursor"),
       ({"colour": "red"}, "colour"), ({"key": "k" * 201}, "key")]


async def test_bad_filters_are_a_400_naming_them(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        for query, says in BAD:
            r = await http.get("/admin/requests", headers={"authorization": f"Bearer {ADMIN}"}, params=query)
            assert r.status_code == 400 and says in r.json()["error"]["message"], query
        r = await http.get("/admin/requests/abc", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404


async def test_bodies_only_when_asked_and_redacted(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path, bodies=True), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url) as http:
        await rpc(http, ALICE, "echo", {"x": 1, "api_key": "hunter2-secret"})
        admin = {"authorization": f"Bearer {ADMIN}"}
        rid = (await http.get("/admin/requests", headers=admin)).json()["requests"][0]["id"]
        one = (await http.get(f"/admin/requests/{rid}", headers=admin)).json()
        assert "hunter2" not in one["request_body"] and MASK in one["request_body"]
        assert '"x":1' in one["request_body"] and one["response_body"] is not None


async def test_the_log_off_serves_nothing_and_records_nothing(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path, enabled=False), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        assert gw.requests is None
        await rpc(http, ALICE, "echo", {})
        r = await http.get("/admin/requests", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404 and "log.enabled" in r.json()["error"]["message"]


def mixed_config(tmp_path: Path, **log: Any) -> Any:
    """A route that cannot connect falling back to the mock; the mock streams."""
    return parse_config({
        "server": {"admin_key": ADMIN, "key_store": {"enabled": False}, "api_keys": {"alice": ALICE}},
        "store": {"path": str(tmp_path / "jobs.db")},
        "log": {"flush_interval_s": 60, **log},
        "providers": {"down": {"kind": "openai", "base_url": "http://127.0.0.1:1/v1", "api_key": "sk-x",
                               "retry": {"attempts": 1}},
                      "mock": {"kind": "mock"}},
        "routes": {"chat": {"provider": "down", "operation": "chat", "models": ["gpt-x"],
                            "fallbacks": ["chat_mock"]},
                   "chat_mock": {"provider": "mock", "operation": "chat", "params": {"model": "mock-gpt"}}}})


async def test_a_fallback_and_a_stream_leave_their_path(tmp_path: Path) -> None:
    async with running(mixed_config(tmp_path), port=0) as (_, url), \
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {ALICE}"}) as http:
        chat = {"model": "gpt-x", "messages": [{"role": "user", "content": "hello there"}]}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
        async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200 and b"[DONE]" in b"".join([c async for c in r.aiter_bytes()])
        admin = {"authorization": f"Bearer {ADMIN}"}
        streamed, whole = (await http.get("/admin/requests", headers=admin)).json()["requests"]
        assert whole["face"] == "v1" and whole["model_asked"] == "gpt-x" and whole["route"] == "chat_mock"
        assert whole["model"] == "mock-gpt" and whole["attempts"] == 2 and whole["fallbacks"] == 1
        assert whole["input_tokens"] and whole["output_tokens"] and whole["first_chunk_ms"] is None
        path = (await http.get(f"/admin/requests/{whole['id']}", headers=admin)).json()["path"]
        assert [a["route"] for a in path["attempts"]] == ["chat", "chat_mock"]
        assert path["attempts"][0]["outcome"] == "connection" and path["attempts"][1]["outcome"] == "ok"
        assert streamed["first_chunk_ms"] is not None and streamed["first_chunk_ms"] <= streamed["latency_ms"]
        path = (await http.get(f"/admin/requests/{streamed['id']}", headers=admin)).json()["path"]
        assert [e["event"] for e in path["timeline"]] == ["admitted", "first chunk", "answered"]


async def test_a_full_queue_drops_and_counts_and_the_call_is_answered(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path, queue=1), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        for i in range(3):  # the writer waits a minute (flush_interval_s): the queue stays full
            assert (await rpc(http, ALICE, "echo", {"i": i})).json()["result"] == {"i": i}
        assert gw.requests is not None and gw.requests.sink.dropped == 2
        metrics = (await http.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})).text
        assert 'multiplexer_records_dropped_total{sink="requests"} 2.0' in metrics
        rows = (await http.get("/admin/requests", headers={"authorization": f"Bearer {ADMIN}"})).json()
        assert len(rows["requests"]) == 1


async def test_the_writer_prunes_by_count(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path, max_rows=2), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        for i in range(5):
            await rpc(http, ALICE, "echo", {"i": i})
        assert gw.requests is not None
        await gw.requests.sink.flush()
        assert await gw.requests.prune() == 3
        rows = (await http.get("/admin/requests", headers={"authorization": f"Bearer {ADMIN}"})).json()
        assert len(rows["requests"]) == 2


async def test_a_store_that_cannot_be_read_is_a_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(gateway_config(tmp_path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as http:
        assert gw.requests is not None

        def gone() -> Any:
            raise OSError("database gone")

        monkeypatch.setattr(gw.requests, "_open", gone)
        for path in ("/admin/requests", "/admin/requests/1"):
            r = await http.get(path)
            assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable", path


async def test_what_is_queued_is_written_as_the_gateway_stops(tmp_path: Path) -> None:
    async with running(gateway_config(tmp_path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        await rpc(http, ALICE, "echo", {"x": 1})
        assert gw.requests is not None and len(gw.requests.sink) == 1  # the writer waits a minute
    store = RequestStore(tmp_path / "jobs.db")
    try:
        assert [r[3] for r in listed(store, Query())] == ["alice"]
    finally:
        store.close()


async def test_a_lone_surrogate_in_a_method_is_recorded_and_costs_no_other_record(tmp_path: Path) -> None:
    """JSON may escape a lone surrogate (``\\ud800``); neither SQLite nor the path's JSON keep one:
    the record keeps ``?`` in its place, and the calls written in the same batch are kept."""
    body = '{"jsonrpc": "2.0", "id": 1, "method": "echo\\ud800x", "params": {}}'
    async with running(gateway_config(tmp_path), port=0) as (gw, url), \
            httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/rpc", content=body, headers={"authorization": f"Bearer {ALICE}",
                                                             "content-type": "application/json"})
        assert r.status_code == 200 and r.json()["error"]["code"] == -32601
        await rpc(http, ALICE, "echo", {"x": 1})
        assert gw.requests is not None and len(gw.requests.sink) == 2  # one batch, written at the stop
    store = RequestStore(tmp_path / "jobs.db")
    try:
        methods = sorted(r[COLUMNS.index("method") + 1] for r in listed(store, Query()))
        assert methods == ["echo", "echo?x"]
    finally:
        store.close()


async def test_a_batch_s_lane_lines_carry_its_id(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    from tests.test_v1_batches import gateway, jsonl, line, until_ended

    async with gateway(tmp_path) as (_, gw, client):
        rows = [line(f"e{i}", {"model": "mock-embed", "input": f"text {i}"}, "/v1/embeddings")
                for i in range(2)]
        upload = await client.files.create(file=("e.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        assert (await until_ended(client, batch.id)).status == "completed"
        assert gw.requests is not None
        found = (await gw.requests.page(Query(route="mock_embed")))["requests"]
        assert [(r["batch_id"], r["status"]) for r in found] == [(batch.id, "ok")] * 2
