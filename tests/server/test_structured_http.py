"""Structured output over HTTP through the official ``openai`` client: ``response_format`` (json_schema,
json_object) on chat and completions, streamed and not, vLLM's ``structured_outputs`` and ``guided_*`` fields;
the tiny random model can only produce valid output through the constraint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "tiny-structured"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}


@pytest.fixture(scope="module")
def client(chat_checkpoint) -> Iterator[Any]:
    """The official client over an in-process app serving the tiny Gemma 4 checkpoint on custom-cpu."""
    pytest.importorskip("gemmaserve_custom_torch")
    from server_harness import custom_cpu_openai_client

    with custom_cpu_openai_client(chat_checkpoint, MODEL) as client:
        yield client


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_response_format_json_schema_streamed_and_not(client) -> None:
    messages = [{"role": "user", "content": "describe a person"}]
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=1.0,
                                               seed=seed, response_format=_schema_format(SCHEMA))
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=1.0,
                                                seed=seed, response_format=_schema_format(SCHEMA), stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == choice.message.content  # same seed, same tokens, streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_completions_json_object_structured_outputs_and_guided_fields(client) -> None:
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=200, temperature=1.0, seed=4,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict) and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=50, temperature=1.0, seed=5,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].text), out.choices[0].text
    for extra in ({"guided_choice": ["left", "right"]}, {"structured_outputs": {"choice": ["left", "right"]}}):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                               max_tokens=20, temperature=1.0, seed=6, extra_body=extra)
        assert reply.choices[0].message.content in ("left", "right")
    grammar = 'root ::= "(" [a-c]+ ")"'
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=30, temperature=1.0, seed=7,
                                    extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([a-c]+\)", out.choices[0].text), out.choices[0].text


def test_bad_schema_is_a_400_naming_the_field(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format=_schema_format({"type": "objectx"}))
    body = caught.value.body
    assert body["param"] == "response_format" and "objectx" in body["message"], body
    assert body["message"].startswith("response_format.json_schema.schema is invalid"), body


def test_a_constraint_beyond_the_engines_limits_is_a_400_compiled_off_the_event_loop(client, monkeypatch) -> None:
    """A 40-byte regex whose lexer llguidance cannot build within its fuel is refused with a 400 naming the limit,
    compiled on the server's preparing threads (never on the event loop or the engine thread); a valid
    constraint compiled there runs on."""
    import threading

    from gemmaserve.structured.grammar import GrammarCompiler

    threads: list[str] = []
    prepare = GrammarCompiler.prepare

    def recording(self, spec):
        if spec.key not in self._cache:  # a compilation (a cached template is only looked up)
            threads.append(threading.current_thread().name)
        return prepare(self, spec)

    monkeypatch.setattr(GrammarCompiler, "prepare", recording)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": {"regex": "((a{100}){100}){100}"}})
    error = refused.value.body
    assert "exceeds what the constraint engine accepts" in error["message"]
    assert error["param"] == "structured_outputs" and error["code"] == "invalid_value"
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    assert threads and all(name.startswith("gemmaserve-prepare") for name in threads), threads
