"""``backend: onnx``: the same weights exported at load time and run by ONNX Runtime, fp32 and int8."""

from __future__ import annotations

import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.config import ConfigError
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config, sentence, tiny_classifier

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

TEXTS = ["hi", "a cat sat on the mat", sentence(1, 40), "Ünïcödé and emoji 🚀", sentence(3, 120), "",
         "The gateway batches calls from many clients into few upstream requests."]


def config(source: str = MINILM, task: str = "embed", route: str = "embed_local", **model: object):
    return local_config({"m": {"source": source, "task": task, "device": "cpu", "backend": "onnx", **model}},
                        {route: {"provider": "local", "model": "m"}})


async def vectors(gw: Gateway, value: object) -> torch.Tensor:
    outcome = await gw.submit(Call("embed_local", {"input": value}))
    assert outcome.ok, outcome.error
    return torch.tensor([d["embedding"] for d in outcome.result["data"]])


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    from local_models.sources import resolve_source

    return SentenceTransformer(str(resolve_source(MINILM)), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model) -> torch.Tensor:
    return torch.tensor(st_model.encode(TEXTS, batch_size=32))


@pytest.mark.parametrize(("quantize", "floor"), [(None, 0.9999), ("int8", 0.99)])
async def test_onnx_embeddings_agree_with_sentence_transformers_batched_or_single(
        reference, quantize, floor) -> None:
    async with Gateway(config(quantize=quantize)) as gw:
        handle = await gw.providers["local"].pool.ready("m")
        assert handle.onnx_model is not None and handle.packed is None and handle.compile_plan() == "never"
        assert not handle.loaded.model.training  # the shared torch model is left as it was
        batched = await vectors(gw, TEXTS)
        singles = torch.cat([await vectors(gw, t) for t in TEXTS])
    cosine = torch.nn.functional.cosine_similarity(batched, reference, dim=1)
    assert cosine.min().item() >= floor
    if quantize is None:
        assert cosine.min().item() < 1.0 + 1e-6
    if quantize is None:
        assert (batched - singles).abs().max().item() < 1e-5
    else:  # dynamic int8 scales activations per batch: a text's vector moves with its batchmates,
        # so alone or batched, each must still meet the floor against sentence-transformers
        alone = torch.nn.functional.cosine_similarity(singles, reference, dim=1)
        assert alone.min().item() >= floor


async def test_int8_worst_cosine_on_bench_texts_is_at_least_099(st_model) -> None:
    from benchmarks.bench_local import make_texts

    texts = make_texts(96, seed=11)  # 3 to 120 words, as the bench sends
    async with Gateway(config(quantize="int8")) as gw:
        ours = await vectors(gw, texts)
    reference = torch.tensor(st_model.encode(texts, batch_size=32))
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=1).min().item() >= 0.99


def test_int8_graph_splits_feed_forward_outliers_exactly_and_the_same_every_time(st_model, tmp_path) -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort

    from local_models.onnx_backend import eager_copy, export
    from local_models.onnx_int8 import calibration_rows, channel_peaks, plan, quantize_int8, split_outliers

    fp32 = tmp_path / "model.onnx"
    export(eager_copy(st_model[0].auto_model), fp32)
    model = onnx.load(str(fp32))
    quantised, split = plan(model.graph)
    assert len(quantised) == 30 and len(split) == 12  # 6 layers: q, k, attention output, 2 feed-forward
    assert not any("value" in n for n in quantised)

    def tokenize(text: str) -> list[int]:
        return st_model.tokenizer(text)["input_ids"]

    inputs = sorted({n.input[0] for n in model.graph.node if n.name in split})
    split_outliers(model, split, channel_peaks(fp32, inputs, calibration_rows(tokenize)))
    ids = np.asarray([tokenize(sentence(2, 60))], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    cpu = ["CPUExecutionProvider"]
    before = ort.InferenceSession(str(fp32), providers=cpu).run(None, feeds)[0]
    after = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, feeds)[0]
    assert np.abs(before - after).max() < 1e-4  # the split alone changes nothing but rounding

    built = []
    for i in range(2):
        quantize_int8(fp32, tmp_path / f"int8-{i}.onnx", tokenize)
        built.append((tmp_path / f"int8-{i}.onnx").read_bytes())
    assert built[0] == built[1]


async def test_onnx_classifier_gives_the_torch_scores(tmp_path) -> None:
    source = str(tiny_classifier(tmp_path))
    texts = [sentence(i, n) for i, n in enumerate((2, 9, 4, 15))]
    scores = []
    for backend in ("torch", "onnx"):
        async with Gateway(config(source, "classify", "classify", backend=backend)) as gw:
            outcome = await gw.submit(Call("classify", {"input": texts}))
        assert outcome.ok, outcome.error
        scores.append([[s["score"] for s in row["scores"]] for row in outcome.result["data"]])
    assert torch.tensor(scores[0]).sub(torch.tensor(scores[1])).abs().max().item() < 1e-5


@pytest.mark.parametrize(("model", "message"), [
    ({"task": "generate"}, "not generate"),
    ({"dtype": "bfloat16"}, "runs in float32"),
    ({"backend": "torch", "quantize": "int8"}, "quantize needs backend: onnx"),
])
def test_settings_onnx_cannot_honour_are_refused_at_load(model, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**model)


async def test_without_onnxruntime_the_model_fails_its_calls_with_the_reason(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_ort(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ort)
    async with Gateway(config(quantize="int8", max_batch_size=7)) as gw:
        outcome = await gw.submit(Call("embed_local", {"input": "x"}))
    assert outcome.error is not None and outcome.error.code == -32007
    assert "pip install 'multiplexer[onnx]'" in outcome.error.data["detail"]
