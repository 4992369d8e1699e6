"""Out-of-memory handling, by injecting the error: split and retry, CPU fallback, lower budget, visible."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest

from multiplexer.core.call import Call
from multiplexer.server import running
from tests.local_helpers import MINILM, local_config, sentence, tiny_causal_lm

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")

from local_models.devices import is_oom, run_resilient  # noqa: E402


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_split_then_retry_keeps_row_order() -> None:
    calls, events = [], []

    def primary(rows):
        calls.append(list(rows))
        if len(rows) > 2:
            raise oom()
        return [r * 10 for r in rows]

    out = run_resilient(list(range(7)), primary, None, cost=len, on_event=lambda e, c: events.append((e, c)))
    assert out == [r * 10 for r in range(7)]
    assert events[0] == ("oom_split", 7) and {e for e, _ in events} == {"oom_split"}
    fitted = [c for c in calls if len(c) <= 2]
    assert [r for c in fitted for r in c] == list(range(7))  # every row ran once, in halves


def test_a_row_that_never_fits_runs_on_the_fallback() -> None:
    events = []

    def primary(rows):
        raise RuntimeError("CUDA error: out of memory")

    out = run_resilient([1, 2, 3], primary, lambda rows: [-r for r in rows], cost=len,
                        on_event=lambda e, c: events.append(e))
    assert out == [-1, -2, -3]
    assert events.count("oom_cpu_fallback") == 3 and events.count("oom_split") == 2


def test_without_a_fallback_the_error_surfaces_and_other_errors_are_not_retried() -> None:
    with pytest.raises(torch.OutOfMemoryError):
        run_resilient([1], lambda rows: (_ for _ in ()).throw(oom()), None, cost=len,
                      on_event=lambda e, c: None)
    tried = []

    def broken(rows):
        tried.append(rows)
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        run_resilient([1, 2], broken, None, cost=len, on_event=lambda e, c: None)
    assert len(tried) == 1
    assert is_oom(oom()) and is_oom(RuntimeError("MPS backend out of memory")) and not is_oom(ValueError())


def minilm_config():
    return local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu"}},
                        {"embed_local": {"provider": "local", "model": "minilm"}})


async def metric(url: str, event: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("multiplexer_events_total") and f'event="{event}"' in line and "local" in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("mode", ["split", "fallback"])
async def test_injected_oom_is_survived_and_visible(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    texts = [sentence(i, n) for i, n in enumerate([3, 40, 8, 12, 80, 5, 20, 2])]
    async with running(minilm_config(), port=0) as (gw, url):
        clean = await gw.submit(Call("embed_local", {"input": texts}))
        handle = gw.providers["local"].pool.handles["minilm"]
        original, budget = handle.forward, handle.budget.max_tokens
        handle.fallback_device = torch.device("cpu")  # as on a GPU host
        ran: list[tuple[str, int]] = []

        def injected(rows, on):
            if on == "primary" and (mode == "fallback" or len(rows) > 2):
                raise oom()
            ran.append((on, len(rows)))  # passes that fitted
            return original(rows, on)

        handle.forward = injected
        with caplog.at_level(logging.WARNING, logger="local_models.pool"):
            hurt = await gw.submit(Call("embed_local", {"input": texts}))
        assert hurt.ok, hurt.error
        for a, b in zip(hurt.result["data"], clean.result["data"], strict=True):
            assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"], strict=True)) < 1e-5
        assert await metric(url, "oom_split") >= 1
        assert await metric(url, "budget_lowered") >= 1
        assert handle.budget.max_tokens < budget
        assert "oom_split" in caplog.text and "budget lowered" in caplog.text
        if mode == "fallback":
            assert await metric(url, "oom_cpu_fallback") == len(texts)
            assert sum(n for on, n in ran if on == "fallback") == len(texts)
        else:
            assert await metric(url, "oom_cpu_fallback") == 0
            assert all(n <= 2 for on, n in ran if on == "primary")
        assert await metric(url, "model_loaded") == 1


class FlakyModel:
    """Wraps a causal LM: prefills of several rows never fit; one decode step with 3+ rows does not."""

    def __init__(self, model) -> None:
        self.model, self.forward, self.config = model, model.forward, model.config
        self.decode_failed = False

    def __call__(self, **kw):
        decoding = kw["input_ids"].shape[1] == 1 and ("cache" in kw or "past_key_values" in kw)
        rows = kw["input_ids"].shape[0]
        if not decoding and rows > 1:
            raise oom()
        if decoding and rows >= 3 and not self.decode_failed:
            self.decode_failed = True
            raise oom()
        return self.model(**kw)


async def test_generation_splits_prefills_and_preempts_on_oom(tmp_path: Path) -> None:
    import anyio

    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec
    from local_models.tasks.generate import GenRequest

    lm = tiny_causal_lm(tmp_path / "lm")
    events: list[str] = []
    spec = ModelSpec(source=str(lm), task="generate", device="cpu", dtype="float64")
    async with LocalPool({"lm": spec}, on_event=lambda m, e: events.append(e)) as pool:
        handle = await pool.ready("lm")
        tok = handle.loaded.tokenizer
        prompts = [tok(sentence(i, n))["input_ids"] for i, n in enumerate([3, 8, 1, 12, 5])]
        alone = [(await pool.generate("lm", [GenRequest(p, 10)]))[0].tokens for p in prompts]
        handle.engine.model = FlakyModel(handle.engine.model)
        reqs = [GenRequest(p, 10) for p in prompts]
        with anyio.fail_after(30):
            await pool.generate("lm", reqs)
    assert [r.tokens for r in reqs] == alone
    assert all(r.finish_reason in ("length", "stop") for r in reqs)
    assert "oom_split" in events and "oom_preempt" in events and "budget_lowered" in events


def test_budget_halves_on_oom_and_is_won_back_below_the_failure_then_probed_past() -> None:
    from local_models.budget import BudgetControl

    c = BudgetControl(configured=16000, current=16000, recover_after=3)
    assert c.failed(10000) == 5000 and c.current == 5000
    assert c.failed(12000) is None and c.ceiling == 10000  # already under it; the smaller failure counts
    assert [c.passed(2000) for _ in range(5)] == [None] * 5  # under half the budget: no evidence
    assert [c.passed(4000) for _ in range(3)] == [None, None, 6250]
    steps = [c.passed(c.current) for _ in range(9)]
    assert [s for s in steps if s is not None] == [7812, 9765, 9999]  # never back to the size that failed
    assert [c.passed(9999) for _ in range(3)] == [None, None, None] and c.ceiling is None
    assert [c.passed(9999) for _ in range(3)][-1] == 12498  # a clean streak right under it: probe past
    assert c.failed(12498) == 6249 and c.ceiling == 12498 and c.clean == 0  # a new OOM starts over
    seen = [c.passed(c.current) for _ in range(60)]
    assert 12497 in seen and c.current == 16000  # under the new failure first, then all the way back
    top = BudgetControl(configured=16000, current=16000, recover_after=1)
    assert top.passed(16000) is None and top.current == 16000  # at the configured budget: nothing to do


async def test_the_pool_wins_its_budget_back_after_passing_memory_pressure() -> None:
    texts = [sentence(i, 30) for i in range(16)]
    async with running(minilm_config(), port=0) as (gw, url):
        handle = gw.providers["local"].pool.handles["minilm"]
        await gw.submit(Call("embed_local", {"input": texts[:1]}))
        configured = handle.budget.max_tokens
        original = handle.forward
        handle.control.recover_after = 3  # more than the two halves of the batch that fails
        pressure = True
        heard: list[tuple[str, int]] = []
        gw.listeners.append(lambda event, data: heard.append((event, threading.get_ident())))

        def injected(rows, on):  # while under pressure, memory for at most 8 of these rows
            if on == "primary" and pressure and len(rows) > 8:
                raise oom()
            return original(rows, on)

        handle.forward = injected
        assert (await gw.submit(Call("embed_local", {"input": texts}))).ok
        failed, lowered = handle.control.ceiling, handle.budget.max_tokens
        assert failed is not None and lowered == failed // 2 < configured
        pressure = False
        budgets = []
        for _ in range(40):
            outcome = await gw.submit(Call("embed_local", {"input": texts}))
            assert outcome.ok, outcome.error
            budgets.append(handle.budget.max_tokens)
        assert budgets == sorted(budgets) and budgets[-1] > failed  # crept back up, then past the failure
        assert budgets[-1] < 4 * failed  # and stops where passes no longer fill it (no evidence)
        assert budgets[-1] == budgets[-10]
        assert await metric(url, "budget_raised") >= 3 and await metric(url, "budget_lowered") == 1
        assert {"local.oom_split", "local.budget_lowered", "local.budget_raised"} <= {e for e, _ in heard}
        assert {thread for _, thread in heard} == {threading.get_ident()}  # on the event loop, not a worker
