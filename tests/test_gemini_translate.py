"""The /v1 translations to and from Gemini's generateContent, as pure functions: text, images,
tool calls, usage and streams, for OpenAI chat (and embeddings) and Anthropic messages."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from multiplexer.core.errors import RpcError
from providers.gemini_anthropic import message_response, messages_request, messages_stream
from providers.gemini_openai import (
    chat_request,
    chat_response,
    chat_stream,
    embeddings_request,
    embeddings_response,
)

USAGE = {
    "promptTokenCount": 10,
    "candidatesTokenCount": 4,
    "thoughtsTokenCount": 2,
    "cachedContentTokenCount": 3,
    "totalTokenCount": 16,
}


def reply(*parts, finish="STOP", usage=USAGE):
    return {
        "candidates": [
            {"content": {"role": "model", "parts": list(parts)}, "finishReason": finish, "index": 0}
        ],
        "usageMetadata": usage,
        "responseId": "r1",
    }


def chunk(*parts, finish=None, usage=None):
    cand = {"content": {"role": "model", "parts": list(parts)}, "index": 0}
    if finish:
        cand["finishReason"] = finish
    out = {"candidates": [cand]}
    if usage:
        out["usageMetadata"] = usage
    return out


# -- OpenAI chat ---------------------------------------------------------------------------------
def test_openai_text_system_knobs_and_json_mode():
    out = chat_request(
        {
            "model": "g",
            "messages": [
                {"role": "system", "content": "be kind"},
                {"role": "developer", "content": "and brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
            "temperature": 0.2,
            "top_p": 0.9,
            "max_tokens": 50,
            "stop": "END",
            "seed": 7,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        }
    )
    assert out["model"] == "g"
    assert out["systemInstruction"] == {"parts": [{"text": "be kind\n\nand brief"}]}
    assert out["contents"] == [
        {"role": "user", "parts": [{"text": "hi"}]},
        {"role": "model", "parts": [{"text": "hello"}]},
        {"role": "user", "parts": [{"text": "again"}]},
    ]
    assert out["generationConfig"] == {
        "temperature": 0.2,
        "topP": 0.9,
        "maxOutputTokens": 50,
        "stopSequences": ["END"],
        "seed": 7,
        "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "object"},
    }


def test_openai_images_inline_base64_and_remote_urls_refused():
    data = base64.b64encode(b"img").decode()
    out = chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/webp;base64,{data}"}}
                    ],
                }
            ]
        }
    )
    assert out["contents"][0]["parts"] == [{"inlineData": {"mimeType": "image/webp", "data": data}}]
    with pytest.raises(RpcError, match="Invalid params") as e:
        chat_request(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}}],
                    }
                ]
            }
        )
    assert e.value.data["param"] == "messages" and "data: URLs" in e.value.data["detail"]


def test_openai_tool_calls_round_trip():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "additionalProperties": False,
                    "$schema": "x",
                },
            },
        }
    ]
    out = chat_request(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
                {"role": "tool", "tool_call_id": "c2", "content": "plain"},
            ],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert out["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "f",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                }
            ]
        }
    ]
    assert out["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}}
    assert out["contents"][1] == {
        "role": "model",
        "parts": [
            {"functionCall": {"name": "f", "args": {"a": 1}}},
            {"functionCall": {"name": "g", "args": {}}},
        ],
    }
    assert out["contents"][2] == {
        "role": "user",
        "parts": [  # both results in one turn
            {"functionResponse": {"name": "f", "response": {"ok": True}}},
            {"functionResponse": {"name": "g", "response": {"content": "plain"}}},
        ],
    }
    result = chat_response(
        reply({"functionCall": {"name": "f", "args": {"a": 2}, "id": "x9"}}), {"model": "m"}
    )
    message = result["choices"][0]["message"]
    assert result["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["tool_calls"] == [
        {"id": "x9", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}
    ]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}, "n"),
    ],
)
def test_openai_bodies_gemini_cannot_take_are_refused_naming_the_param(body, param):
    with pytest.raises(RpcError) as e:
        chat_request(body)
    assert e.value.data["param"] == param


def test_openai_response_text_usage_and_finish_reasons():
    result = chat_response(reply({"text": "thinking", "thought": True}, {"text": "Hi"}), {"model": "m"})
    assert result["model"] == "m" and result["object"] == "chat.completion"
    assert result["choices"][0]["message"]["content"] == "Hi"  # the thought summary is not the answer
    assert result["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 6,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert (
        chat_response(reply({"text": "x"}, finish="MAX_TOKENS"), {})["choices"][0]["finish_reason"]
        == "length"
    )
    assert (
        chat_response(reply({"text": "x"}, finish="SAFETY"), {})["choices"][0]["finish_reason"]
        == "content_filter"
    )
    blocked = chat_response({"promptFeedback": {"blockReason": "SAFETY"}}, {})
    assert blocked["choices"][0]["finish_reason"] == "content_filter" and blocked["usage"] is None


def test_openai_stream_text_tool_calls_and_usage_chunk():
    convert = chat_stream({"model": "m", "stream_options": {"include_usage": True}})
    events = [
        *convert(chunk({"text": "He"})),
        *convert(chunk({"text": "llo"})),
        *convert(chunk({"functionCall": {"name": "f", "args": {}}}, finish="STOP", usage=USAGE)),
    ]
    assert [e["choices"][0]["delta"].get("content") for e in events[:2]] == ["He", "llo"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in events[1]["choices"][0]["delta"]
    last = events[2]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["index"] == 0 and last["delta"]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": "{}",
    }
    assert events[3] == {
        **{k: events[0][k] for k in ("id", "object", "created", "model", "system_fingerprint")},
        "choices": [],
        "usage": chat_response(reply(), {})["usage"],
    }
    assert {e["id"] for e in events} == {events[0]["id"]}
    quiet = chat_stream({"model": "m"})
    assert len(quiet(chunk({"text": "x"}, finish="STOP", usage=USAGE))) == 1  # no usage chunk unasked
    error = {"error": {"message": "boom"}}
    assert quiet(error) == [error]


def test_openai_embeddings_both_ways():
    body = {"model": "e", "input": ["a", "b"], "dimensions": 8}
    assert embeddings_request(body) == {
        "model": "e",
        "requests": [
            {"content": {"parts": [{"text": "a"}]}, "outputDimensionality": 8},
            {"content": {"parts": [{"text": "b"}]}, "outputDimensionality": 8},
        ],
    }
    with pytest.raises(RpcError) as e:
        embeddings_request({"input": [[1, 2, 3]]})
    assert e.value.data["param"] == "input"
    out = embeddings_response({"embeddings": [{"values": [1.0, 2.0]}, {"values": [3.0]}]}, body)
    assert out["data"] == [
        {"object": "embedding", "index": 0, "embedding": [1.0, 2.0]},
        {"object": "embedding", "index": 1, "embedding": [3.0]},
    ]
    b64 = embeddings_response({"embeddings": [{"values": [1.5, -2.0]}]}, {"encoding_format": "base64"})
    assert struct.unpack("<2f", base64.b64decode(b64["data"][0]["embedding"])) == (1.5, -2.0)


# -- Anthropic messages --------------------------------------------------------------------------
def test_anthropic_text_images_tools_and_knobs():
    data = base64.b64encode(b"jpg").decode()
    out = messages_request(
        {
            "model": "g",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "sys"}],
            "temperature": 0.5,
            "top_k": 3,
            "stop_sequences": ["X"],
            "tools": [
                {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
            ],
            "tool_choice": {"type": "any"},
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/jpeg", "data": data},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "b"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [{"type": "text", "text": "no such a"}],
                        }
                    ],
                },
            ],
        }
    )
    assert out["systemInstruction"] == {"parts": [{"text": "sys"}]}
    assert out["generationConfig"] == {
        "maxOutputTokens": 64,
        "temperature": 0.5,
        "topK": 3,
        "stopSequences": ["X"],
    }
    assert out["contents"] == [
        {
            "role": "user",
            "parts": [{"text": "look"}, {"inlineData": {"mimeType": "image/jpeg", "data": data}}],
        },
        {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {"a": "b"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"error": "no such a"}}}]},
    ]
    assert out["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    with pytest.raises(RpcError) as e:
        messages_request({"messages": [{"role": "user", "content": "x"}]})
    assert e.value.data["param"] == "max_tokens"


def test_anthropic_response_blocks_stop_reasons_and_usage():
    result = message_response(
        reply({"text": "Sure."}, {"functionCall": {"name": "f", "args": {"q": 1}}}), {"model": "m"}
    )
    assert result["model"] == "m" and result["type"] == "message" and result["stop_reason"] == "tool_use"
    assert result["content"][0] == {"type": "text", "text": "Sure."}
    assert result["content"][1]["type"] == "tool_use" and result["content"][1]["input"] == {"q": 1}
    assert result["content"][1]["id"].startswith("toolu_")
    assert result["usage"] == {
        "input_tokens": 7,
        "output_tokens": 6,
        "cache_read_input_tokens": 3,
        "cache_creation_input_tokens": 0,
    }
    assert message_response(reply({"text": "x"}, finish="MAX_TOKENS"), {})["stop_reason"] == "max_tokens"


def test_anthropic_stream_events():
    convert = messages_stream({"model": "m"})
    events = [
        *convert(chunk({"text": "a"}, usage={"promptTokenCount": 5})),
        *convert(chunk({"text": " b"})),
        *convert(chunk({"functionCall": {"name": "f", "args": {"x": 1}}}, finish="STOP", usage=USAGE)),
    ]
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 5
    assert [e["delta"]["text"] for e in events[2:4]] == ["a", " b"]
    assert events[5]["index"] == 1 and events[5]["content_block"]["name"] == "f"
    assert json.loads(events[6]["delta"]["partial_json"]) == {"x": 1}
    assert events[8]["delta"]["stop_reason"] == "tool_use" and events[8]["usage"] == {"output_tokens": 6}
    assert convert(chunk({"text": "late"})) == []  # nothing after message_stop
