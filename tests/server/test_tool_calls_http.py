"""Tool calling through the official ``openai`` client on a tiny random Gemma 4 whose tokenizer carries Gemma 4's
tool-call tokens and whose chat template renders tools and earlier calls: with random weights only the
``tool_choice`` constraint can produce a call, so every call parsing and its arguments validating is the test.
Both parsers (gemma4, json), streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gemmaserve.server.app import create_app

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "tiny-tools"
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[called {{ c.function.name }} with {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} (result of {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 7]},
        "flags": {"type": "array", "items": {"enum": ["wind", "rain"]}},
        "where": {"type": "object", "additionalProperties": False, "properties": {"north": {"type": "boolean"}}}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("gemmaserve_custom_torch")
    from tiny_checkpoints import GEMMA4_TOOL_TOKENS, build_tiny_gemma4, save_tiny_tokenizer

    path = build_tiny_gemma4(tmp_path_factory.mktemp("tools") / "ckpt")
    save_tiny_tokenizer(path, GEMMA4_TOOL_TOKENS)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["gemma4", "json"])
def client(request, tool_checkpoint) -> Iterator[tuple[Any, str]]:
    """One app per parser: ``auto`` picks gemma4 for this tokenizer; json is forced."""
    from server_harness import custom_cpu_openai_client

    setting = "auto" if request.param == "gemma4" else "json"
    with custom_cpu_openai_client(tool_checkpoint, MODEL, tool_call_parser=setting) as client:
        yield client, request.param


def _check_calls(calls: Any, allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_give_valid_calls(client) -> None:
    client, parser = client
    messages = [{"role": "user", "content": "what is the weather"}]
    for choice, allowed, parallel in (("required", {"get_weather", "clock"}, False),
                                      ("required", {"get_weather", "clock"}, True),
                                      ({"type": "function", "function": {"name": "clock"}}, {"clock"}, False),
                                      ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}, True)):
        finish = "tool_calls" if choice == "required" else "stop"  # a named function: "stop" (OpenAI's, vLLM's)
        for seed in range(2):
            reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                                   parallel_tool_calls=parallel, max_tokens=300, temperature=1.0,
                                                   seed=seed)
            choice0 = reply.choices[0]
            assert choice0.finish_reason == finish, (parser, choice0)
            _check_calls(choice0.message.tool_calls, allowed)
            if not parallel or choice != "required":
                assert len(choice0.message.tool_calls) == 1
            stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                                    parallel_tool_calls=parallel, max_tokens=300, temperature=1.0,
                                                    seed=seed, stream=True)
            deltas = [c.choices[0] for c in stream if c.choices]
            streamed = [call for d in deltas for call in d.delta.tool_calls or []]
            # no empty chunk for the tokens the parser holds back (only the opening one names the role)
            assert all(d.delta.role or d.delta.content or d.delta.tool_calls or d.finish_reason for d in deltas)
            assert [c.index for c in streamed] == list(range(len(streamed)))
            assert [(c.function.name, c.function.arguments) for c in streamed] == [
                (c.function.name, c.function.arguments) for c in choice0.message.tool_calls]
            assert [d.finish_reason for d in deltas if d.finish_reason] == [finish]
            assert "<|tool_call>" not in "".join(d.delta.content or "" for d in deltas)


def test_auto_and_none_answer_and_conversations_with_calls_render(client) -> None:
    client, _ = client
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                               max_tokens=8, temperature=0.0)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=history[:2] + [{
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}],
            max_tokens=4)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)
    assert caught.value.body["param"] == "tool_choice"


def test_the_template_sees_tools_and_earlier_calls(tool_checkpoint) -> None:
    from gemmaserve.server.prepare import prepare_chat
    from gemmaserve.server.protocol import ChatCompletionRequest
    from gemmaserve_custom_torch.tokenizer import HFTokenizer

    tokenizer = HFTokenizer.from_pretrained(tool_checkpoint)
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "noon"}], "tools": TOOLS})
    prepared = prepare_chat(body, tokenizer, 512)
    text = tokenizer.decode(prepared.prompt_ids, skip_special_tokens=False)
    assert "tools: get_weather clock" in text and '[called clock with {"zone": "UTC"}]' in text
    assert "(result of call_9)" in text and prepared.tool_parser == "gemma4"
    none = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                 "tool_choice": "none"})
    kept = prepare_chat(none, tokenizer, 512)  # vLLM's default: the model knows the tools, the reply is content
    assert kept.tool_parser is None and "tools: get_weather clock" in tokenizer.decode(kept.prompt_ids)
    dropped = prepare_chat(none, tokenizer, 512, exclude_tools_when_none=True)  # --exclude-tools-when-tool-choice-none
    assert dropped.tool_parser is None and "tools:" not in tokenizer.decode(dropped.prompt_ids)


def test_reasoning_channel_goes_to_reasoning(tool_checkpoint) -> None:
    """REASONING_PARSER=gemma4: a reply forced (by a grammar) to open with Gemma 4's reasoning channel returns
    the channel as ``reasoning`` (and ``reasoning_content``) and the rest as ``content``, streamed and not."""
    from server_harness import custom_cpu_openai_client

    grammar = 'start: <|channel> "thought\\n" /[a-z]{2,6}/ <channel|> /[a-z]{2,6}/'
    with custom_cpu_openai_client(tool_checkpoint, MODEL, reasoning_parser="gemma4") as client:
        for seed in range(3):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "think"}], max_tokens=40,
                          temperature=1.0, seed=seed, extra_body={"structured_outputs": {"grammar": grammar}})
            message = client.chat.completions.create(**kwargs).choices[0].message
            thought, answer = message.reasoning, message.content
            assert message.reasoning_content == thought  # vLLM's name, and the older one many clients read
            assert thought and answer and thought.isalpha() and answer.isalpha(), message
            chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            assert "".join(getattr(d, "reasoning", None) or "" for d in chunks) == thought
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == thought
            assert "".join(d.content or "" for d in chunks) == answer
            hidden = {**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}}
            quiet = client.chat.completions.create(**hidden).choices[0].message
            assert quiet.content == answer and getattr(quiet, "reasoning", None) is None
            chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **hidden) if c.choices]
            assert not any(getattr(d, "reasoning", None) for d in chunks)
            assert "".join(d.content or "" for d in chunks) == answer


def test_offering_tools_shows_no_other_special_tokens(client) -> None:
    """With tools offered the reply's text keeps the tool-call markers for the parser, and hides every other
    special token as a reply without tools does (Gemma 4's channel markers leaked into ``content`` before);
    ``skip_special_tokens: false`` still shows them all."""
    client, parser = client
    grammar = 'start: <|channel> "thought" <channel|> "fine"'
    base = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0.0)
    for extra in ({}, {"tools": TOOLS}):
        kwargs = {**base, **extra, "extra_body": {"structured_outputs": {"grammar": grammar}}}
        assert client.chat.completions.create(**kwargs).choices[0].message.content == "thoughtfine"
        chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(d.content or "" for d in chunks) == "thoughtfine"
    shown = {**base, "tools": TOOLS, "extra_body": {"structured_outputs": {"grammar": grammar},
                                                    "skip_special_tokens": False}}
    assert client.chat.completions.create(**shown).choices[0].message.content == "<|channel>thought<channel|>fine"


def test_json_strict_tools_beside_a_reasoning_parser_are_refused(tool_checkpoint) -> None:
    """With the json tool parser, strict tools under auto are decided by how the reply opens; a reasoning channel
    first would hide that, so the combination is a 400 naming ``tools`` (the gemma4 parser's form is served)."""
    from server_harness import custom_cpu_openai_client

    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]
    messages = [{"role": "user", "content": "what is the weather"}]
    with custom_cpu_openai_client(tool_checkpoint, MODEL, reasoning_parser="gemma4",
                                  tool_call_parser="json") as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, tools=strict, max_tokens=4)
        assert caught.value.body["param"] == "tools" and "reasoning" in caught.value.body["message"]
        assert client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4).choices
    with custom_cpu_openai_client(tool_checkpoint, MODEL, reasoning_parser="gemma4") as client:
        assert client.chat.completions.create(model=MODEL, messages=messages, tools=strict, max_tokens=4).choices


@pytest.mark.parametrize("backend", ["hf", "mlx"])
def test_tool_calls_on_the_other_backends(tool_checkpoint, backend) -> None:
    """The same required / named calls through hf and mlx (built as `gemmaserve serve` builds them)."""
    from gemmaserve.engine.factory import build_engine
    from server_harness import plugin_installed, reference_settings

    if not plugin_installed({"hf": "gemmaserve_hf_torch", "mlx": "gemmaserve_mlx"}[backend]):
        pytest.skip(f"{backend} backend not installed")
    settings = reference_settings(model=str(tool_checkpoint), backend=backend, dtype="float32")
    engine = build_engine(settings)
    engine.start()
    try:
        http = TestClient(create_app(engine, MODEL), raise_server_exceptions=False)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        for choice, allowed in (("required", {"get_weather", "clock"}),
                                ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=1.0,
                                                   seed=3)
            assert reply.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop"), reply.choices[0]
            _check_calls(reply.choices[0].message.tool_calls, allowed)
    finally:
        engine.shutdown(timeout=10)


def test_parallel_tool_calls_false_returns_at_most_one_call(client) -> None:
    """With tool_choice auto the model may write several calls; parallel_tool_calls=false keeps the first."""
    client, parser = client
    if parser != "gemma4":
        pytest.skip("the forcing grammar writes Gemma 4 call blocks")
    grammar = 'start: (<|tool_call> "call:clock{zone:" <|"|> "UTC" <|"|> "}" <tool_call|>)~2'
    for parallel, want in ((True, 2), (False, 1)):
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=TOOLS, max_tokens=60,
                          temperature=0.0, parallel_tool_calls=parallel, extra_body={"structured_outputs": {"grammar": grammar}})
            if stream:
                chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
                calls = [call for c in chunks for call in c.delta.tool_calls or []]
            else:
                calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
            assert len(calls) == want and all(json.loads(c.function.arguments) == {"zone": "UTC"} for c in calls)


AWKWARD = [  # names and keys Gemma 4 cannot write as identifiers, and names that spell tool_choice's modes
    {"type": "function", "function": {"name": "3d-render", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["first name"], "properties": {
            "first name": {"enum": ["Ann", "Bo"]}, "2fa": {"type": "boolean"}, "città": {"type": "null"},
            "code": {"type": "string", "maxLength": 5}, "price": {"type": "string", "pattern": "^\\d\\$$"}}}}},
    {"type": "function", "function": {"name": "auto", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {"x": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "required", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {"y": {"type": "null"}}}}},
]


def test_forced_calls_with_awkward_names_and_keys_parse(client) -> None:
    """A function named ``auto`` or ``required`` forced by name is that function (not a mode); names starting with
    a digit and keys with spaces, digits or non-ASCII letters come back as calls that parse and validate."""
    client, _ = client
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in AWKWARD}
    for name in schemas:
        for seed, stream in ((0, False), (1, True)):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "go"}], tools=AWKWARD, max_tokens=200,
                          tool_choice={"type": "function", "function": {"name": name}}, temperature=1.0, seed=seed)
            if stream:
                chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
                calls = [call.function for c in chunks for call in c.delta.tool_calls or []]
                assert not "".join(c.delta.content or "" for c in chunks).strip()
                assert chunks[-1].finish_reason == "stop"  # forced by name: OpenAI's and vLLM's "stop"
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                assert choice.finish_reason == "stop" and not choice.message.content, choice
                calls = [call.function for call in choice.message.tool_calls]
            assert calls and all(call.name == name for call in calls), calls
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[name])


def test_a_model_eos_token_stays_out_of_the_reply(tmp_path) -> None:
    """Gemma 4 ends a turn that made calls with ``<|tool_response>``, an EOS of its generation config: the engine
    stops on it and, although the gemma4 parser decodes with special tokens, its text is not content."""
    pytest.importorskip("gemmaserve_custom_torch")
    from server_harness import custom_cpu_openai_client
    from tiny_checkpoints import GEMMA4_TOOL_TOKENS, build_tiny_gemma4, save_tiny_tokenizer

    path = build_tiny_gemma4(tmp_path / "ckpt")
    save_tiny_tokenizer(path, (*GEMMA4_TOOL_TOKENS, "<|tool_response>"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    response = next(token["id"] for token in added if token["content"] == "<|tool_response>")
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [1, response]}))
    grammar = 'start: <|tool_call> "call:clock{}" <tool_call|> <|tool_response>'
    with custom_cpu_openai_client(path, MODEL) as client:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=TOOLS, max_tokens=30,
                      extra_body={"structured_outputs": {"grammar": grammar}})
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        assert [call.function.name for call in choice.message.tool_calls] == ["clock"]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == ""


def test_a_tool_schema_the_constraint_engine_refuses_is_a_400_naming_tools(client) -> None:
    client, parser = client
    if parser != "json":
        pytest.skip("the gemma4 call grammar accepts any value where a schema's type is not one it models")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=5, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": 5}}}}}])
    body = caught.value.body
    assert body["param"] == "tools" and body["message"].startswith("tools:"), body
    assert "structured_outputs" not in body["message"]


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": ["array", "null"]}])
def test_parameters_that_are_not_an_object_schema_are_a_400(client, parameters) -> None:
    """OpenAI's ``parameters`` is the schema of the arguments object, and both parsers take only an object as a
    call's arguments: a schema of another type is refused, whatever the tool_choice."""
    client, _ = client
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=5,
            tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    body = caught.value.body
    assert "tools" in body["param"] and "object" in body["message"], body


def test_a_forced_enum_value_holding_a_marker_is_a_400(client) -> None:
    """A forced Gemma 4 call cannot write a string holding one of its markers (the reply would not parse): such an
    ``enum`` value or property name is refused up front, naming it."""
    client, parser = client
    if parser != "gemma4":
        pytest.skip("the json parser's strings can hold the markers")
    for schema in ({"type": "object", "properties": {"c": {"enum": ["ok", "<tool_call|>"]}}},
                   {"type": "object", "properties": {"a<channel|>": {"type": "string"}}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=5, tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
        body = caught.value.body
        assert body["param"] == "tools" and "cannot write inside a string" in body["message"], body


def test_strict_tools_under_auto_hold_the_calls_the_model_makes(client, tool_checkpoint) -> None:
    """``strict: true`` under ``tool_choice: "auto"``: the reply is free until the model opens a call (here pushed
    to by ``logit_bias`` on ``<|tool_call>``, which random weights rarely pick), and each call it opens follows the
    strict function's schema; a function without strict is still called by name with any object. The json
    parser's calls open with ``{`` (pushed to the same way): the whole reply is then one call, which ends it; a
    reply that does not open so is text."""
    from transformers import AutoTokenizer

    client, parser = client
    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, CLOCK]
    messages = [{"role": "user", "content": "what is the weather"}]
    tokenizer = AutoTokenizer.from_pretrained(tool_checkpoint)
    opener = (tokenizer.convert_tokens_to_ids("<|tool_call>") if parser == "gemma4"
              else tokenizer.encode("{", add_special_tokens=False)[0])
    # the push on "{" would fill a non-strict function's free object with braces: the json rows offer the strict one
    offered = strict if parser == "gemma4" else strict[:1]
    weather_calls = 0
    for seed in range(4):
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=messages, tools=offered, tool_choice="auto", max_tokens=120,
                          temperature=1.0, seed=seed, logit_bias={str(opener): 100})
            if stream:
                chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
                calls = [call for c in chunks for call in c.delta.tool_calls or []]
                finish = chunks[-1].finish_reason
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                calls, finish = choice.message.tool_calls or [], choice.finish_reason
            assert calls, (seed, stream, finish)
            if parser == "json":
                assert finish == "tool_calls" and len(calls) == 1, (seed, stream, finish)
            for call in calls:
                assert call.function.name in SCHEMAS
                arguments = json.loads(call.function.arguments)
                assert isinstance(arguments, dict)
                if call.function.name == "get_weather":
                    weather_calls += 1
                    jsonschema.validate(arguments, SCHEMAS["get_weather"])
    assert weather_calls
    if parser == "json":  # without the push the random model writes text, which the constraint leaves as it is
        for seed in range(3):
            message = client.chat.completions.create(model=MODEL, messages=messages, tools=strict, max_tokens=12,
                                                     temperature=1.0, seed=seed).choices[0].message
            assert message.tool_calls or not message.content.lstrip().startswith(("{", "[", "```")), message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, tools=strict, max_tokens=8,
                                       response_format={"type": "json_object"})
    assert caught.value.body["param"] == "tools"
