"""The chat template's whole input is bounded before it is rendered (audit: a chat's size guard counted only the
messages' ``content``, so 500,000 empty messages, a huge ``chat_template_kwargs`` value, message ``name``,
tool-call ``arguments`` or tool ``description`` / ``parameters`` were rendered and tokenized: 17-24 s of CPU on
the preparation threads, stalling every other client). Each is now a fast 400 ``context_length_exceeded`` naming
the part, and the template never runs; ordinary chats with those fields still render."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from gemmaserve.engine.engine import Engine
from gemmaserve.server.app import create_app
from gemmaserve.server.prepare import _rendered_chars
from gemmaserve.testing.reference_backend import ReferenceBackend
from hypothesis import given
from hypothesis import strategies as st
from server_harness import REFERENCE_MODEL, reference_engine

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}{% if m.name %}({{ m.name }}){% endif %}: "
    "{{ m['content'] }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}\n{% endfor %}"
    "{% for t in tools or [] %}<tool {{ t.function | tojson }}>{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
"""Renders every field the audit found unbounded (a template that ignores one would hide the bug)."""
FAST_S = 1.0
"""A refused body of ~15 MB is answered within this (it took 17-24 s when it was rendered)."""
BIG = 5_000_000
USER = [{"role": "user", "content": "hi"}]


class Renders:
    """Counts the chat template renders of a tokenizer (wraps its ``apply_chat_template``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.calls = 0
        inner = tokenizer.apply_chat_template

        def counting(messages: Any, **options: Any) -> list[int]:
            self.calls += 1
            return inner(messages, **options)

        tokenizer.apply_chat_template = counting


@pytest.fixture(scope="module")
def chat() -> Iterator[tuple[TestClient, Engine, Renders]]:
    """The reference backend (512-token context) with a Hugging Face tokenizer rendering TEMPLATE."""
    from test_chat_template_options import _adapter

    backend = ReferenceBackend(vocab_size=512)
    backend.tokenizer = adapter = _adapter(TEMPLATE)
    renders = Renders(adapter)
    engine = reference_engine(backend)
    yield TestClient(create_app(engine, REFERENCE_MODEL), raise_server_exceptions=False), engine, renders
    engine.shutdown(timeout=10)


def _post(client: TestClient, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[Any, float]:
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    return response, time.perf_counter() - start


def _tool_call(arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


HUGE = "ab " * (BIG // 3)
OVERSIZED: list[tuple[str, dict[str, Any], str]] = [
    ("kwargs", {"messages": USER, "chat_template_kwargs": {"bos_token": HUGE}}, "chat_template_kwargs"),
    ("kwargs-nested", {"messages": USER, "chat_template_kwargs": {"ctx": {"a": [HUGE]}}}, "chat_template_kwargs"),
    ("kwargs-many-small", {"messages": USER, "chat_template_kwargs": {"xs": [1] * 1_000_000}}, "chat_template_kwargs"),
    ("name", {"messages": [{"role": "user", "content": "x", "name": HUGE}]}, "messages"),
    ("tool-call-arguments", {"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "tool_calls": [_tool_call(json.dumps({"a": HUGE}))]}]}, "messages"),
    ("tool-call-id", {"messages": [{"role": "tool", "content": "x", "tool_call_id": HUGE}]}, "messages"),
    ("tool-description", {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "description": HUGE}}]}, "tools"),
    ("tool-parameters", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": [HUGE]}}}}}]}, "tools"),
    ("content", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), [case[1:] for case in OVERSIZED], ids=[case[0] for case in OVERSIZED])
def test_every_renderable_field_counts_toward_the_bound(chat: Any, body: dict[str, Any], param: str) -> None:
    client, _, renders = chat
    before = renders.calls
    paths = ("/v1/chat/completions",) if "tools" in body else ("/v1/chat/completions", "/tokenize")  # no tools there
    for path in paths:
        response, elapsed = _post(client, {**body, "max_tokens": 2} if path != "/tokenize" else body, path)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert "512-token context" in error["message"] and "characters" in error["message"]
        assert elapsed < FAST_S, f"{path}: refused after {elapsed:.2f} s"
    assert renders.calls == before  # the template never ran


def test_more_messages_than_the_context_are_refused_before_they_are_validated(chat: Any) -> None:
    client, _, renders = chat
    before = renders.calls
    just_over = [{"role": "user", "content": ""}] * 513
    response, _ = _post(client, {"messages": just_over, "max_tokens": 2})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages", error
    assert error["code"] == "context_length_exceeded" and "513 messages" in error["message"]
    assert "at most 512" in error["message"]
    bomb = {"messages": [{"role": "user", "content": ""}] * 500_000, "max_tokens": 2}  # the audit's body, 14.5 MB
    for path in ("/v1/chat/completions", "/tokenize"):
        response, elapsed = _post(client, bomb if path != "/tokenize" else {"messages": bomb["messages"]}, path)
        assert response.status_code == 400 and "500000 messages" in response.json()["error"]["message"]
        assert elapsed < 2 * FAST_S, f"{path}: refused after {elapsed:.2f} s"  # JSON parsing alone is ~0.4 s
    assert renders.calls == before


def test_ordinary_chats_with_those_fields_still_render(chat: Any) -> None:
    client, _, renders = chat
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}, "strict": False}}]
    messages = [{"role": "user", "content": "weather?", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [_tool_call('{"city": "Paris"}')]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    body = {"messages": messages, "tools": tools, "tool_choice": "none", "chat_template_kwargs": {"bos_token": "B"}}
    before = renders.calls
    response, _ = _post(client, {**body, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    tokenized, _ = _post(client, {"messages": messages, "chat_template_kwargs": {"bos_token": "B"}}, "/tokenize")
    assert tokenized.status_code == 200, tokenized.text
    with_tools = {**body, "tool_choice": "auto", "max_tokens": 2, "temperature": 0}
    assert _post(client, with_tools)[0].status_code == 200
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(64)]
    assert _post(client, {"messages": many, "max_tokens": 2})[0].status_code == 200
    assert renders.calls == before + 4


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40,
)


def _strings(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(key) + _strings(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(_strings(item) for item in value)
    return 0


@given(_JSON, st.integers(min_value=0, max_value=400))
def test_the_character_count_bounds_every_string_and_stops_only_past_its_budget(value: Any, budget: int) -> None:
    """The count covers every string (object keys included) and stopping early changes no verdict: the count with
    a budget exceeds the budget exactly when the full count does."""
    full = _rendered_chars(value, 10**12)
    assert full >= _strings(value)
    assert (_rendered_chars(value, budget) > budget) == (full > budget)


def test_huge_integers_are_counted_without_printing_them() -> None:
    assert _rendered_chars(10**5000, 10**9) >= 5000  # str() of it raises ValueError (int max str digits)
