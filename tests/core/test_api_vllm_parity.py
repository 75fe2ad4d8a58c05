"""The offline API as vLLM users know it: what they pass works or is refused by name, values mean what vLLM means.

Stop tokens' text (EOS, ``stop_token_ids``) is left out of the text unless ``include_stop_str_in_output``; outputs
carry ``stop_reason``, ``cumulative_logprob``, vLLM-shaped ``logprobs``, ``finished``, ``num_cached_tokens``;
``LLM.chat`` renders with the chat template; vLLM's prompt dicts; keyword-only ``SamplingParams`` with vLLM's
option names; strict ``logit_bias`` keys; ``max_tokens=None``; a closed LLM says so."""

from __future__ import annotations

import dataclasses

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.api import Logprob, LLMClosedError
from gemmaserve.engine import Engine
from gemmaserve.errors import InvalidRequestError, PromptTooLongError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.settings import CoreSettings
from gemmaserve.testing import ReferenceBackend
from gemmaserve.testing.reference_model import EOS_ID, EOT_ID

NEVER = "\u2603never"  # a stop string that never matches: the stop-string (watcher) path


def _llm(max_model_len: int = 512) -> LLM:
    settings = CoreSettings(max_batch_size=8, prefill_chunk_tokens=8, max_active_kv_tokens=8192)
    backend = ReferenceBackend(max_model_len=max_model_len)
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    return LLM(settings=settings, engine=Engine(backend, settings, cache, owns_backend=True))


@pytest.fixture(scope="module")
def llm():
    model = _llm()
    yield model
    model.close()


def _plain(llm: LLM, prompt: str = "hello there", max_tokens: int = 24):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


# -- item 2: the stop token's text ---------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [(), (NEVER,)], ids=["plain", "stop-strings"])
def test_a_stop_token_ends_the_output_without_its_text(llm, stop) -> None:
    plain = _plain(llm)
    token = plain.token_ids[5]
    cut = plain.token_ids.index(token)
    out = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[token],
                                                     stop=list(stop)))[0]
    assert out.token_ids == plain.token_ids[: cut + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(plain.token_ids[:cut]) and out.stop_reason == token
    kept = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[token],
                                                      stop=list(stop), include_stop_str_in_output=True))[0]
    assert kept.token_ids == out.token_ids and kept.text == llm.tokenizer.decode(out.token_ids)


def test_stream_leaves_the_stop_token_text_out_too(llm) -> None:
    plain = _plain(llm)
    token = plain.token_ids[5]
    chunks = list(llm.stream("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[token])))
    final = chunks[-1].output
    assert final is not None and "".join(chunk.text for chunk in chunks) == final.text
    assert final.text == llm.tokenizer.decode(final.token_ids[:-1]) and final.token_ids[-1] == token
    assert [t for chunk in chunks for t in chunk.token_ids] == final.token_ids


def test_eos_stays_in_token_ids_and_stop_reason_is_none(llm) -> None:
    out = llm.generate("hello", SamplingParams(max_tokens=4, logit_bias={EOS_ID: 100}, skip_special_tokens=False))[0]
    assert out.token_ids == [EOS_ID] and out.text == "" and out.finish_reason == "stop" and out.stop_reason is None
    shown = llm.generate("hello", SamplingParams(max_tokens=4, logit_bias={EOS_ID: 100}, skip_special_tokens=False,
                                                 include_stop_str_in_output=True))[0]
    assert shown.text == "<eos>"
    listed = llm.generate("hello", SamplingParams(max_tokens=4, logit_bias={EOS_ID: 100}, stop_token_ids=[EOS_ID]))[0]
    assert listed.finish_reason == "stop" and listed.stop_reason is None  # an EOS id reports None, listed or not
    forced = llm.generate("hello", SamplingParams(max_tokens=4, logit_bias={EOS_ID: 100}, stop_token_ids=[EOS_ID],
                                                  ignore_eos=True))[0]
    assert forced.token_ids == [EOS_ID] and forced.stop_reason == EOS_ID  # vLLM: ignore_eos, then a listed stop


def test_only_the_tokenizers_own_eos_reports_none() -> None:
    """vLLM's rule: its ``eos_token_id`` (the tokenizer's) reports ``stop_reason`` None; the model's other EOS ids
    (its generation config's, e.g. Gemma's ``<end_of_turn>``) are stop tokens there and report their id."""
    from gemmaserve.sampling_params import primary_eos_ids

    class Tokenizer:
        eos_token_ids = (1,)

    model_eos = (1, 106)
    primary = primary_eos_ids(Tokenizer(), model_eos)
    assert primary == {1} and primary_eos_ids(object(), model_eos) == {1, 106}
    params = SamplingParams()
    assert [params.stop_reason(token, primary) for token in (1, 106, None)] == [None, 106, None]
    assert SamplingParams(stop_token_ids=[1], ignore_eos=True).stop_reason(1, primary) == 1


def test_include_stop_str_in_output_keeps_the_stop_string(llm) -> None:
    plain = _plain(llm)
    stop = plain.text[5:7]
    where = plain.text.index(stop)
    cut = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    kept = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True))[0]
    assert cut.text == plain.text[:where] and kept.text == plain.text[: where + len(stop)]
    assert cut.stop_reason == kept.stop_reason == stop and kept.token_ids == cut.token_ids
    chunks = list(llm.stream("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop],
                                                           include_stop_str_in_output=True)))
    assert "".join(chunk.text for chunk in chunks) == kept.text


def test_skip_special_tokens_false_shows_them(llm) -> None:
    params = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {EOT_ID: 100}}
    for stop in ((), (NEVER,)):
        hidden = llm.generate("hi", SamplingParams(**params, stop=list(stop)))[0]
        shown = llm.generate("hi", SamplingParams(**params, stop=list(stop), skip_special_tokens=False))[0]
        assert hidden.text == "" and shown.text == "<end_of_turn>" * 3


# -- item 1: vLLM's output fields ---------------------------------------------------------------------------------
def test_outputs_have_vllms_fields(llm) -> None:
    out = llm.generate("logprobs", SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert out.finished is True and out.num_cached_tokens == out.cached_tokens and out.prompt_logprobs is None
    assert out.outputs == [out] and out.outputs[0].finished() is True  # vLLM's CompletionOutput.finished()
    assert out.stop_reason is None and out.finish_reason == "length"
    assert out.token_logprobs is not None and len(out.token_logprobs) == len(out.logprobs) == 6
    assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs))
    for token, value, entry, top in zip(out.token_ids, out.token_logprobs, out.logprobs, out.top_logprobs):
        assert isinstance(entry[token], Logprob) and entry[token].logprob == value
        assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert set(entry) == {token, *(t for t, _ in top)}
        for rank, (alternative, logprob) in enumerate(top, 1):
            assert entry[alternative].rank == rank and entry[alternative].logprob == pytest.approx(logprob)
        if token not in dict(top):
            assert entry[token].rank is None
    greedy = llm.generate("logprobs", SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0]
    assert all(entry[token].rank == 1 for token, entry in zip(greedy.token_ids, greedy.logprobs))
    none = llm.generate("logprobs", SamplingParams(max_tokens=3))[0]
    assert none.logprobs is None and none.token_logprobs is None and none.cumulative_logprob is None


def test_a_stop_string_cut_keeps_logprobs_and_metrics_in_step(llm) -> None:
    plain = _plain(llm)
    stop = plain.text[5:7]
    for out in (llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop],
                                                           logprobs=0))[0],
                list(llm.stream("hello there", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop],
                                                              logprobs=0)))[-1].output):
        assert out is not None and out.metrics is not None
        assert len(out.token_ids) == len(out.logprobs) == len(out.token_logprobs) == out.metrics.num_output_tokens


# -- item 3: chat, get_tokenizer, use_tqdm ------------------------------------------------------------------------
def test_chat_renders_with_the_template_and_stops_at_the_turn_end(llm) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = llm.tokenizer.apply_chat_template(messages)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt_token_ids == ids and out.prompt == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert out.token_ids == llm.generate([ids], params)[0].token_ids
    both = llm.chat([messages, [{"role": "user", "content": "yo"}]], params)
    assert [o.prompt_token_ids for o in both] == [ids, llm.tokenizer.apply_chat_template([{"role": "user",
                                                                                          "content": "yo"}])]
    assert llm.get_tokenizer() is llm.tokenizer
    for bad, words in (([], "messages"), ("hi", "messages"), ([[{"role": "user", "content": "x"}], "y"], "item 1")):
        with pytest.raises(InvalidRequestError, match=words):
            llm.chat(bad, params)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        llm.chat(messages, params, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.chat(messages, params, lora_request=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):  # the reference tokenizer takes none
        llm.chat(messages, params, add_generation_prompt=False)


def test_chat_ends_at_the_templates_turn_end_token() -> None:
    model = _llm()
    try:
        model.tokenizer.chat_stop_token_ids = (EOT_ID,)
        messages = [{"role": "user", "content": "hi"}]
        out = model.chat(messages, SamplingParams(max_tokens=4, logit_bias={EOT_ID: 100}))[0]
        assert out.token_ids == [EOT_ID] and out.finish_reason == "stop" and out.stop_reason == EOT_ID
        assert out.text == ""
    finally:
        model.close()


def test_use_tqdm_is_accepted(llm) -> None:
    for value in (True, False, lambda *a, **k: None):
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=value)[0].token_ids
    with pytest.raises(InvalidRequestError, match="use_tqdm"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm="yes")  # type: ignore[arg-type]


# -- item 5: SamplingParams as vLLM's ----------------------------------------------------------------------------
def test_sampling_params_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="keyword arguments only"):
        SamplingParams(2)  # type: ignore[misc]  # vLLM's first positional is n
    with pytest.raises(TypeError, match="did you mean 'max_tokens'"):
        SamplingParams(max_token=2)  # type: ignore[call-arg]
    assert dataclasses.replace(SamplingParams(n=2, temperature=0), n=1).n == 1


@pytest.mark.parametrize(("options", "words"), [
    ({"best_of": 3}, "best_of"), ({"prompt_logprobs": 1}, "prompt_logprobs"),

    ({"spaces_between_special_tokens": False}, "spaces_between"), ({"detokenize": False}, "detokenize"),
    ({"guided_decoding": {"regex": "a"}}, "structured_outputs"), ({"logits_processors": [print]}, "logits"),
    ({"output_kind": 1}, "stream"), ({"extra_args": {"a": 1}}, "extra_args"),
])
def test_vllm_options_not_implemented_are_refused_by_name(options, words) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams(**options)


def test_vllm_options_at_their_neutral_value_are_accepted() -> None:
    neutral = {"best_of": 2, "n": 2, "prompt_logprobs": None, "allowed_token_ids": None, "truncate_prompt_tokens": None,
               "spaces_between_special_tokens": True, "detokenize": True, "guided_decoding": None,
               "logits_processors": [], "output_kind": None, "extra_args": None, "temperature": 0}
    assert SamplingParams(**neutral) == SamplingParams(n=2, temperature=0)


# -- item 6: logit_bias keys -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{5.7: 1}, {True: 1}, {" 5 ": 1}, {"\u0665": 1}, {"05": 1}, {"+5": 1}, {"5": 1, 5: 2}])
def test_logit_bias_keys_must_be_token_ids(bias) -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_accepts_ints_and_decimal_strings() -> None:
    assert SamplingParams(logit_bias={"5": 1, 7: -2, "0": 3}).logit_bias == ((0, 3), (5, 1), (7, -2))
    with pytest.raises(InvalidRequestError, match="twice"):
        SamplingParams(logit_bias=[(5, 1), (5, 2)])


# -- item 4: vLLM's prompt dicts ---------------------------------------------------------------------------------
def test_prompt_dicts(llm) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("dict prompt")
    base = llm.generate("dict prompt", params)[0]
    assert llm.generate({"prompt": "dict prompt"}, params)[0].token_ids == base.token_ids
    assert [o.token_ids for o in llm.generate([{"prompt": "dict prompt"}, {"prompt_token_ids": ids}], params)] == [
        base.token_ids] * 2
    assert llm.generate({"prompt_token_ids": ids}, params)[0].prompt is None
    assert "".join(c.text for c in llm.stream({"prompt": "dict prompt"}, params)) == base.text
    with pytest.raises(InvalidRequestError, match="only text prompts"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, params)
    with pytest.raises(InvalidRequestError, match="'foo'"):
        llm.generate([{"prompt": "x", "foo": 1}], params)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({}, params)


def test_stream_of_a_list_of_prompts_says_so(llm) -> None:
    with pytest.raises(InvalidRequestError, match="one prompt"):
        list(llm.stream(["a b", "c d"], SamplingParams(max_tokens=2)))


# -- item 8: a closed LLM ----------------------------------------------------------------------------------------
def test_a_closed_llm_says_so() -> None:
    model = _llm()
    model.close()
    for call in (lambda: model.generate("hi"), lambda: list(model.stream("hi")),
                 lambda: model.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(LLMClosedError, match="closed") as caught:
            call()
        assert isinstance(caught.value, RuntimeError)
    model.close()


# -- item 7: max_tokens=None -------------------------------------------------------------------------------------
def test_max_tokens_none_runs_to_the_end_of_the_context() -> None:
    model = _llm(max_model_len=40)
    try:
        ids = model.tokenizer.encode("up to the end")
        out = model.generate("up to the end", SamplingParams(max_tokens=None, ignore_eos=True))[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 40 - len(ids)
        with pytest.raises(PromptTooLongError):
            model.generate([[5] * 40], SamplingParams(max_tokens=None))
    finally:
        model.close()


def test_max_tokens_none_stops_at_what_the_kv_pool_holds() -> None:
    """A backend whose KV pool holds fewer tokens per request than the context: ``max_tokens=None`` runs to the
    pool's bound (it asked the whole context before, which every request was then refused for)."""

    class _SmallPool(ReferenceBackend):
        def max_request_tokens(self) -> int | None:
            return 30

    settings = CoreSettings(max_batch_size=2, prefill_chunk_tokens=8, max_active_kv_tokens=8192)
    model = LLM(settings=settings, engine=Engine(_SmallPool(max_model_len=512), settings, owns_backend=True))
    try:
        ids = model.tokenizer.encode("up to the end")
        out = model.generate("up to the end", SamplingParams(max_tokens=None, ignore_eos=True))[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 30 - len(ids)
    finally:
        model.close()


def test_max_num_seqs_is_vllms_name_for_max_batch_size(fake_plugins) -> None:
    from gemmaserve import BackendSpec
    from gemmaserve.errors import ConfigurationError

    fake_plugins("reference-alias", BackendSpec("reference", "gemmaserve.testing:create_reference_backend", ("cpu",),
                                                requires_model=False))
    with LLM(backend="reference", device="cpu", max_num_seqs=3) as model:
        assert model.engine.settings.max_batch_size == 3
    with pytest.raises(ConfigurationError, match="max_num_seqs is vLLM's name for max_batch_size"):
        LLM(backend="reference", device="cpu", max_num_seqs=3, max_batch_size=4)


def test_an_engine_request_refuses_max_tokens_none() -> None:
    settings = CoreSettings(max_batch_size=2)
    engine = Engine(ReferenceBackend(), settings)
    try:
        with pytest.raises(InvalidRequestError, match="max_tokens=None .* resolved by gemmaserve.LLM"):
            engine.submit([5, 6], SamplingParams(max_tokens=None))
    finally:
        engine.shutdown()


def test_sampling_options_under_the_default_greedy_temperature_are_refused() -> None:
    """SamplingParams defaults to greedy (vLLM to temperature 1.0): n, top_p, top_k, min_p or seed given without a
    temperature would silently do nothing, so they are refused with what to pass; an explicit temperature (0
    included) takes them, and numpy scalars are plain numbers."""
    np = pytest.importorskip("numpy")
    for options in ({"n": 4}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 7}):
        with pytest.raises(InvalidRequestError, match="temperature=1.0"):
            SamplingParams(**options)
        assert SamplingParams(**options, temperature=0).temperature == 0.0
        assert SamplingParams(**options, temperature=1.0).temperature == 1.0
    assert SamplingParams(seed=-1).seed is None and SamplingParams(top_k=-1).top_k == 0  # vLLM's "off" values
    with pytest.raises(InvalidRequestError, match="top_k must be"):  # a bad value is named first
        SamplingParams(top_k=-2)
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.25), max_tokens=np.int64(8),
                            seed=np.uint32(3), n=np.int8(2))
    assert (params.temperature, params.top_p, params.max_tokens, params.seed, params.n) == (0.5, 0.25, 8, 3, 2)
    assert [type(v) for v in (params.temperature, params.top_p, params.max_tokens, params.seed)] == [
        float, float, int, int]


def test_beam_search_and_bad_structured_flags_are_refused_by_name(llm) -> None:
    with pytest.raises(InvalidRequestError, match="beam_search is not supported"):
        llm.beam_search(["hi"], None)
    with pytest.raises(InvalidRequestError, match="disable_any_whitespace must be a boolean"):
        SamplingParams(structured_outputs={"regex": "a+", "disable_any_whitespace": "x"})


def test_min_tokens_beyond_the_room_max_tokens_none_leaves_names_min_tokens() -> None:
    model = _llm(max_model_len=64)
    try:
        with pytest.raises(InvalidRequestError, match="min_tokens=100 cannot be met"):
            model.generate([5, 6, 7], SamplingParams(max_tokens=None, min_tokens=100))
        out = model.generate([5, 6, 7], SamplingParams(max_tokens=None, min_tokens=10, ignore_eos=True))[0]
        assert len(out.token_ids) == 64 - 3
    finally:
        model.close()


def test_chat_names_a_lone_surrogate(llm) -> None:
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        llm.chat([{"role": "user", "content": "a\ud800b"}], SamplingParams(max_tokens=2))


def test_allowed_token_ids_restrict_the_output(llm) -> None:
    """vLLM's allowed_token_ids: only those ids are generated (greedy and seeded); ids outside the vocabulary, an
    empty list, or a combination with structured_outputs are refused by name."""
    allowed = [7, 21, 22]
    for temperature in (0.0, 1.3):
        out = llm.generate([5, 6], SamplingParams(max_tokens=10, temperature=temperature, seed=1, ignore_eos=True,
                                                  allowed_token_ids=allowed))[0]
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([5, 6], SamplingParams(max_tokens=2, allowed_token_ids=[10**7]))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must be"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        SamplingParams(allowed_token_ids=[5], structured_outputs={"regex": "a"})


def test_allowed_token_ids_that_bans_cover_are_refused_or_end_the_request(llm) -> None:
    """No token outside allowed_token_ids is ever generated: allowed ids that one-token bad_words (or, before
    min_tokens, EOS and stop ids) all ban are refused; a step where multi-token bad_words ban every allowed id ends
    the request with an error instead of picking a token outside the list."""
    e = llm.tokenizer.encode("e", add_special_tokens=False)
    assert len(e) == 1
    with pytest.raises(InvalidRequestError, match="one of the bad_words"):
        llm.generate([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=e, bad_words=["e"]))
    with pytest.raises(InvalidRequestError, match="min_tokens=3 bans"):
        llm.generate([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[EOS_ID], min_tokens=3))
    with pytest.raises(InvalidRequestError, match="min_tokens=2 bans"):
        llm.generate([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[9], stop_token_ids=[9], min_tokens=2))
    ee = llm.tokenizer.encode("ee", add_special_tokens=False)
    assert ee == e * 2
    for allowed in (e, e * 2):  # repeated ids are one id
        out = llm.generate([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=allowed, bad_words=["ee"],
                                                  ignore_eos=True))[0]
        assert out.token_ids == e and out.finish_reason == "error" and "ban every token" in out.error
    out = llm.generate([5, 6], SamplingParams(max_tokens=6, allowed_token_ids=[EOS_ID, *e], bad_words=["ee"],
                                              min_tokens=4))[0]  # after e: e banned, EOS banned before min_tokens
    assert out.token_ids == e and out.finish_reason == "error" and "ban every token" in out.error


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens() -> None:
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens are the prompt (text or ids, generate and
    stream); -1 keeps what the context holds; text longer than the whole context is accepted when it is truncated;
    an engine request must already fit it; 0 and other values are refused by name."""
    model = _llm(max_model_len=64)
    try:
        ids = list(range(5, 45))
        out = model.generate([ids], SamplingParams(max_tokens=3, truncate_prompt_tokens=6, ignore_eos=True))[0]
        assert out.prompt_token_ids == ids[-6:] and len(out.token_ids) == 3
        alone = model.generate([ids[-6:]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids
        short = model.generate([ids[:5]], SamplingParams(max_tokens=3, truncate_prompt_tokens=-1, ignore_eos=True))[0]
        assert short.prompt_token_ids == ids[:5]
        text = "a" * 100_000  # far more than 64 tokens' worth of text
        out = model.generate(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=10, ignore_eos=True))[0]
        assert len(out.prompt_token_ids) == 10 and out.prompt == text
        chunks = list(model.stream(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=10, ignore_eos=True)))
        assert chunks
        with pytest.raises(PromptTooLongError):
            model.generate(text, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match="truncate it first"):
            model.engine.submit(ids, SamplingParams(max_tokens=2, truncate_prompt_tokens=6))
        for bad in (0, -2, 1.5, True):
            with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be"):
                SamplingParams(truncate_prompt_tokens=bad)
    finally:
        model.close()
