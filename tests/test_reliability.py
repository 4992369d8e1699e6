"""Reliability proofs in small: fuzzed /rpc and /mcp, a fault soak, the fault upstream itself.

Small, fast versions of ``benchmarks/fuzz_rpc.py`` and ``benchmarks/soak_faults.py``
(the same generators, oracle and ledger) against a real gateway on 127.0.0.1, so
every CI run proves the invariants the big runs print figures for.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import yaml

from benchmarks import fuzz_rpc, soak_faults, soak_mcp
from benchmarks.fuzz_inputs import RPC_CLASSES, Case, Limits, RpcFuzzer
from benchmarks.fuzz_mcp import McpFuzzer
from benchmarks.fuzz_oracle import Owed, check_rpc, expect_rpc, id_key
from examples.fault_upstream import FAULTS, FaultState
from examples.fault_upstream import create_app as fault_app
from examples.jsonrpc_upstream import create_app as calc_app
from multiplexer.gateway.config import parse_config
from multiplexer.server import running
from tests.fakes.serve import serve_app
from tests.fuzz_budget import examples

RPC_CASES = examples(2000)

pytestmark = pytest.mark.anyio


def _config(text: str, **values: str) -> Any:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return parse_config(yaml.safe_load(text), env={"FUZZ_KEY": fuzz_rpc.KEY})


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_fuzzed_rpc_and_mcp_get_spec_shaped_replies_and_no_5xx(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with serve_app(calc_app()) as upstream:
        config = _config(fuzz_rpc.CONFIG, port="0", upstream=upstream.rsplit(":", 1)[1],
                         store=str(tmp_path / "store.db"))
        async with running(config, port=0) as (_, url):
            rpc, mcp = fuzz_rpc.Tally(), fuzz_rpc.Tally()
            await fuzz_rpc.fire(url, "/rpc", RpcFuzzer(11, fuzz_rpc.LIMITS, fuzz_rpc.KEY).case, RPC_CASES,
                                fuzz_rpc.rpc_check, 32, rpc)
            await fuzz_rpc.fire(url, "/mcp", McpFuzzer(11, fuzz_rpc.LIMITS, fuzz_rpc.KEY).case, examples(500),
                                fuzz_rpc.mcp_check, 16, mcp)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{url}/healthz")).status_code == 200
                metrics = await http.get(f"{url}/metrics",
                                         headers={"authorization": f"Bearer {fuzz_rpc.KEY}"})
    assert metrics.status_code == 200  # once, a method named "\ud800" broke /metrics for good
    assert metrics.text.count("multiplexer_calls_total{") < fuzz_rpc.MAX_SERIES  # not one per name
    for tally in (rpc, mcp):
        assert tally.total_violations == 0, tally.samples[:3]
        assert not any(s >= 500 or s == 0 for c in tally.statuses.values() for s in c)
    assert rpc.inputs == RPC_CASES and set(rpc.by_class) == set(RPC_CLASSES)  # every class was tried
    assert {401, 413, 204, 200} <= {s for c in rpc.statuses.values() for s in c}
    assert _errors(caplog) == []


async def test_lone_surrogates_round_trip_instead_of_a_500(tmp_path: Any) -> None:
    """Found by the fuzzer: ``"\\udc00"`` is valid JSON but not encodable as UTF-8; it broke the
    reply (HTTP 500), the dedup key (-32603) and, as a method name, /metrics (500 for good)."""
    async with serve_app(calc_app()) as upstream:
        config = _config(fuzz_rpc.CONFIG.replace('api_keys: {fuzz: "${FUZZ_KEY}"}', ""), port="0",
                         upstream=upstream.rsplit(":", 1)[1], store=str(tmp_path / "s.db"))
        async with running(config, port=0) as (_, url), httpx.AsyncClient() as http:
            body = b'[{"jsonrpc":"2.0","method":"echo","params":["\\ud83d"],"id":"\\udc00"},' \
                   b'{"jsonrpc":"2.0","method":"nope\\ud800","id":2},' \
                   b'{"jsonrpc":"2.0","method":"sum","params":["\\ud800"],"id":3}]'
            r = await http.post(f"{url}/rpc", content=body)
            metrics = await http.get(f"{url}/metrics")
    assert r.status_code == 200 and metrics.status_code == 200
    assert "nope" not in metrics.text  # metrics are labelled by route, not by client strings
    one, two, three = r.json()
    assert one == {"jsonrpc": "2.0", "result": ["\ud83d"], "id": "\udc00"}
    assert two["id"] == 2 and two["error"]["code"] == -32601
    assert three["id"] == 3 and three["error"]["code"] == -32602  # the upstream's verdict, not ours


def test_the_oracle_catches_wrong_replies() -> None:
    """The fuzz oracle must fail a lost, duplicated, renamed or mis-shaped answer."""
    case = Case(0, "valid", b'[{"jsonrpc":"2.0","method":"m","id":1},{"jsonrpc":"2.0","method":"m","id":2},'
                            b'{"jsonrpc":"2.0","method":"m"},7]', {"authorization": "Bearer k"})
    owed = expect_rpc(case, Limits(), "k")
    assert owed == Owed("batch", ids=[(id_key(1), None), (id_key(2), None), (id_key(None), -32600)])
    ok = (b'[{"jsonrpc":"2.0","result":1,"id":2},{"jsonrpc":"2.0","result":0,"id":1},'
          b'{"jsonrpc":"2.0","error":{"code":-32600,"message":"x"},"id":null}]')
    assert check_rpc(owed, 200, "application/json", ok)[1] == []
    for bad in (ok.replace(b'"id":2', b'"id":1'), ok.replace(b'"id":2', b'"id":"2"'),
                ok.replace(b'"result":1,', b''), ok.replace(b'-32600', b'-32601'),
                ok.replace(b',{"jsonrpc":"2.0","result":0,"id":1}', b'')):
        assert check_rpc(owed, 200, "application/json", bad)[1], bad
    assert check_rpc(owed, 500, "text/plain", b"oops")[1] == ["HTTP 500"]
    unauth = Case(1, "bad_auth", b"{}", {"authorization": "Bearer nope"})
    assert expect_rpc(unauth, Limits(), "k").status == 401


async def test_fault_soak_answers_every_call_once_without_duplicate_side_effects() -> None:
    state = FaultState(rate=0.2, seed=5, hang_s=1.0, slow_s=0.5, retry_after="0.01")
    async with serve_app(fault_app(state)) as upstream:
        config = _config(soak_faults.CONFIG, port="0", upstream=upstream.rsplit(":", 1)[1])
        async with running(config, port=0) as (gateway, url):
            baseline, faulty, audit = await soak_faults.soak(url, state, 2000, 200, 50, 8, seed=5)
            metrics = gateway.metrics.render().decode()
    for ledger in (baseline, faulty):
        assert ledger.missing == ledger.duplicate_answers == ledger.unexpected_answers == 0
        assert ledger.wrong_token == 0 and not ledger.http_failures
        assert ledger.answered == ledger.calls
    assert baseline.outcomes["ok"] == baseline.calls, baseline.outcomes  # no faults, no failures
    assert audit["duplicate_executions_non_idempotent"] == 0
    assert audit["ok_without_execution"] == 0
    assert set(state.faults) == set(FAULTS)  # every way of failing was exercised
    assert faulty.outcomes["ok"] > faulty.calls // 2 and len(faulty.outcomes) > 2
    retries = soak_faults.metric_sum(metrics, "multiplexer_retries_total")
    assert retries > 0


async def test_mcp_crash_soak_answers_every_call_once_and_never_repeats_a_side_effect() -> None:
    """The stdio upstream is SIGKILLed every 150 answers; read-only calls retry, side effects never."""
    r = await soak_mcp.soak(calls=600, kill_every=150, batch=20, workers=6)
    assert r["kills"] >= 3 and r["connects"] >= 3  # the child really died and came back
    assert r["answered_once"] == r["calls"] and r["missing"] == r["duplicates"] == r["unknown_ids"] == 0
    assert r["wrong_token"] == 0 and r["undocumented_errors"] == 0
    assert r["records_run_twice"] == 0 and r["ok_records_not_run_once"] == 0
    assert r["ok"]["echo"] >= 290  # read-only: caught by a crash, sent again (once)
    assert r["errors"].get("-32007", 0) >= 1  # side effects caught in flight: reported, not repeated
    assert sum(r["ok"].values()) + sum(r["errors"].values()) == 600


N = 5
TWO = [{"jsonrpc": "2.0", "method": "act", "params": {"token": "a"}, "id": 1},
       {"jsonrpc": "2.0", "method": "act", "params": {"token": "b"}, "id": 2}]


@pytest.mark.parametrize("kind", FAULTS)
async def test_each_injected_fault_is_the_real_thing(kind: str) -> None:
    state = FaultState(rate=1.0, kinds=(kind,), hang_s=0.6, slow_s=0.05)
    # a short client timeout only where the fault is the hang: on a loaded host a plain reply
    # can take longer than 0.3 s, and would read as a timeout
    timeout = 0.3 if kind == "timeout" else 30.0
    async with serve_app(fault_app(state)) as url, httpx.AsyncClient(timeout=timeout) as http:
        replies: list[Any] = []
        for _ in range(N):
            try:
                replies.append(await http.post(f"{url}/", json=TWO))
            except httpx.HTTPError as e:
                replies.append(e)
        await state.quiet()
    first = replies[0]
    ran = sum(state.executions.values())
    if kind in ("429_retry_after", "429", "503"):
        assert all(r.status_code == int(kind[:3]) for r in replies) and ran == 0
        assert all(("retry-after" in r.headers) == (kind == "429_retry_after") for r in replies)
    elif kind in ("500", "502"):
        assert all(r.status_code == int(kind) for r in replies) and ran == 2 * N
    elif kind == "timeout":
        assert all(isinstance(r, httpx.ReadTimeout) for r in replies) and ran == 2 * N
    elif kind == "reset":
        assert all(isinstance(r, httpx.ReadError | httpx.RemoteProtocolError) for r in replies)
        assert 0 < ran < 2 * N  # before or after running, at random
    elif kind == "malformed":
        assert all(r.status_code == 200 for r in replies) and ran == 2 * N
        assert not any(_good_batch(r) for r in replies)
    elif kind == "partial":
        assert ran == 2 * N and not all(_good_batch(r) for r in replies)
        assert all(isinstance(r.json(), list) for r in replies)
    else:  # slow, but right
        assert all(_good_batch(r) for r in replies) and first.elapsed.total_seconds() >= 0.05


def _good_batch(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, list) and sorted(
        (x.get("id"), (x.get("result") or {}).get("token")) for x in body if isinstance(x, dict)
    ) == [(1, "a"), (2, "b")]
