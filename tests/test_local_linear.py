"""CPU fp32 linear layers on oneDNN: the same answers as torch's BLAS, chosen by timing at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config, sentence, tiny_classifier

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")
onednn = pytest.importorskip("local_models.onednn")
if not onednn.usable(torch.device("cpu"), torch.float32):
    pytest.skip("this torch build has no oneDNN linear", allow_module_level=True)

TEXTS = ["hi", "a cat sat on the mat", sentence(1, 40), sentence(3, 120), sentence(4, 12), ""]


def embed_config(**model: object):
    return local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu", **model}},
                        {"embed_local": {"provider": "local", "model": "minilm"}})


async def run(config, method: str, texts: list[str]) -> tuple[list, str]:
    async with Gateway(config) as gw:
        outcome = await gw.submit(Call(method, {"input": texts}))
        assert outcome.ok, outcome.error
        handle = next(iter(gw.providers["local"].pool.handles.values()))
        return outcome.result["data"], handle.linear


@pytest.mark.parametrize("unpadded", [True, False])
async def test_onednn_embeddings_equal_torch_embeddings(unpadded: bool) -> None:
    """Both the packed (unpadded) and the padded forward: within 1e-5 of torch's own layers."""
    ref, used_ref = await run(embed_config(linear="torch", unpadded=unpadded), "embed_local", TEXTS)
    got, used = await run(embed_config(linear="onednn", unpadded=unpadded), "embed_local", TEXTS)
    assert (used_ref, used) == ("torch", "onednn")
    a = torch.tensor([d["embedding"] for d in ref])
    b = torch.tensor([d["embedding"] for d in got])
    assert a.shape == (len(TEXTS), 384)
    assert (a - b).abs().max().item() < 1e-5


async def test_onednn_batched_equals_single() -> None:
    """The guarantee every forward keeps: a text's vector does not depend on its batch mates."""
    async with Gateway(embed_config(linear="onednn")) as gw:
        together = await gw.submit(Call("embed_local", {"input": TEXTS}))
        alone = [await gw.submit(Call("embed_local", {"input": [t]})) for t in TEXTS]
    batched = torch.tensor([d["embedding"] for d in together.result["data"]])
    single = torch.tensor([o.result["data"][0]["embedding"] for o in alone])
    assert (batched - single).abs().max().item() < 1e-5


async def test_onednn_classification_equals_torch(tmp_path: Path) -> None:
    clf = tiny_classifier(tmp_path / "clf")

    def config(linear: str):
        model = {"source": str(clf), "task": "classify", "device": "cpu", "linear": linear}
        return local_config({"clf": model}, {"classify": {"provider": "local", "model": "clf"}})

    texts = [sentence(i, n) for i, n in enumerate([1, 4, 9, 30])]
    ref, _ = await run(config("torch"), "classify", texts)
    got, used = await run(config("onednn"), "classify", texts)
    assert used == "onednn"
    for r, g in zip(ref, got, strict=True):
        assert [s["label"] for s in r["scores"]] == [s["label"] for s in g["scores"]]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(r["scores"], g["scores"], strict=True)) < 1e-5


@pytest.mark.parametrize(("wins", "expected"), [(True, "onednn"), (False, "torch")])
async def test_auto_keeps_what_timed_faster(monkeypatch, wins: bool, expected: str) -> None:
    import local_models.pool as pool_module

    timed: list[int] = []

    def fake_faster(layer: torch.nn.Linear) -> tuple[bool, float]:
        timed.append(layer.weight.numel())
        return wins, 0.5 if wins else 1.2

    monkeypatch.setattr(pool_module, "faster", fake_faster)
    _, used = await run(embed_config(), "embed_local", ["one text"])
    assert used == expected
    assert timed == [384 * 1536]  # the widest layer (the feed-forward's), timed once


def test_onednn_copy_shares_every_weight_but_the_linear_ones() -> None:
    from local_models.onednn import OneDnnLinear, onednn_copy

    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    twin = onednn_copy(model)
    assert isinstance(twin[1], OneDnnLinear) and type(model[1]) is torch.nn.Linear  # the model is untouched
    assert twin[0].weight is model[0].weight and twin[2].weight is model[2].weight
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert (twin(x) - model(x)).abs().max().item() < 1e-5


def test_a_disagreeing_kernel_is_not_used(monkeypatch) -> None:
    """``faster`` checks the answers before the clock: a wrong kernel never wins on speed."""
    from local_models import onednn as module

    def wrong(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape[:-1], self.out_features)

    monkeypatch.setattr(module.OneDnnLinear, "forward", wrong)
    assert module.faster(torch.nn.Linear(64, 64)) == (False, 1.0)


def test_the_timing_pairs_its_runs_and_drops_bursts() -> None:
    """Each side's runs are paired with the other's, order alternating, and the median pair counts:
    a burst of load on a few runs of one side (a sibling process loading) does not flip the choice."""
    from local_models.onednn import time_ratio

    now = [0.0]
    runs: list[str] = []
    slow_a = {3, 7}  # the 3rd and 7th timed runs of ``a`` land in a burst

    def a() -> None:
        runs.append("a")
        n = runs.count("a") - 1  # the first call is untimed warm-up
        now[0] += 50.0 if n in slow_a else 1.0

    def b() -> None:
        runs.append("b")
        now[0] += 2.0

    assert time_ratio(a, b, pairs=9, clock=lambda: now[0]) == 0.5
    assert runs[:2] == ["a", "b"] and runs[2:6] == ["a", "b", "b", "a"]  # warm-up, then alternating pairs


def test_the_fused_gelu_is_the_exact_gelu_after_the_product() -> None:
    """The packed BERT forward's up-projection applies the erf gelu inside oneDNN's product: the
    values ``F.gelu`` gives after it, not the tanh approximation (which differs by about 1e-4)."""
    from local_models.onednn import OneDnnLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536)
    x = torch.randn(300, 384) * 2
    with torch.inference_mode():
        product = linear(x)
        exact, tanh = torch.nn.functional.gelu(product), torch.nn.functional.gelu(product, approximate="tanh")
        fused = OneDnnLinear(linear, gelu=True)(x)
    assert (fused - exact).abs().max().item() < 1e-5
    assert (tanh - exact).abs().max().item() > 1e-4  # the check above can tell the two apart


async def test_the_packed_forward_fuses_the_gelu_on_onednn() -> None:
    """With oneDNN's layers the packed forward runs no gelu of its own (that its embeddings equal
    torch's layers' is ``test_onednn_embeddings_equal_torch_embeddings``)."""
    from local_models.onednn import OneDnnLinear

    async with Gateway(embed_config(linear="onednn")) as gw:
        handle = gw.providers["local"].pool.handles["minilm"]
        await gw.providers["local"].pool.warm("minilm")
        layers = handle.packed.module.layers
        assert all(isinstance(layer["up"], OneDnnLinear) and layer["up"].post == "gelu" for layer in layers)
        assert all(isinstance(layer["act"], torch.nn.Identity) for layer in layers)
