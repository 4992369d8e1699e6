"""Local classification on a tiny BERT built here: batched padded runs equal single runs."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import local_config, sentence, tiny_classifier

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")

TEXTS = [sentence(i, n) for i, n in enumerate([1, 4, 9, 30, 2, 17, 60, 6])]


@pytest.fixture(scope="module")
def clf_dir(tmp_path_factory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("clf"))


def clf_config(clf_dir: Path, **model: object):
    return local_config({"clf": {"source": str(clf_dir), "task": "classify", "device": "cpu", **model}},
                        {"classify": {"provider": "local", "model": "clf"}})


async def classify(gw: Gateway, value: object, **params: object) -> dict:
    outcome = await gw.submit(Call("classify", {"input": value, **params}))
    assert outcome.ok, outcome.error
    return outcome.result


async def test_batched_classification_equals_single_runs(clf_dir: Path) -> None:
    results: dict[int, dict] = {}
    async with Gateway(clf_config(clf_dir, max_wait_ms=50, max_padding=1.0)) as gw:  # mix lengths
        alone = [(await classify(gw, t))["data"][0] for t in TEXTS]
        listed = (await classify(gw, TEXTS))["data"]
        stats = gw.providers["local"].pool.stats("clf")
        before = stats.batches

        async def caller(i: int) -> None:
            results[i] = (await classify(gw, TEXTS[i]))["data"][0]

        async with anyio.create_task_group() as tg:
            for i in range(len(TEXTS)):
                tg.start_soon(caller, i)
    assert stats.batches - before < len(TEXTS)  # the concurrent callers shared passes
    for i, single in enumerate(alone):
        for other in (listed[i], results[i]):
            assert other["label"] == single["label"]
            for a, b in zip(other["scores"], single["scores"], strict=True):
                assert a["label"] == b["label"] and abs(a["score"] - b["score"]) < 1e-5


async def test_classification_shape_labels_and_top_k(clf_dir: Path) -> None:
    async with Gateway(clf_config(clf_dir)) as gw:
        result = await classify(gw, ["the cat", "a dog runs"], top_k=2)
        full = await classify(gw, "the cat")
    row = full["data"][0]
    assert full["object"] == "list" and full["model"] == "clf" and row["index"] == 0
    assert {s["label"] for s in row["scores"]} == {"calm", "busy", "odd"}
    assert abs(sum(s["score"] for s in row["scores"]) - 1.0) < 1e-5
    assert row["label"] == row["scores"][0]["label"]
    assert row["score"] == max(s["score"] for s in row["scores"])
    assert [len(d["scores"]) for d in result["data"]] == [2, 2]
    assert full["usage"]["prompt_tokens"] == 4  # [CLS] the cat [SEP]
