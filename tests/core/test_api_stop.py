"""Stop strings in the offline API (``SamplingParams(stop=...)``): generate and stream end at the first match,
cut it from the text, report ``finish_reason="stop"``, keep the tokens up to the one completing the match,
and free the engine request; bad values are rejected with a clear error."""

from __future__ import annotations

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.engine import Engine
from gemmaserve.errors import InvalidRequestError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.settings import CoreSettings
from gemmaserve.testing import ReferenceBackend


@pytest.fixture(params=["sync", "async", "async-mixed"])
def llm(request):
    """The offline API over the reference backend, synchronous and with asynchronous scheduling (decode-only
    launches, and prompt ticks too): stop strings cancel a request whose next step may already be launched."""
    settings = CoreSettings(max_batch_size=8, prefill_chunk_tokens=8, max_active_kv_tokens=8192)
    backend = ReferenceBackend(max_model_len=512, async_decode=request.param != "sync",
                               mixed_step=request.param == "async-mixed")
    cache = CacheManager(64, 4)
    backend.set_cache_adapter(cache)
    model = LLM(settings=settings, engine=Engine(backend, settings, cache, owns_backend=True))
    yield model
    model.close()


def _idle(model: LLM) -> None:
    engine = model.engine
    for _ in range(200):
        if engine.stats().running == 0:
            break
        import time

        time.sleep(0.01)
    engine.check_integrity()
    assert engine.stats().running == 0


PROMPTS = ["hello there", "abc", "the cat sat"]


def test_generate_stops_at_the_first_match_and_cuts_it(llm):
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    stops = [out.text[5:7] for out in plain]
    assert all(len(s) == 2 for s in stops)
    cut = llm.generate(PROMPTS, [SamplingParams(max_tokens=24, ignore_eos=True, stop=[s, "\u2603never"]) for s in stops])
    for full, out, stop in zip(plain, cut, stops):
        where = full.text.index(stop)
        assert out.text == full.text[:where] and out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
        assert stop in llm.tokenizer.decode(out.token_ids)  # the last token completed the stop string
    _idle(llm)


def test_a_stop_string_that_never_matches_changes_nothing(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = llm.generate(PROMPTS, params)
    same = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, stop="\u2603"))
    assert [(o.text, o.token_ids, o.finish_reason) for o in same] == [(o.text, o.token_ids, "length") for o in plain]


def test_stream_stops_like_generate(llm):
    full = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = full.text[6:8]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
    chunks = list(llm.stream("hello there", params))
    text = "".join(chunk.text for chunk in chunks)
    final = chunks[-1]
    assert final.finished and final.output is not None and final.output.finish_reason == "stop"
    assert text == final.output.text == full.text[: full.text.index(stop)]
    assert [t for chunk in chunks for t in chunk.token_ids] == final.output.token_ids
    _idle(llm)


@pytest.mark.parametrize("bad", ["", [""], [3], 7, {"a": 1}])
def test_bad_stop_values_are_rejected(bad):
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=bad)


def test_stop_accepts_one_string_or_none():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_text_that_can_never_fit_is_refused_before_tokenizing(llm):
    from gemmaserve.errors import PromptTooLongError

    calls = []
    original = llm.tokenizer.encode
    llm.tokenizer.encode = lambda text, **kw: calls.append(len(text)) or original(text, **kw)
    try:
        with pytest.raises(PromptTooLongError, match="characters"):
            llm.generate(["a" * 100_000], SamplingParams(max_tokens=2))
        assert calls == []
        assert llm.generate(["hello"], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        del llm.tokenizer.encode
    _idle(llm)


def test_a_stop_string_before_min_tokens_does_not_stop(llm):
    """vLLM's rule, offline and streamed: a stop string ending before the min_tokens-th token is kept in the
    text; the first one ending at or after it stops the reply."""
    plain = llm.generate(["the cat sat"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    ids, text = plain.token_ids, plain.text
    lengths = [len(llm.tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    end_token = (lambda end: next(k for k, n in enumerate(lengths) if n >= end))  # the token completing it
    stop = text[2:4]
    ends = [i + len(stop) for i in range(len(text)) if text.startswith(stop, i)]
    min_tokens = end_token(ends[0]) + 1  # the first match ends too early
    later = [end for end in ends if end_token(end) >= min_tokens]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
    out = llm.generate(["the cat sat"], params)[0]
    streamed = "".join(chunk.text for chunk in llm.stream("the cat sat", params))
    if later:
        assert out.finish_reason == "stop" and out.text == text[:later[0] - len(stop)]
    else:
        assert out.finish_reason == "length" and out.text == text
    assert streamed == out.text and stop in out.text
    _idle(llm)


def test_stop_strings_are_bounded_in_length() -> None:
    """A request keeps its stop strings while it runs: each is at most MAX_STOP_STRING_CHARS characters."""
    from gemmaserve.sampling_params import MAX_STOP_STRING_CHARS

    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRING_CHARS}"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
