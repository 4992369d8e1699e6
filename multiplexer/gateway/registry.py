"""Provider kinds by name, imported lazily so optional dependencies stay optional."""

from __future__ import annotations

import importlib

from pydantic import BaseModel

from multiplexer.core.provider import Provider

KINDS: dict[str, str] = {
    "jsonrpc": "providers.jsonrpc:JsonRpcProvider",
    "mcp": "providers.mcp:McpProvider",
    "openai": "providers.openai:OpenAIProvider",
    "anthropic": "providers.anthropic:AnthropicProvider",
    "gemini": "providers.gemini:GeminiProvider",
    "azure_openai": "providers.azure_openai:AzureOpenAIProvider",
    "mistral": "providers.mistral:MistralProvider",
    "local": "providers.local:LocalProvider",
    "echo": "providers.echo:EchoProvider",
    "mock": "providers.mock:MockProvider",
}


def provider_class(kind: str) -> type[Provider]:
    try:
        target = KINDS[kind]
    except KeyError:
        raise KeyError(f"unknown provider kind {kind!r} (known: {', '.join(sorted(KINDS))})") from None
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise KeyError(f"provider kind {kind!r} is not available: {e}") from None
    return cls


STATES: dict[str, str] = {
    "redis": "multiplexer.backends.redis_state:RedisState",
    "rediss": "multiplexer.backends.redis_state:RedisState",
    "unix": "multiplexer.backends.redis_state:RedisState",
}


def state_class(url: str) -> type:
    """The shared-state engine for ``state.url`` (imported lazily: ``redis`` is optional)."""
    module, _, attr = STATES[url.partition("://")[0]].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise KeyError(f"state.url needs the 'replicas' extra (pip install multiplexer[replicas]): {e}") \
            from None


def settings_model(kind: str) -> type[BaseModel]:
    """The keys a provider of this kind takes beside the common ones (``ProviderConfig``)."""
    return provider_class(kind).Settings


def route_settings_model(kind: str) -> type[BaseModel]:
    """The keys a route to a provider of this kind takes beside the common ones (``RouteConfig``)."""
    return provider_class(kind).RouteSettings
