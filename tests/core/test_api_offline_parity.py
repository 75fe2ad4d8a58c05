"""More of the offline API as vLLM users call it: ``generate``'s ``lora_request`` / ``priority`` /
``tokenization_kwargs``; ``enable_prefix_caching=True`` with the cache off; ``LLM.chat`` reading messages as the
HTTP server does (text parts joined, tool-call arguments as objects, images refused) and refusing reserved
``chat_template_kwargs``; ``get_tokenizer()`` as a Hugging Face tokenizer with the engine's template;
``out.outputs[0].finished()`` as a method."""

from __future__ import annotations

from typing import Any

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.api import CompletionOutput
from gemmaserve.engine import Engine
from gemmaserve.errors import ConfigurationError, InvalidRequestError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.settings import CoreSettings
from gemmaserve.testing import ReferenceBackend

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %} call {{ c.function.name }}("
            "{% for k, v in c.function.arguments.items() %}{{ k }}:{{ v }}{% endfor %}){% endfor %}; "
            "{% endfor %}{% if add_generation_prompt %}model:{% endif %}{{ extra | default('') }}")
"""A template written for Hugging Face messages (``arguments.items()``), in the reference vocabulary's letters."""


def _llm(settings: CoreSettings | None = None, tokenizer: Any = None) -> LLM:
    settings = settings or CoreSettings(max_batch_size=8, prefill_chunk_tokens=8, max_active_kv_tokens=8192)
    backend = ReferenceBackend(max_model_len=512)
    if tokenizer is not None:
        backend.tokenizer = tokenizer
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    return LLM(settings=settings, engine=Engine(backend, settings, cache, owns_backend=True))


def _hf_tokenizer() -> Any:
    """A Hugging Face fast tokenizer over the reference model's vocabulary (ids fit its 64-token model)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from gemmaserve.testing.reference_model import CharTokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(CharTokenizer(64).tokenizer_json()),
                                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def llm():
    model = _llm()
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf_llm():
    from gemmaserve.hf_tokenizer import HFTokenizerAdapter

    model = _llm(tokenizer=HFTokenizerAdapter(_hf_tokenizer(), "reference", chat_template=TEMPLATE))
    yield model
    model.close()


PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
TOOL_CALLS = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "paris"}'}}]


# -- item 1: generate's vLLM keywords ---------------------------------------------------------------------------
def test_generate_takes_vllms_keywords_at_their_neutral_values(llm) -> None:
    plain = llm.generate(["hi", "yo"], PARAMS)
    for options in ({"lora_request": None}, {"priority": None}, {"priority": [0, 0]},
                    {"tokenization_kwargs": None}, {"tokenization_kwargs": {}},
                    {"lora_request": None, "priority": [0, 0], "tokenization_kwargs": None, "use_tqdm": False}):
        outs = llm.generate(["hi", "yo"], PARAMS, **options)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], options


@pytest.mark.parametrize(("options", "words"), [
    ({"lora_request": object()}, "LLM.generate(lora_request=<object"),
    ({"priority": [1, 0]}, "LLM.generate(priority=[1, 0]) is not implemented by gemmaserve (requests are served "
     "first come, first served"),
    ({"priority": [True, False]}, "priority=[True, False]"),
    ({"priority": 0}, "priority=0"),
    ({"tokenization_kwargs": {"add_special_tokens": False}}, "tokenization_kwargs={'add_special_tokens': False}"),
    ({"priority": [0]}, "priority has 1 entries for 2 prompts"),
])
def test_generate_refuses_other_values_by_name(llm, options, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["hi", "yo"], PARAMS, **options)
    assert words in str(info.value)


def test_chat_shares_the_refusal_and_takes_vllms_positional_order(llm) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match=r"LLM\.chat\(lora_request=<object.*LoRA adapters are not "
                       r"supported\); leave it unset or None"):
        llm.chat(messages, PARAMS, True, object())
    assert llm.chat(messages, PARAMS, True, None, None, "string")[0].token_ids  # vLLM's order, "string" format
    with pytest.raises(InvalidRequestError, match="chat_template_content_format='openai'.*'auto' or 'string'"):
        llm.chat(messages, PARAMS, chat_template_content_format="openai")


# -- item 2: enable_prefix_caching=True with the cache off ------------------------------------------------------
def test_enable_prefix_caching_with_the_cache_off_is_refused() -> None:
    settings = CoreSettings(prefix_cache_blocks=0, max_active_kv_tokens=8192)
    backend = ReferenceBackend(max_model_len=512)
    engine = Engine(backend, settings, None, owns_backend=True)
    try:
        with pytest.raises(ConfigurationError) as info:
            LLM(engine=engine, enable_prefix_caching=True)
        message = str(info.value)
        assert "LLM(enable_prefix_caching=True) asks for prefix caching" in message
        assert "prefix_cache_blocks / PREFIX_CACHE_BLOCKS is 0" in message
    finally:
        engine.shutdown()
        backend.close()
    with LLM(engine=Engine(ReferenceBackend(), settings, None, owns_backend=True), enable_prefix_caching=None) as off:
        assert off.generate("hi", PARAMS)[0].token_ids  # unset: no refusal
    on = CoreSettings(max_active_kv_tokens=8192)  # PREFIX_CACHE_BLOCKS' default: the cache is on
    with LLM(engine=Engine(ReferenceBackend(), on, None, owns_backend=True), enable_prefix_caching=True) as llm:
        assert llm.generate("hi", PARAMS)[0].token_ids


# -- item 3: messages as the server reads them ------------------------------------------------------------------
def test_chat_joins_text_parts_as_the_server_does(llm) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = llm.tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert llm.chat(parts, PARAMS)[0].prompt_token_ids == joined


def test_chat_gives_the_template_tool_call_arguments_as_objects(hf_llm) -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = hf_llm.chat(messages, PARAMS)[0]
    assert out.prompt == "user: weather?; assistant:  call get(city:paris); tool: sunny; model:"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert hf_llm.chat(parts, PARAMS)[0].prompt == "user: a\nb; model:"


@pytest.mark.parametrize(("messages", "words"), [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
     "LLM.chat: message 0 field 'content': a 'image_url' part is not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}],
     "LLM.chat: message 1 field 'role': Input should be 'system', 'user', 'assistant', 'tool' or 'developer'"),
    ([{"role": "user", "content": "hi", "images": ["x"]}], "LLM.chat: message 0: message field 'images' is not "
     "supported"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "LLM.chat: message 0: tool call 'f': arguments must be a JSON object"),
    ([{"content": "hi"}], "LLM.chat: message 0 field 'role': Field required"),
])
def test_chat_refuses_what_the_server_refuses(llm, messages, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(messages, PARAMS)
    assert words in str(info.value)


def test_a_bad_message_of_several_conversations_names_its_conversation(llm) -> None:
    with pytest.raises(InvalidRequestError, match="LLM.chat: conversation 1, message 0 field 'content'"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "image"}]}]], PARAMS)


# -- item 9: chat_template_kwargs keys LLM.chat sets itself -----------------------------------------------------
@pytest.mark.parametrize(("kwargs", "words"), [
    ({"add_generation_prompt": False}, "chat_template_kwargs cannot set add_generation_prompt: LLM.chat passes it "
     "to the chat template itself; pass add_generation_prompt as LLM.chat's argument"),
    ({"tokenize": False}, "chat_template_kwargs cannot set tokenize"),
    ({"messages": [], "tools": []}, "chat_template_kwargs cannot set messages, tools"),
    ({"continue_final_message": True}, "cannot set continue_final_message"),
    ({1: "x"}, "chat_template_kwargs must be a dict of template variables"),
])
def test_reserved_chat_template_kwargs_are_refused_by_name(hf_llm, kwargs, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        hf_llm.chat([{"role": "user", "content": "hi"}], PARAMS, chat_template_kwargs=kwargs)
    assert words in str(info.value)


def test_other_chat_template_kwargs_and_the_call_options_reach_the_template(hf_llm) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert hf_llm.chat(messages, PARAMS, chat_template_kwargs={"extra": "x"})[0].prompt == "user: hi; model:x"
    assert hf_llm.chat(messages, PARAMS, add_generation_prompt=False)[0].prompt == "user: hi; "
    with pytest.raises(InvalidRequestError, match="add_generation_prompt must be a bool"):
        hf_llm.chat(messages, PARAMS, add_generation_prompt="no")  # type: ignore[arg-type]


# -- item 5: get_tokenizer is the Hugging Face tokenizer ---------------------------------------------------------
def test_get_tokenizer_is_the_hugging_face_tokenizer_with_the_engines_template(hf_llm) -> None:
    from transformers import PreTrainedTokenizerBase

    tok = hf_llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase) and tok is hf_llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "user: hi; model:"
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == hf_llm.chat(
        messages, PARAMS)[0].prompt
    assert tok.eos_token_id == 2 and len(tok) == len(hf_llm.tokenizer.hf) and tok("hi")["input_ids"] == tok.encode("hi")
    assert tok.batch_decode([tok.encode("hi")]) == ["hi"]
    assert hf_llm.tokenizer.hf.chat_template is None  # the wrapped tokenizer is left as it was


def test_as_hf_follows_the_adapters_template() -> None:
    from gemmaserve.hf_tokenizer import GEMMA_CHAT_TEMPLATE, HFTokenizerAdapter

    hf = _hf_tokenizer()
    adapter = HFTokenizerAdapter(hf)  # <start_of_turn> / <end_of_turn> in the vocabulary: Gemma's default
    assert adapter.chat_template_source == "gemma-default" and adapter.as_hf().chat_template == GEMMA_CHAT_TEMPLATE
    adapter.set_chat_template(TEMPLATE)
    assert adapter.as_hf().chat_template == TEMPLATE and hf.chat_template is None
    hf.chat_template = TEMPLATE
    assert HFTokenizerAdapter(hf).as_hf() is hf  # the tokenizer's own template: the tokenizer itself


def test_get_tokenizer_of_a_tokenizer_without_hugging_face_is_that_tokenizer(llm) -> None:
    assert llm.get_tokenizer() is llm.tokenizer  # the reference backend's CharTokenizer


# -- item 8: CompletionOutput.finished() ---------------------------------------------------------------------------
def test_finished_is_a_bool_on_the_output_and_a_method_on_its_samples(llm) -> None:
    out = llm.generate("hi", PARAMS)[0]
    assert out.finished is True and out.outputs[0].finished() is True
    assert isinstance(out.outputs[0], CompletionOutput)
    assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text
    many = llm.generate("hi", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3))[0]
    assert many.finished is True and [s.finished() for s in many.outputs] == [True] * 3
    assert [s.index for s in many.outputs] == [0, 1, 2] and many.outputs[0].token_ids == many.token_ids
