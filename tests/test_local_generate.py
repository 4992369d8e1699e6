"""Local generation: continuous batching gives exactly the one-at-a-time tokens; sampling, stops, limits."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import local_config, record_handoffs, sentence, tiny_causal_lm

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")

PROMPTS = [(3, 5), (9, 20), (1, 8), (17, 3), (5, 30), (12, 12), (2, 25)]  # (prompt words, max_new_tokens)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def lm_dir(request, tmp_path_factory) -> Path:
    return tiny_causal_lm(tmp_path_factory.mktemp(request.param), request.param)


def gen_config(lm_dir: Path, **model: object):
    return local_config({"lm": {"source": str(lm_dir), "task": "generate", "device": "cpu", **model}},
                        {"generate": {"provider": "local", "model": "lm"}})


async def complete(gw: Gateway, prompt: object, **params: object) -> dict:
    outcome = await gw.submit(Call("generate", {"prompt": prompt, **params}))
    assert outcome.ok, outcome.error
    return outcome.result


async def test_batched_greedy_with_mixed_lengths_equals_one_at_a_time(lm_dir: Path) -> None:
    results: dict[int, list[int]] = {}
    async with Gateway(gen_config(lm_dir, dtype="float64")) as gw:
        alone = [(await complete(gw, sentence(i, w), max_new_tokens=n))["choices"][0]["token_ids"]
                 for i, (w, n) in enumerate(PROMPTS)]
        engine = gw.providers["local"].pool.handles["lm"].engine
        widest: list[int] = []
        engine.listeners.append(lambda e: widest.append(len(e.running)))

        async def caller(i: int, words: int, new: int) -> None:
            result = await complete(gw, sentence(i, words), max_new_tokens=new)
            results[i] = result["choices"][0]["token_ids"]

        async with anyio.create_task_group() as tg:
            for i, (w, n) in enumerate(PROMPTS):
                tg.start_soon(caller, i, w, n)
    assert [results[i] for i in range(len(PROMPTS))] == alone
    assert max(widest) > 1  # they really shared decoding steps
    assert len({tuple(t) for t in alone}) > 1


async def test_one_at_a_time_matches_transformers_generate(lm_dir: Path) -> None:
    async with Gateway(gen_config(lm_dir)) as gw:
        handle = gw.providers["local"].pool.handles["lm"]
        for i, (w, n) in enumerate(PROMPTS[:4]):
            ours = (await complete(gw, sentence(i, w), max_new_tokens=n))["choices"][0]["token_ids"]
            ids = handle.loaded.tokenizer(sentence(i, w))["input_ids"]
            out = handle.loaded.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n, do_sample=False, pad_token_id=0,
            )[0, len(ids):].tolist()
            eos = handle.loaded.tokenizer.eos_token_id
            assert ours == (out[: out.index(eos)] if eos in out else out)


async def test_a_short_request_joins_and_leaves_while_a_long_one_runs(lm_dir: Path) -> None:
    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec
    from local_models.tasks.generate import GenRequest

    async with LocalPool({"lm": ModelSpec(source=str(lm_dir), task="generate", device="cpu",
                                          dtype="float64")}) as pool:
        handle = await pool.ready("lm")
        tok = handle.loaded.tokenizer
        long_ids, short_ids = tok(sentence(1, 6))["input_ids"], tok(sentence(2, 15))["input_ids"]
        [long_alone] = await pool.generate("lm", [GenRequest(long_ids, 60)])
        [short_alone] = await pool.generate("lm", [GenRequest(short_ids, 3)])

        engine = handle.engine
        long_req, short_req = GenRequest(long_ids, 60), GenRequest(short_ids, 3)
        started, rows = anyio.Event(), []

        def on_step(e) -> None:
            rows.append(len(e.running))
            if len(long_req.tokens) >= 5:
                started.set()

        engine.listeners.append(on_step)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.generate, "lm", [long_req])
            await started.wait()
            await pool.generate("lm", [short_req])
            assert long_req.finish_reason is None and len(long_req.tokens) < 60  # still running
        engine.listeners.remove(on_step)
    assert 2 in rows
    assert short_req.tokens == short_alone.tokens and long_req.tokens == long_alone.tokens
    # as it ends alone: at its 60 tokens, or at an end-of-text the tiny model may reach first (the
    # trained tokenizer orders words of equal count differently from one process to the next)
    assert long_req.finish_reason == long_alone.finish_reason
    assert long_req.finish_reason == "stop" or len(long_req.tokens) == 60


async def test_sampling_with_a_seed_is_reproducible_alone_or_batched(lm_dir: Path) -> None:
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9}
    async with Gateway(gen_config(lm_dir)) as gw:
        first = await complete(gw, "the cat", seed=7, **params)
        again = await complete(gw, "the cat", seed=7, **params)
        together = await complete(gw, ["the cat", "a dog runs"], seed=7, **params)
        others = [await complete(gw, "the cat", seed=s, **params) for s in range(8, 12)]
    tokens = first["choices"][0]["token_ids"]
    assert again["choices"][0]["token_ids"] == tokens == together["choices"][0]["token_ids"]
    assert any(o["choices"][0]["token_ids"] != tokens for o in others)


async def test_stop_strings_and_max_new_tokens(lm_dir: Path) -> None:
    sampled = {"max_new_tokens": 16, "temperature": 1.0}
    async with Gateway(gen_config(lm_dir)) as gw:
        for seed in range(20):  # a seeded draw whose text has a word that is not its first
            full = await complete(gw, "the big cloud", seed=seed, **sampled)
            text = full["choices"][0]["text"]
            later = [w for w in text.split() if text.find(w) > 0]
            if later:
                break
        stop = later[0]
        cut = await complete(gw, "the big cloud", seed=seed, stop=[stop, "never there"], **sampled)
        short = await complete(gw, "the big cloud", max_tokens=4)
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert short["choices"][0]["finish_reason"] in ("length", "stop")
    assert len(short["choices"][0]["token_ids"]) <= 4
    assert full["object"] == "text_completion"
    assert full["usage"]["completion_tokens"] == len(full["choices"][0]["token_ids"])
    usage = full["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_long_prompts_are_refused_unless_truncated(lm_dir: Path) -> None:
    async with Gateway(gen_config(lm_dir)) as gw:
        refused = await gw.submit(Call("generate", {"prompt": sentence(1, 200), "max_new_tokens": 2}))
        cut = await complete(gw, sentence(1, 200), max_new_tokens=2, truncate=True)
        bad = await gw.submit(Call("generate", {"prompt": "x", "temperature": -1}))
    assert refused.error is not None and refused.error.code == -32602
    assert refused.error.data["max_tokens"] == 127
    assert cut["usage"]["prompt_tokens"] == 127
    assert bad.error is not None and bad.error.code == -32602


async def test_a_caller_that_gives_up_leaves_the_running_batch(lm_dir: Path) -> None:
    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec
    from local_models.tasks.generate import GenRequest

    async with LocalPool({"lm": ModelSpec(source=str(lm_dir), task="generate", device="cpu")}) as pool:
        handle = await pool.ready("lm")
        engine = handle.engine
        ids = handle.loaded.tokenizer("the cat")["input_ids"]
        req = GenRequest(ids, 100)
        running, emptied = anyio.Event(), anyio.Event()

        def on_step(e) -> None:
            if e.running:
                running.set()
            elif running.is_set():
                emptied.set()

        engine.listeners.append(on_step)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.generate, "lm", [req])
            await running.wait()
            tg.cancel_scope.cancel()
        await emptied.wait()
    assert req.cancelled and req.finish_reason == "cancelled" and len(req.tokens) < 100


async def test_the_next_step_is_on_its_thread_before_the_work_a_step_released_runs(lm_dir: Path) -> None:
    """A step's chunks go to streams whose writers then wait on the event loop: the next step is
    handed to its thread first, so the model does not wait while they are written."""
    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec
    from local_models.tasks.generate import GenRequest

    async with LocalPool({"lm": ModelSpec(source=str(lm_dir), task="generate", device="cpu")}) as pool:
        handle = await pool.ready("lm")
        ids = handle.loaded.tokenizer(sentence(1, 6))["input_ids"]
        order: list[str] = []
        record_handoffs(pool._threads, order, "step handed")

        async def writer() -> None:
            order.append("writer ran")

        async with anyio.create_task_group() as tg:
            handle.engine.listeners.append(lambda e: tg.start_soon(writer))
            await pool.generate("lm", [GenRequest(ids, 4)])
        assert order[:4] == ["step handed", "step handed", "writer ran", "step handed"]
