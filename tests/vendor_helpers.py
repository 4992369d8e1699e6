"""The vendor fakes (Azure OpenAI, Mistral, Groq, Together) on 127.0.0.1, and a gateway config over them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from tests.fakes.mistral_fake import FakeMistralState
from tests.fakes.mistral_fake import create_app as mistral_app
from tests.fakes.openai_fake import FakeOpenAIState
from tests.fakes.serve import serve_app
from tests.fakes.vendor_fakes import create_azure_app, create_groq_app, create_together_app


class VendorFakes:
    def __init__(self) -> None:
        self.azure, self.mistral = FakeOpenAIState(), FakeMistralState()
        self.groq, self.together = FakeOpenAIState(), FakeOpenAIState()
        self.urls: dict[str, str] = {}


@asynccontextmanager
async def vendor_fakes() -> AsyncIterator[VendorFakes]:
    v = VendorFakes()
    async with AsyncExitStack() as stack:
        for name, app in (("azure", create_azure_app(v.azure)), ("mistral", mistral_app(v.mistral)),
                          ("groq", create_groq_app(v.groq)), ("together", create_together_app(v.together))):
            v.urls[name] = await stack.enter_async_context(serve_app(app))
        yield v


def vendor_config_data(v: VendorFakes, tmp_path: Path) -> dict[str, Any]:
    """One provider per vendor (Azure twice: dated api-version and v1), sync, batch and embedding
    routes on each, fast polling."""
    fast = {"batch_poll_interval_s": 0.01, "retry": {"attempts": 3, "base_wait_ms": 1, "max_wait_ms": 5}}
    gather = {"max_items": 1000, "max_wait_ms": 50}
    providers = {
        "az": {"kind": "azure_openai", "endpoint": v.urls["azure"], "api_key": "az-key", **fast},
        "az1": {"kind": "azure_openai", "endpoint": v.urls["azure"], "api_key": "az-key",
                "api_version": "v1", **fast},
        "mis": {"kind": "mistral", "base_url": v.urls["mistral"], "api_key": "mi-key", **fast},
        "groq": {"kind": "openai", "base_url": v.urls["groq"] + "/openai/v1", "api_key": "gq",
                 "batch_api": {"completion_window": "7d", "max_lines": 50000,
                               "max_file_bytes": 200 * 1024 * 1024}, **fast},
        "tog": {"kind": "openai", "base_url": v.urls["together"] + "/v1", "api_key": "tg",
                "batch_api": {"file_purpose": "batch-api", "metadata": False, "max_lines": 50000,
                              "max_file_bytes": 100 * 1024 * 1024}, **fast},
    }
    routes: dict[str, Any] = {}
    models = {"az": ("gpt-4o", "gpt-4o-batch", "embed-3"), "az1": ("gpt-4o", "gpt-4o-batch", "embed-3"),
              "mis": ("mistral-small-latest", "mistral-small-latest", "mistral-embed"),
              "groq": ("llama-3.1-8b-instant",) * 2 + ("embed",), "tog": ("llama-3.3-70b",) * 2 + ("embed",)}
    for name, (chat, batch, embed) in models.items():
        routes[f"{name}_chat"] = {"provider": name, "operation": "chat", "params": {"model": chat},
                                  "models": [f"{name}-chat"]}
        routes[f"{name}_embed"] = {"provider": name, "operation": "embeddings", "params": {"model": embed}}
        routes[f"{name}_batch"] = {"provider": name, "operation": "chat", "mode": "batch",
                                   "params": {"model": batch}, "batch": gather}
        routes[f"{name}_embed_batch"] = {"provider": name, "operation": "embeddings", "mode": "batch",
                                         "params": {"model": embed}, "batch": gather}
    return {"store": {"path": str(tmp_path / "jobs.db")}, "providers": providers, "routes": routes}
