"""vLLM's chat template options on /v1/chat/completions (issue 16 item 4): ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``echo``; ``--chat-template`` / ``CHAT_TEMPLATE``; and the
offline ``LLM(...)`` refusing unknown and unimplemented options."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL, reference_engine, reference_settings, sse_events

from gemmaserve.engine.engine import Engine
from gemmaserve.errors import ConfigurationError
from gemmaserve.hf_tokenizer import HFTokenizerAdapter, configure_chat_template, read_chat_template
from gemmaserve.server.app import create_app
from gemmaserve.testing.reference_backend import ReferenceBackend
from gemmaserve.testing.reference_model import CharTokenizer

TEMPLATE = (
    "{{ bos_token }}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}model:{% endif %}"
)
STORY = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "Once upon a time"}]
USER = [{"role": "user", "content": "tell me a story"}]


def _adapter(template: str | None = TEMPLATE) -> HFTokenizerAdapter:
    pytest.importorskip("transformers")
    import tiny_checkpoints
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_checkpoints._train_tokenizer_json()),
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
    )
    if template is not None:
        fast.chat_template = template
    return HFTokenizerAdapter(fast, "tiny")


@pytest.fixture(scope="module")
def hf_chat() -> Iterator[tuple[TestClient, Engine, HFTokenizerAdapter]]:
    """The reference backend (512 tokens, greedy-deterministic) with a Hugging Face tokenizer and TEMPLATE."""
    backend = ReferenceBackend(vocab_size=512)
    backend.tokenizer = adapter = _adapter()
    engine = reference_engine(backend)
    yield TestClient(create_app(engine, REFERENCE_MODEL), raise_server_exceptions=False), engine, adapter
    engine.shutdown(timeout=10)


def _chat(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/chat/completions", json={"temperature": 0, "max_tokens": 4, **body})


def _rendered_tokens(response: Any) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens"])


def test_chat_template_kwargs_reach_the_template(hf_chat: Any) -> None:
    client, _, adapter = hf_chat
    rendered = adapter.decode(adapter.apply_chat_template(USER, template_kwargs={"greeting": "hey"}),
                              skip_special_tokens=False)
    assert rendered == "<bos>[hey]user: tell me a story\nmodel:"
    with_kwargs = _chat(client, messages=USER, chat_template_kwargs={"greeting": "hey"})
    assert _rendered_tokens(with_kwargs) == len(adapter.apply_chat_template(USER, template_kwargs={"greeting": "hey"}))
    assert _rendered_tokens(_chat(client, messages=USER)) == len(adapter.apply_chat_template(USER))
    assert _rendered_tokens(with_kwargs) > _rendered_tokens(_chat(client, messages=USER))


def test_add_generation_prompt_false_leaves_the_prompt_off(hf_chat: Any) -> None:
    client, _, adapter = hf_chat
    ids = adapter.apply_chat_template(USER, add_generation_prompt=False)
    assert adapter.decode(ids, skip_special_tokens=False) == "<bos>user: tell me a story\n"
    assert _rendered_tokens(_chat(client, messages=USER, add_generation_prompt=False)) == len(ids)
    assert _rendered_tokens(_chat(client, messages=USER, add_generation_prompt=True)) == len(
        adapter.apply_chat_template(USER))


def test_continue_final_message_continues_the_assistant_message_and_echo_returns_it(hf_chat: Any) -> None:
    client, _, adapter = hf_chat
    ids = adapter.apply_chat_template(STORY, add_generation_prompt=False, continue_final_message=True)
    assert adapter.decode(ids, skip_special_tokens=False) == "<bos>user: tell me a story\nassistant: Once upon a time"
    plain = _chat(client, messages=STORY, continue_final_message=True)
    assert _rendered_tokens(plain) == len(ids)  # no generation prompt: unset add_generation_prompt follows
    text = plain.json()["choices"][0]["message"]["content"]
    echoed = _chat(client, messages=STORY, continue_final_message=True, echo=True).json()
    assert echoed["choices"][0]["message"]["content"] == "Once upon a time" + text
    for key in ("prompt_tokens", "completion_tokens"):  # the echo is no generated token
        assert echoed["usage"][key] == plain.json()["usage"][key]
    events = sse_events(_chat(client, messages=STORY, continue_final_message=True, echo=True, stream=True).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"] == {"content": "Once upon a time"}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1] if e["choices"])
    assert streamed == "Once upon a time" + text


def test_echo_follows_vllms_rule(hf_chat: Any) -> None:
    client, _, _ = hf_chat
    # with the generation prompt the reply is the assistant's: a final user message is not echoed
    assert _chat(client, messages=USER, echo=True).json()["choices"] == _chat(client, messages=USER).json()["choices"]
    # a final assistant message is (the model then writes a new turn after it)
    after = _chat(client, messages=STORY, echo=True).json()["choices"][0]["message"]["content"]
    assert after == "Once upon a time" + _chat(client, messages=STORY).json()["choices"][0]["message"]["content"]
    # without it the reply continues the last message, whoever wrote it
    raw = _chat(client, messages=USER, add_generation_prompt=False).json()["choices"][0]["message"]["content"]
    echoed = _chat(client, messages=USER, add_generation_prompt=False, echo=True).json()
    assert echoed["choices"][0]["message"]["content"] == "tell me a story" + raw


def test_tokenize_renders_messages_with_the_same_options(hf_chat: Any) -> None:
    client, _, adapter = hf_chat
    for options, extra in (({}, {}), ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                           ({"continue_final_message": True, "add_generation_prompt": False},
                            {"continue_final_message": True}),
                           ({"template_kwargs": {"greeting": "hi"}}, {"chat_template_kwargs": {"greeting": "hi"}})):
        body = client.post("/tokenize", json={"messages": STORY, **extra}).json()
        assert body["tokens"] == adapter.apply_chat_template(STORY, **options), extra
        assert body["count"] == _rendered_tokens(_chat(client, messages=STORY, **extra))
    both = client.post("/tokenize", json={"messages": STORY, "continue_final_message": True,
                                          "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", "both be true"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "add_generation_prompt"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
    ({"chat_template_kwargs": ["greeting"]}, "chat_template_kwargs", "should be an object"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "--chat-template"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
    ({"echo": 1}, "echo", "boolean"),
])
def test_bad_template_options_are_a_400_naming_the_field(hf_chat: Any, extra: dict[str, Any], param: str,
                                                         words: str) -> None:
    client, _, _ = hf_chat
    response = _chat(client, messages=STORY, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_tokenizer_without_options_refuses_them_but_serves_plain_chats(make_client: Any) -> None:
    client, _ = make_client()  # the reference CharTokenizer: apply_chat_template(messages) only
    assert _chat(client, messages=USER, add_generation_prompt=True, echo=True).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, param in (({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
                         ({"tools": tools}, "tools"),  # the client sent no chat_template_kwargs: name its field
                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"continue_final_message": True}, "continue_final_message")):
        response = _chat(client, messages=STORY, **extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "not supported by this backend's tokenizer" in response.json()["error"]["message"]


# -- --chat-template / CHAT_TEMPLATE -----------------------------------------------------------------------------

def test_read_chat_template_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    assert read_chat_template(str(template_file)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template("x" * 5000 + "{{ messages }}").endswith("{{ messages }}")  # no valid path
    with pytest.raises(ConfigurationError, match="neither a readable file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ConfigurationError, match="empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))
    # transformers' own syntax is Jinja too: loop controls and {% generation %} blocks
    looping = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
               "{% generation %}{{ m }}{% endgeneration %}{% endfor %}")
    assert read_chat_template(looping) == looping
    # invalid Jinja is refused here, before any model loads (inline or in a file)
    with pytest.raises(ConfigurationError, match="the template is not valid Jinja"):
        read_chat_template("{% if %}broken")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigurationError, match="broken.jinja' is not valid Jinja"):
        read_chat_template(str(tmp_path / "broken.jinja"))


def test_configure_chat_template_replaces_the_checkpoints_and_refuses_what_cannot_work() -> None:
    adapter = _adapter(template=None)
    assert not adapter.has_chat_template
    configure_chat_template(adapter, "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert adapter.chat_template_source == "configured"
    assert adapter.decode(adapter.apply_chat_template(USER)) == "<tell me a story>"
    with pytest.raises(ConfigurationError, match="not valid Jinja"):
        configure_chat_template(adapter, "{% for m in messages %}")
    with pytest.raises(ConfigurationError, match="not supported by this backend's tokenizer"):
        configure_chat_template(CharTokenizer(64), TEMPLATE)


def test_the_chat_template_flag_and_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gemmaserve.cli import main
    from gemmaserve.settings import load_settings

    seen: dict[str, Any] = {}
    monkeypatch.setattr("gemmaserve.server.serve.serve", lambda settings: seen.setdefault("s", settings))
    assert main(["serve", "--chat-template", str(tmp_path / "t.jinja")]) == 0
    assert seen["s"].chat_template == str(tmp_path / "t.jinja")
    monkeypatch.setenv("CHAT_TEMPLATE", "{{ messages }}")
    assert load_settings().chat_template == "{{ messages }}"


def test_serve_refuses_a_bad_chat_template_before_loading_the_model(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    from gemmaserve.server import serve as serve_module
    from gemmaserve.settings import load_settings

    def no_load(settings: Any) -> Any:
        raise AssertionError("the model must not load")

    monkeypatch.setattr("gemmaserve.engine.factory.build_engine", no_load)
    with pytest.raises(ConfigurationError, match="neither a readable file"):
        serve_module.serve(load_settings(chat_template=str(tmp_path / "missing.jinja")))


def test_llm_applies_the_chat_template_setting() -> None:
    from gemmaserve import LLM

    backend = ReferenceBackend(vocab_size=512)
    backend.tokenizer = _adapter(template=None)
    settings = reference_settings(chat_template="{% for m in messages %}({{ m['content'] }}){% endfor %}")
    with LLM(settings=settings, engine=reference_engine(backend)) as llm:
        assert llm.tokenizer.decode(llm.tokenizer.apply_chat_template(USER)) == "(tell me a story)"


# -- LLM(...) options ------------------------------------------------------------------------------------------

def test_llm_refuses_an_unknown_option_naming_close_matches() -> None:
    from gemmaserve import LLM

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_modle_len'; did you mean 'max_model_len'"):
        LLM("/nonexistent", max_modle_len=128)
    with pytest.raises(TypeError, match="'any_typo'"):
        LLM("/nonexistent", any_typo=1)


@pytest.mark.parametrize(("option", "value"), [
    ("pipeline_parallel_size", 4),
    ("gpu_memory_utilization", 0.9), ("enable_prefix_caching", False), ("trust_remote_code", True),
])
def test_llm_refuses_vllm_options_it_does_not_implement(option: str, value: Any) -> None:
    from gemmaserve import LLM

    with pytest.raises(ConfigurationError, match=rf"LLM\({option}={value!r}\) is not implemented"):
        LLM("/nonexistent", **{option: value})


def test_llm_accepts_vllm_options_at_the_value_that_changes_nothing() -> None:
    from gemmaserve import LLM
    from gemmaserve.errors import BackendUnavailableError

    with LLM(settings=reference_settings(), engine=reference_engine(), pipeline_parallel_size=1,
             enable_prefix_caching=True) as llm:
        assert llm.generate("abc")[0].finish_reason in ("stop", "length")
    # built from the keywords too: the vetted no-ops never reach the settings (which refuse names they lack), so
    # the load fails on the missing checkpoint, not on them
    with pytest.raises(BackendUnavailableError, match="has no config.json"):
        LLM("/nonexistent", pipeline_parallel_size=1, enforce_eager=False, trust_remote_code=False)
