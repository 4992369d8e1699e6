"""Strict fakes: an upstream that refuses a body with a top-level key its API does not define, as
OpenAI does (``Unrecognized request argument supplied``); off unless a test sets ``strict_keys``."""

from __future__ import annotations

from typing import Any

from tests.fakes.common import ApiError

_CHAT = {"model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
         "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
         "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
         "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
         "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice",
         "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options"}
_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                "suffix", "temperature", "top_p", "user"}
_RESPONSES = {"model", "input", "background", "conversation", "include", "instructions",
              "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
              "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_retention",
              "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
              "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation",
              "user"}
_EMBEDDINGS = {"model", "input", "dimensions", "encoding_format", "user"}
_COUNT_TOKENS = {"model", "messages", "system", "thinking", "tool_choice", "tools",
                 "context_management", "mcp_servers"}
_MESSAGES = _COUNT_TOKENS | {"max_tokens", "container", "metadata", "service_tier", "stop_sequences",
                             "stream", "temperature", "top_k", "top_p"}

KNOWN: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset(_CHAT), "/v1/completions": frozenset(_COMPLETIONS),
    "/v1/responses": frozenset(_RESPONSES), "/v1/embeddings": frozenset(_EMBEDDINGS),
    "/v1/messages": frozenset(_MESSAGES), "/v1/messages/count_tokens": frozenset(_COUNT_TOKENS)}


def check_keys(strict: bool, path: str, body: dict[str, Any]) -> None:
    """Refuse (400, naming the key) a body with a key ``path``'s API does not define."""
    if not strict:
        return
    unknown = sorted(set(body) - KNOWN[path])
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}",
                       param=unknown[0])
