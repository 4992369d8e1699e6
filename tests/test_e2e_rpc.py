"""End to end: client -> gateway (real HTTP) -> real JSON-RPC upstream on 127.0.0.1."""

from __future__ import annotations

import anyio
import pytest

from examples.jsonrpc_upstream import UpstreamState
from multiplexer import Client, RpcError
from tests.jsonrpc_helpers import gateway_with_upstream, post

pytestmark = pytest.mark.anyio


async def test_spec_examples_single_and_batch() -> None:
    async with gateway_with_upstream() as (url, _, _):
        r = await post(url, {"jsonrpc": "2.0", "method": "subtract", "params": [42, 23], "id": 1})
        assert r.json() == {"jsonrpc": "2.0", "result": 19, "id": 1}
        r = await post(url, {"jsonrpc": "2.0", "method": "subtract",
                             "params": {"subtrahend": 23, "minuend": 42}, "id": "x"})
        assert r.json() == {"jsonrpc": "2.0", "result": 19, "id": "x"}
        batch = [
            {"jsonrpc": "2.0", "method": "sum", "params": [1, 2, 4], "id": "1"},
            {"jsonrpc": "2.0", "method": "notify_hello", "params": [7]},
            {"jsonrpc": "2.0", "method": "subtract", "params": [42, 23], "id": "2"},
            {"foo": "boo"},
            {"jsonrpc": "2.0", "method": "foo.get", "params": {"name": "myself"}, "id": "5"},
            {"jsonrpc": "2.0", "method": "get_data", "id": "9"},
            1,
        ]
        r = await post(url, batch)
        assert r.status_code == 200
        body = r.json()
        assert [x["id"] for x in body] == ["1", "2", None, "5", "9", None]
        assert body[0]["result"] == 7 and body[1]["result"] == 19
        assert body[2]["error"]["code"] == -32600 and body[5]["error"]["code"] == -32600
        assert body[3]["error"]["code"] == -32601
        assert body[3]["error"]["data"] == {"method": "foo.get"}
        assert body[4]["result"] == ["hello", 5]


async def test_ids_of_every_type_are_echoed_exactly() -> None:
    ids = [0, -7, 2**63 + 1, 1.5, "", "ü-ñ", None]
    async with gateway_with_upstream() as (url, _, _):
        batch = [{"jsonrpc": "2.0", "method": "echo", "params": [i], "id": rid}
                 for i, rid in enumerate(ids)]
        body = (await post(url, batch)).json()
        assert [x["id"] for x in body] == ids
        assert [x["result"] for x in body] == [[i] for i in range(len(ids))]
        r = await post(url, {"jsonrpc": "2.0", "method": "echo", "id": True})
        assert r.json()["error"]["code"] == -32600 and r.json()["id"] is None


async def test_notifications_get_nothing_back() -> None:
    async with gateway_with_upstream() as (url, state, _):
        r = await post(url, [{"jsonrpc": "2.0", "method": "notify_hello", "params": [1]},
                             {"jsonrpc": "2.0", "method": "notify_hello", "params": [2]}])
        assert r.status_code == 204 and r.content == b""
        r = await post(url, {"jsonrpc": "2.0", "method": "no_such_method"})
        assert r.status_code == 204
        assert state.executions["notify_hello"] == 2


async def test_parse_and_request_errors() -> None:
    async with gateway_with_upstream() as (url, _, _):
        r = await post(url, b'{"jsonrpc": "2.0", "method": "foobar, "params": "bar", "baz]')
        assert r.status_code == 200
        assert r.json()["error"]["code"] == -32700 and r.json()["id"] is None
        assert (await post(url, b"\xff\xfe\x00garbage")).json()["error"]["code"] == -32700
        assert (await post(url, [])).json()["error"]["code"] == -32600
        body = (await post(url, [1, 2])).json()
        assert [b["error"]["code"] for b in body] == [-32600, -32600]
        r = await post(url, {"jsonrpc": "2.0", "method": 1, "params": "bar", "id": 3})
        assert r.json()["error"]["code"] == -32600 and r.json()["id"] == 3
        r = await post(url, {"jsonrpc": "1.0", "method": "echo", "id": 4})
        assert r.json()["error"]["code"] == -32600
        r = await post(url, {"jsonrpc": "2.0", "method": "echo", "params": "x", "id": 5})
        assert r.json()["error"]["code"] == -32600
        deep = b"[" * 200 + b"]" * 200
        assert (await post(url, deep)).json()["error"]["code"] == -32600


async def test_params_errors_and_upstream_errors_pass_through() -> None:
    async with gateway_with_upstream() as (url, _, _):
        r = await post(url, {"jsonrpc": "2.0", "method": "subtract", "params": [1], "id": 1})
        assert r.json()["error"]["code"] == -32602
        r = await post(url, {"jsonrpc": "2.0", "method": "echo",
                             "params": {"_meta": {"priority": "high"}}, "id": 2})
        assert r.json()["error"]["code"] == -32602
        assert "priority" in r.json()["error"]["data"]["detail"]
        r = await post(url, {"jsonrpc": "2.0", "method": "fail", "params": {"message": "no"},
                             "id": 3})
        assert r.json()["error"] == {"code": 1001, "message": "no", "data": {"why": "asked to"}}


async def test_meta_is_stripped_and_routes_rename_and_wildcard() -> None:
    async with gateway_with_upstream() as (url, _, _):
        r = await post(url, {"jsonrpc": "2.0", "method": "echo", "id": 1,
                             "params": {"a": 1, "_meta": {"priority": 3, "timeout_ms": 5000}}})
        assert r.json()["result"] == {"a": 1}
        r = await post(url, {"jsonrpc": "2.0", "method": "minus", "params": [5, 3], "id": 2})
        assert r.json()["result"] == 2
        r = await post(url, {"jsonrpc": "2.0", "method": "calc_subtract", "params": [9, 3],
                             "id": 3})
        assert r.json()["result"] == 6


async def test_upstream_http_failures_retry_then_report_status() -> None:
    state = UpstreamState(fail_next=[503, 503])
    async with gateway_with_upstream(state) as (url, state, gateway):
        async with Client(url) as client:
            assert await client.call("subtract", [3, 1]) == 2
            assert state.http_requests == 3
            state.fail_next = [503, 503, 503]
            with pytest.raises(RpcError) as err:
                await client.call("subtract", [3, 1])
            assert err.value.code == -32000 and err.value.data["upstream_status"] == 503
            # A 500 may have run the call: a non-idempotent one is not retried.
            state.fail_next = [500]
            before = state.http_requests
            with pytest.raises(RpcError) as err:
                await client.call("subtract", [3, 1])
            assert err.value.data["upstream_status"] == 500
            assert state.http_requests == before + 1
        text = gateway.metrics.render().decode()
        assert 'multiplexer_retries_total{provider="calc"} 4.0' in text


async def test_client_meta_cannot_make_an_unsafe_call_retry() -> None:
    """Only documented ``_meta`` keys steer the gateway: ``idempotent: true`` from a client is
    dropped, so a 500 (the call may have run) is not repeated and the side effect runs once."""
    state = UpstreamState()
    async with gateway_with_upstream(state) as (url, state, _):
        for meta in ({"idempotent": True}, {"idempotent": True, "mode": "batch", "tokens": 0}):
            state.fail_next = [500, 500]
            before = state.http_requests
            r = await post(url, {"jsonrpc": "2.0", "method": "subtract", "id": 1,
                                 "params": {"minuend": 3, "subtrahend": 1, "_meta": meta}})
            assert r.json()["error"]["data"]["upstream_status"] == 500
            assert state.http_requests == before + 1
        state.fail_next = []
        r = await post(url, {"jsonrpc": "2.0", "method": "echo", "id": 2,
                             "params": {"x": 1, "_meta": {"idempotent": True, "priority": 1}}})
        assert r.json()["result"] == {"x": 1}  # unknown keys neither reach upstream nor fail the call


async def test_retry_after_is_honoured() -> None:
    state = UpstreamState(fail_next=[429], retry_after="0.2")
    async with gateway_with_upstream(state) as (url, state, _), Client(url) as client:
        start = anyio.current_time()
        assert await client.call("subtract", [3, 1]) == 2
        assert anyio.current_time() - start >= 0.2
        assert state.http_requests == 2


async def test_unreachable_upstream_is_a_clear_error() -> None:
    from multiplexer.gateway.config import parse_config
    from multiplexer.server import running
    from tests.jsonrpc_helpers import calc_config

    config = parse_config(calc_config("http://127.0.0.1:9/"))
    async with running(config, port=0) as (_, url), Client(url) as client:
        with pytest.raises(RpcError) as err:
            await client.call("subtract", [1, 1])
        assert err.value.code == -32007 and err.value.data["provider"] == "calc"


async def test_array_rejecting_upstream_falls_back_to_single_requests() -> None:
    state = UpstreamState(reject_arrays=True)
    async with gateway_with_upstream(state) as (url, state, _), Client(url) as client:
        results = await client.call_many([("subtract", [i, 1]) for i in range(20)])
        assert results == [i - 1 for i in range(20)]
        assert state.batch_sizes and set(state.batch_sizes) == {1}


async def test_batches_go_upstream_as_one_array_and_match_out_of_order_replies() -> None:
    async with gateway_with_upstream(provider={"batch": {"max_items": 100, "max_wait_ms": 50}}) \
            as (url, state, _), Client(url) as client:
        results = await client.call_many([("subtract", [i, 0]) for i in range(300)])
        assert results == list(range(300))
        assert state.http_requests <= 6 and max(state.batch_sizes) == 100


async def test_missing_reply_fails_only_that_call() -> None:
    async with gateway_with_upstream(provider={"batch": {"max_items": 10, "max_wait_ms": 100,
                                                         "eager": False}}) \
            as (url, state, _), Client(url) as client:
        state.drop_ids = set(range(1, 10_000, 3))
        results = await client.call_many([("subtract", [i, 0]) for i in range(9)])
        failed = [r for r in results if isinstance(r, RpcError)]
        assert failed and all(e.code == -32000 for e in failed)
        assert all(r == i for i, r in enumerate(results) if not isinstance(r, RpcError))


async def test_deadline_ends_a_slow_call_and_others_go_on() -> None:
    state = UpstreamState(gate=anyio.Event())
    async with gateway_with_upstream(state, provider={"batch": {"max_items": 1}}) \
            as (url, state, _), Client(url) as client:
        with pytest.raises(RpcError) as err:
            await client.call("wait", {}, timeout_ms=2000)  # long enough to be running on a busy host
        assert err.value.code == -32001 and err.value.data["stage"] == "running"
        assert await client.call("subtract", [2, 1]) == 1
        state.gate.set()


async def test_dedup_shares_one_execution_for_identical_calls() -> None:
    async with gateway_with_upstream() as (url, state, gateway), Client(url) as client:
        results = await client.call_many([("sum", [1, 2, 3])] * 1000)
        assert results == [6] * 1000
        assert state.executions["sum"] < 1000
        text = gateway.metrics.render().decode()
        assert "multiplexer_dedup_hits_total" in text


async def test_full_queue_answers_overloaded_with_retry_after() -> None:
    state = UpstreamState(gate=anyio.Event())
    overrides = {"provider": {"batch": {"max_items": 1}, "limits": {"concurrency": 1,
                                                                    "max_queue": 5}}}
    async with gateway_with_upstream(state, **overrides) as (url, state, gateway), \
            Client(url) as client:
        results: list = []

        async def send() -> None:
            results.extend(await client.call_many([("wait", {"n": i}) for i in range(20)]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            rejected = gateway.metrics.rejections.labels("calc", "queue_full")
            with anyio.fail_after(10):
                while rejected._value.get() < 14:
                    await anyio.sleep(0.005)
            state.gate.set()
        refused = [r for r in results if isinstance(r, RpcError)]
        # one array: the first call leaves at once (an idle lane sends without a hop), five queue
        assert len(refused) == 14 and results.count("released") == 6
        assert [i for i, r in enumerate(results) if not isinstance(r, RpcError)] == list(range(6))
        assert all(e.code == -32002 and e.data["retry_after"] > 0 for e in refused)


async def test_healthz_and_metrics() -> None:
    async with gateway_with_upstream() as (url, _, _):
        import httpx

        async with httpx.AsyncClient() as http, Client(url) as client:
            await client.call("subtract", [1, 1])
            h = (await http.get(f"{url}/healthz")).json()
            assert h["status"] == "ok" and "calc" in h["lanes"]
            m = (await http.get(f"{url}/metrics")).text
            assert 'multiplexer_calls_total{outcome="ok",route="subtract"} 1.0' in m
            assert 'multiplexer_upstream_requests_total{provider="calc"}' in m
            assert "multiplexer_batch_size_bucket" in m
            assert "multiplexer_queue_depth" in m


async def test_httpx_transport_option_gives_the_same_answers() -> None:
    async with gateway_with_upstream(provider={"transport": "httpx"}) as (url, state, _), \
            Client(url) as client:
        assert await client.call_many([("subtract", [i, 1]) for i in range(50)]) == \
            [i - 1 for i in range(50)]
        state.fail_next = [503]
        assert await client.call("subtract", [3, 1]) == 2


async def test_metric_labels_stay_bounded_whatever_codes_upstreams_send() -> None:
    async with gateway_with_upstream() as (url, _, gateway), Client(url) as client:
        calls = [("fail", {"code": 5000 + i, "message": "own"}) for i in range(40)]
        results = await client.call_many([*calls, ("fail", {"code": -32602})])
        assert [r.code for r in results] == [5000 + i for i in range(40)] + [-32602]  # passed through
        text = gateway.metrics.render().decode()
    outcomes = {line.split('outcome="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith('multiplexer_calls_total{') and 'route="fail"' in line}
    assert outcomes == {"other", "-32602"}
    assert 'multiplexer_calls_total{outcome="other",route="fail"} 40.0' in text
