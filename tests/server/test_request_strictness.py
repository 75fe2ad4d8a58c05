"""Bad input the audit found answered wrongly: a false 429 for ``n`` above the queue bound, ``echo`` with
``logprobs`` silently missing the prompt's logprobs, unknown keys inside nested objects silently ignored,
``stream_options`` without streaming, ``stop_token_ids`` outside the vocabulary, non-canonical ``logit_bias`` keys,
error ``code`` / ``param`` off the documented convention, and a confusing message for a lone surrogate. Each is a
400 naming the field and what is accepted (in-process, reference backend: 64-token vocabulary)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from gemmaserve.server.errors import APIError
from gemmaserve.server.protocol import CompletionRequest, parse_body
from hypothesis import given
from hypothesis import strategies as st
from server_harness import REFERENCE_MODEL as MODEL
from test_api_errors import assert_error

PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                         "strict": True}}


def test_n_above_the_queue_bound_is_a_400_not_a_false_429(make_client: Any) -> None:
    client, engine = make_client(max_waiting_requests=4)
    for path, body in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
        response = client.post(path, json={**body, "n": 5})
        error = assert_error(response, 400, "n", words=("MAX_WAITING_REQUESTS=4", "n <= 4"))
        assert error["code"] == "invalid_value" and "retry-after" not in response.headers
    assert engine.stats().finished == {}  # no engine request was submitted (and cancelled)
    assert client.post("/v1/completions", json={**PROMPT, "n": 4}).status_code == 200


def test_echo_with_logprobs_is_refused(ref: Any) -> None:
    """The engine computes no prompt logprobs, which echo + logprobs must return (OpenAI, vLLM): refused."""
    client, _ = ref
    for logprobs in (0, 1):
        assert_error(client.post("/v1/completions", json={**PROMPT, "echo": True, "logprobs": logprobs}), 400, "echo",
                     words=("echo", "logprobs", "prompt"))
    assert client.post("/v1/completions", json={**PROMPT, "echo": True}).status_code == 200
    assert client.post("/v1/completions", json={**PROMPT, "logprobs": 1}).status_code == 200
    assert client.post("/v1/completions", json={**PROMPT, "echo": False, "logprobs": 1}).status_code == 200


NESTED_UNKNOWN: list[tuple[str, str, dict[str, Any], str, tuple[str, ...]]] = [
    ("stream-options-foo", "/v1/completions", {**PROMPT, "stream": True, "stream_options": {"foo": 1}},
     "stream_options", ("'foo'", "include_usage")),
    ("response-format-extra", "/v1/completions", {**PROMPT, "response_format": {"type": "json_object", "foo": 1}},
     "response_format", ("'foo'",)),
    ("text-with-schema", "/v1/completions",
     {**PROMPT, "response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", ("'json_schema'",)),
    ("json-schema-extra", "/v1/completions", {**PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "foo": 1}}},
     "response_format", ("'foo'", "strict")),
    ("json-schema-strict-str", "/v1/completions", {**PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}}},
     "response_format", ("strict", "boolean")),
    ("response-format-type", "/v1/completions", {**PROMPT, "response_format": {"type": "xml"}},
     "response_format", ("text", "json_schema")),
    ("disable-any-whitespace-str", "/v1/completions",
     {**PROMPT, "structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
     "structured_outputs", ("disable_any_whitespace", "boolean")),
    ("tool-function-extra", "/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "foo": 1}}]}, "tools.0.function", ("'foo'", "description")),
    ("tool-cache-control", "/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "cache_control": {"type": "x"}}]},
     "tools.0", ("'cache_control'",)),
    ("message-tool-call-extra", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "extra": 1,
                                              "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0", ("'extra'",)),
    ("tokenize-foo", "/tokenize", {"prompt": "hi", "foo": 1}, "foo", ("unknown field",)),
    ("detokenize-foo", "/detokenize", {"tokens": [5], "foo": 1}, "foo", ("unknown field",)),
    ("stream-options-without-stream", "/v1/completions", {**PROMPT, "stream_options": {"include_usage": True}},
     "stream_options", ("stream: true",)),
    ("stream-options-stream-false", "/v1/chat/completions",
     {**CHAT, "stream": False, "stream_options": {"include_usage": False}}, "stream_options", ("stream: true",)),
    ("stop-token-id-vocab", "/v1/completions", {**PROMPT, "stop_token_ids": [3, 64]}, "stop_token_ids",
     ("token 64", "vocabulary of 64 tokens")),
    ("stop-token-id-vocab-chat", "/v1/chat/completions", {**CHAT, "stop_token_ids": [99999]}, "stop_token_ids",
     ("token 99999", "64")),
    ("logit-bias-duplicate", "/v1/completions", {**PROMPT, "logit_bias": {"5": 100, "05": -100}}, "logit_bias",
     ("'05'", "leading zeros")),
    ("logit-bias-vocab-chat", "/v1/chat/completions", {**CHAT, "logit_bias": {"64": 1}}, "logit_bias",
     ("vocabulary",)),
    ("min-tokens", "/v1/completions", {**PROMPT, "min_tokens": 3}, "min_tokens", ("max_tokens",)),
    ("prompt-ids-vocab", "/v1/completions", {**PROMPT, "prompt": [1, 64]}, "prompt", ("64",)),
    ("tool-choice-needs-tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice",
     ("needs tools",)),
    ("tool-choice-unknown", "/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function",
                                                                             "function": {"name": "g"}}},
     "tool_choice", ("'g'",)),
    ("structured-two-kinds", "/v1/completions", {**PROMPT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", ()),
    ("tokenize-chat-option-with-prompt", "/tokenize", {"prompt": "a", "continue_final_message": False},
     "continue_final_message", ("messages only",)),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), [case[1:] for case in NESTED_UNKNOWN],
                         ids=[case[0] for case in NESTED_UNKNOWN])
def test_refused_with_the_documented_code_and_param(ref: Any, path: str, body: dict[str, Any], param: str,
                                                    words: tuple[str, ...]) -> None:
    client, _ = ref
    error = assert_error(client.post(path, json=body), 400, param, words=words)
    assert error["code"] == "invalid_value", error


def test_openais_real_shapes_are_still_accepted(ref: Any) -> None:
    client, _ = ref
    schema = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": {"type": "string"},
                                                     "strict": True}}
    for fields in ({"response_format": schema}, {"response_format": {"type": "json_object"}},
                   {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}):
        # parsed and compiled only: the reference tokenizer's 64 characters cannot write JSON
        assert parse_body(CompletionRequest, json.dumps({**PROMPT, **fields}).encode()).structured is not None
    for extra in ({"response_format": {"type": "text"}}, {"response_format": None}, {"stream_options": None},
                  {"stop_token_ids": [0, 63]}, {"logit_bias": {"0": 1, "63": -100}}):
        response = client.post("/v1/completions", json={**PROMPT, **extra})
        assert response.status_code == 200, (extra, response.text)
    streamed = client.post("/v1/completions", json={**PROMPT, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text
    assert client.post("/detokenize", json={"tokens": [5], "model": MODEL}).status_code == 200


_CANONICAL = re.compile(r"0|[1-9][0-9]{0,9}")


@given(st.one_of(st.text(max_size=12), st.from_regex(r"[ +\-0]?[0-9_]{1,11}\s?", fullmatch=True),
                 st.integers(min_value=0, max_value=10**11).map(str)))
def test_logit_bias_keys_are_canonical_decimal_token_ids(key: str) -> None:
    """A key is accepted exactly when it is a canonical decimal id (no sign, space, underscore, leading zero, other
    digit scripts), so no two accepted keys name one token; any other key is a 400 naming logit_bias."""
    raw = json.dumps({"prompt": "hi", "logit_bias": {key: 1}}).encode()
    if _CANONICAL.fullmatch(key):
        assert parse_body(CompletionRequest, raw).logit_bias == {key: 1}
        assert str(int(key)) == key
    else:
        with pytest.raises(APIError) as caught:
            parse_body(CompletionRequest, raw)
        assert caught.value.status == 400 and caught.value.param == "logit_bias"
        assert "decimal digits" in caught.value.message


@pytest.mark.parametrize("key", [" 5", "+5", "1_0", "\u0663", "05", "00", "-1", "5 ", "12345678901", ""])
def test_the_audits_logit_bias_keys_are_refused(ref: Any, key: str) -> None:
    client, _ = ref
    assert_error(client.post("/v1/completions", json={**PROMPT, "logit_bias": {key: 1}}), 400, "logit_bias")


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "\\ud800\\u0041", "\\ud800x"])
def test_a_lone_surrogate_is_named(ref: Any, escape: str) -> None:
    client, _ = ref
    raw = ('{"prompt": "a' + escape + '", "max_tokens": 2}').encode()
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "body", words=("invalid \\u escape", "lone UTF-16 surrogate", "line 1"))
    assert error["code"] == "invalid_json" and "hex escape" not in error["message"]
