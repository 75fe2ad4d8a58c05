"""``bad_words`` (vLLM's meaning) through the engine on the reference backend (one character per token): a
word's token sequences never appear in the generated tokens, whether it is one token or several, with or
without a leading space, greedy or sampled; other requests in the batch are unaffected; bad input is refused
by name."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve.engine.engine import Engine
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.reference_backend import ReferenceBackend

_word = st.text(alphabet="abcde", min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=st.lists(_word, min_size=1, max_size=4), temperature=st.sampled_from([0.0, 1.0, 3.0]),
       seed=st.integers(0, 50), spaced=st.booleans())
def test_a_bad_word_never_appears_in_the_output(words, temperature, seed, spaced) -> None:
    backend = ReferenceBackend(vocab_size=64)
    engine = Engine(backend, CoreSettings(device="cpu", max_batch_size=4))
    words = [(" " + w) if spaced else w for w in words]
    banned = SamplingParams(max_tokens=40, temperature=temperature, seed=seed, ignore_eos=True, bad_words=words)
    free = SamplingParams(max_tokens=40, temperature=temperature, seed=seed, ignore_eos=True)
    try:
        outs = [engine.submit([5, 6, 7], p).result(timeout=60) for p in (banned, free)]
        together = [h.result(timeout=60) for h in [engine.submit([5, 6, 7], p) for p in (free, banned)]]
    finally:
        engine.shutdown(timeout=10)
    tokens = outs[0].token_ids
    for word in words:  # token-level (vLLM's definition): neither tokenization occurs in the output
        for text in (word.lstrip(), " " + word.lstrip()):
            seq = backend.tokenizer.encode(text, add_special_tokens=False)
            assert not any(tokens[i:i + len(seq)] == seq for i in range(len(tokens))), (word, tokens)
    assert len(tokens) == 40
    assert together[0].token_ids == outs[1].token_ids  # the unbanned request does not feel its neighbour's bans
    assert together[1].token_ids == outs[0].token_ids  # ... nor the banned one its neighbour


def test_bad_words_are_checked_and_a_streaming_backend_refuses_them() -> None:
    for bad, words in ([[""], "non-blank"], [["x"] * 129, "at most 128"], [[5], "strings"]):
        with pytest.raises(InvalidRequestError, match=words):
            SamplingParams(bad_words=bad)
    engine = Engine(ReferenceBackend(vocab_size=64), CoreSettings(device="cpu"))
    try:
        with pytest.raises(InvalidRequestError, match="64 are accepted"):
            engine.submit([5], SamplingParams(bad_words=["abcde" * 14]))
    finally:
        engine.shutdown(timeout=10)
    streaming = Engine(ReferenceBackend(vocab_size=64, streaming_only=True), CoreSettings(device="cpu"))
    try:
        with pytest.raises(InvalidRequestError, match="cannot ban bad_words"):
            streaming.submit([5], SamplingParams(bad_words=["ab"]))
        # penalties need the tokens sampled so far at every step, which a whole-generation stream does not take
        with pytest.raises(InvalidRequestError, match="^frequency_penalty: .* cannot apply penalties"):
            streaming.submit([5], SamplingParams(frequency_penalty=1.0))
        with pytest.raises(InvalidRequestError, match="^repetition_penalty and presence_penalty: "):
            streaming.submit([5], SamplingParams(repetition_penalty=1.2, presence_penalty=-0.5))
        assert streaming.submit([5], SamplingParams(max_tokens=2)).result().token_ids
    finally:
        streaming.shutdown(timeout=10)


def test_choices_sharing_their_params_tokenize_bad_words_and_build_masks_once() -> None:
    """The ``n`` choices of a request (``for_sample`` copies of one params) are validated together: their
    ``bad_words`` are tokenized once and their ``allowed_token_ids`` mask is built once (per choice, a 1,024-choice
    batch re-tokenized 128 words 1,024 times on the server's event loop), and every choice still gets both."""
    backend = ReferenceBackend(vocab_size=64)
    calls = []
    encode = backend.tokenizer.encode

    def counting(text, *args, **kwargs):
        calls.append(text)
        return encode(text, *args, **kwargs)

    backend.tokenizer.encode = counting
    engine = Engine(backend, CoreSettings(device="cpu", max_batch_size=4))
    params = SamplingParams(n=6, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True, bad_words=["ab", "c"],
                            allowed_token_ids=list(range(5, 40)))
    try:
        handles = engine.submit_many([[5, 6]] * 6, [params.for_sample(j) for j in range(6)])
        outs = [handle.result(timeout=60) for handle in handles]
    finally:
        engine.shutdown(timeout=10)
    assert len(calls) == 4, calls  # two words, each as given and with a leading space
    for out in outs:
        assert all(5 <= t < 40 for t in out.token_ids)
        assert backend.tokenizer.encode("c", add_special_tokens=False)[0] not in out.token_ids
    assert len({tuple(out.token_ids) for out in outs}) > 1  # the seeds differ per choice


def test_min_tokens_whose_bans_cover_the_vocabulary_is_refused() -> None:
    """Before ``min_tokens`` the EOS and stop ids (and one-token bad_words) are banned; listing the whole (small)
    vocabulary left nothing to sample, and a banned token came out with logprob -inf. Refused by name instead."""
    engine = Engine(ReferenceBackend(vocab_size=64), CoreSettings(device="cpu"))
    try:
        with pytest.raises(InvalidRequestError, match="every token of the vocabulary is banned"):
            engine.submit([5], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(64))))
        with pytest.raises(InvalidRequestError, match="every token of the vocabulary is banned"):
            engine.submit([5], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[0, 1, 3, 4, *range(32, 64)],
                                              bad_words=[chr(c) for c in range(ord("a"), ord("a") + 26)] + ["0"]))
        out = engine.submit([5], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=list(range(1, 64)),
                                                ignore_eos=True)).result(timeout=60)
        assert out.token_ids[:2] == [0, 0]  # token 0 was left unbanned: it is what comes
    finally:
        engine.shutdown(timeout=10)
