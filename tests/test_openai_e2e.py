"""The contract config end to end: gateway over HTTP in front of the fake OpenAI and Anthropic servers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from multiplexer.core.errors import Code, RpcError
from multiplexer.gateway.config import parse_config
from multiplexer.sdk.client import Client
from multiplexer.server import running
from tests.fakes.openai_fake import embed_text
from tests.remote_helpers import fakes, remote_config_data, reply_text, user

pytestmark = pytest.mark.anyio
EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "remote.example.yaml"



async def test_the_example_config_works_as_written(tmp_path):
    """Packed embeddings come back one object per caller; chat and claude answer; batch mode too."""
    data = yaml.safe_load(EXAMPLE.read_text())
    async with fakes() as f:
        data["providers"]["oai"]["base_url"] = f.openai_url + "/v1"
        data["providers"]["claude"]["base_url"] = f.anthropic_url
        data["providers"]["oai"]["batch_poll_interval_s"] = 0.01
        data["routes"]["chat_batch"]["batch"]["max_wait_ms"] = 50
        data["store"]["path"] = str(tmp_path / "jobs.db")
        async with running(parse_config(data, env={}), port=0) as (_, url), Client(url) as client:
            texts = [f"some text {i}" for i in range(256)]
            results = await client.call_many([("embed", {"input": t}) for t in texts])
            for text, result in zip(texts, results, strict=True):
                assert result["object"] == "list" and len(result["data"]) == 1
                assert result["data"][0]["index"] == 0
                assert result["data"][0]["embedding"] == pytest.approx(embed_text(text))
                assert result["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
                assert result["model"] == "text-embedding-3-small"
            assert sum(f.openai.embedding_batch_sizes) == 256
            assert len(f.openai.embedding_batch_sizes) <= 3  # packed, not 256 requests

            answer = await client.call("chat", {"model": "gpt-test", **user("hello")})
            assert reply_text(answer) == "echo: hello"
            answer = await client.call("claude", {"model": "claude-test", "max_tokens": 8,
                                                  **user("bonjour")})
            assert reply_text(answer) == "echo: bonjour"

            prompts = [f"question {i}" for i in range(40)]
            answers = await client.call_many(
                [("chat_batch", {"model": "gpt-test", **user(p)}) for p in prompts])
            assert [reply_text(a) for a in answers] == [f"echo: {p}" for p in prompts]
            assert [len(b.items) for b in f.openai.batches.values()] == [40]  # one job


async def test_chat_concurrency_rate_limit_headers_and_429(tmp_path):
    async with fakes(retry_after_s=0) as f:
        f.openai.limiter.requests_per_window = 777
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (gateway, url), Client(url) as client:
            results = await client.call_many(
                [("chat", {"model": "gpt-test", **user(f"q{i}")}) for i in range(30)])
            assert [reply_text(r) for r in results] == [f"echo: q{i}" for i in range(30)]
            assert f.openai.requests["/v1/chat/completions"] == 30
            learned = gateway.limiters["oai"].requests
            assert learned is not None and learned.capacity == 777

            f.openai.fail_next = [429, 503]
            assert reply_text(await client.call("chat", {"model": "gpt-test", **user("again")})) == \
                "echo: again"
            assert f.openai.statuses[429] == 1 and f.openai.statuses[503] == 1

            f.anthropic.fail_next = [529]
            assert reply_text(await client.call("claude", user("busy"))) == "echo: busy"
            assert f.anthropic.statuses[529] == 1
            assert gateway.limiters["claude"].requests.capacity == f.anthropic.limiter.requests_per_window

            f.openai.fail_next = [401]
            with pytest.raises(RpcError) as e:
                await client.call("chat", {"model": "gpt-test", **user("x")})
            assert e.value.code == Code.UPSTREAM_ERROR and e.value.data["upstream_status"] == 401


async def test_upstream_validation_errors_reach_only_their_caller(tmp_path):
    async with fakes() as f:
        config = parse_config(remote_config_data(f, tmp_path))
        async with running(config, port=0) as (_, url), Client(url) as client:
            results = await client.call_many([
                ("chat", {"model": "gpt-test", **user("fine")}),
                ("chat", {"model": "gpt-test", **user("please FAIL")}),
                ("chat", user("no model")),
                ("embed", {"input": ""}),
                ("claude", user("FAIL here")),
            ])
    assert reply_text(results[0]) == "echo: fine"
    assert results[1].data["upstream_status"] == 400
    assert results[2].code == Code.INVALID_PARAMS and results[2].data["param"] == "model"
    assert results[3].code == Code.INVALID_PARAMS
    assert results[4].data["upstream_status"] == 400 and "FAIL" in results[4].data["detail"]
