"""Top logprobs (``logprobs`` = k on completions, ``top_logprobs`` = k on chat) through the official ``openai``
client, streamed and not: k alternatives per token, most likely first, the sampled token's logprob among them
when it is one of the k, the same alternatives streamed as returned whole; offline through
``SamplingParams(logprobs=k)`` on custom-cpu and hf (same alternatives: fp32 on CPU); a backend without the
capability refuses k > 0 with a clear error."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny-top-logprobs"


@pytest.fixture(scope="module")
def client(chat_checkpoint) -> Iterator[Any]:
    """The official client over an in-process app serving the tiny Gemma 4 checkpoint on custom-cpu."""
    pytest.importorskip("gemmaserve_custom_torch")
    from server_harness import custom_cpu_openai_client

    with custom_cpu_openai_client(chat_checkpoint, MODEL) as client:
        yield client


def _check_alternatives(pairs: list[tuple[str, float]], k: int, sampled: tuple[str, float], greedy: bool) -> None:
    assert len(pairs) == k
    values = [value for _, value in pairs]
    assert values == sorted(values, reverse=True) and all(value <= 0.0 for value in values)
    assert math.log(sum(math.exp(v) for v in values)) <= 1e-9  # k of one distribution
    if greedy:  # the argmax is the first alternative, or ties with it exactly (fp32 logits can tie)
        assert abs(pairs[0][1] - sampled[1]) < 1e-9
        assert sampled[0] in [text for text, value in pairs if abs(value - pairs[0][1]) < 1e-9]
    assert sampled[1] <= values[0] + 1e-9


def test_completions_logprobs_k(client) -> None:
    for temperature in (0.0, 1.0):
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=temperature, seed=3,
                                        logprobs=3, extra_body={"ignore_eos": True})
        logprobs = out.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.top_logprobs) == 6
        for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert token in top and abs(top[token] - value) < 1e-9  # the sampled token is always there
            best = sorted(top.items(), key=lambda kv: -kv[1])
            assert 1 <= len(top) <= 4  # k, plus the sampled token when it is not among them (texts may coincide)
            if temperature == 0.0:  # the argmax: no alternative is likelier (an exact tie may be listed first)
                assert abs(best[0][1] - value) < 1e-9
        chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=temperature,
                                                seed=3, logprobs=3, stream=True, extra_body={"ignore_eos": True}))
        streamed = [top for c in chunks if c.choices and c.choices[0].logprobs
                    for top in c.choices[0].logprobs.top_logprobs]
        assert [sorted(top) for top in streamed] == [sorted(top) for top in logprobs.top_logprobs]
        # values: equal up to fp32 noise (the second request reuses the first one's prompt KV)
        assert all(abs(a[key] - b[key]) < 1e-5 for a, b in zip(streamed, logprobs.top_logprobs) for key in a)


def test_chat_top_logprobs_k(client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for temperature in (0.0, 0.8):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=temperature,
                                               seed=9, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
        content = reply.choices[0].logprobs.content
        assert len(content) == 5
        for entry in content:
            pairs = [(alt.token, alt.logprob) for alt in entry.top_logprobs]
            _check_alternatives(pairs, 4, (entry.token, entry.logprob), temperature == 0.0)
            assert all(alt.bytes == list(alt.token.encode()) for alt in entry.top_logprobs)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                     temperature=temperature, seed=9, logprobs=True, top_logprobs=4,
                                                     stream=True, extra_body={"ignore_eos": True}))
        streamed = [[(alt.token, alt.logprob) for alt in entry.top_logprobs]
                    for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
        whole = [[(alt.token, alt.logprob) for alt in entry.top_logprobs] for entry in content]
        assert [[t for t, _ in pairs] for pairs in streamed] == [[t for t, _ in pairs] for pairs in whole]
        assert all(abs(a - b) < 1e-5 for x, y in zip(streamed, whole) for (_, a), (_, b) in zip(x, y))
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)


def test_top_logprobs_limits_are_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="x", logprobs=21)


def test_offline_logprobs_k_agree_between_custom_cpu_and_hf(chat_checkpoint) -> None:
    from gemmaserve import LLM
    from gemmaserve.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=6, temperature=t, seed=5, ignore_eos=True, logprobs=k)
              for t, k in ((0.0, 5), (1.0, 2), (0.7, 0))]
    runs = {}
    for backend in ("custom-cpu", "hf"):
        llm = LLM(str(chat_checkpoint), backend=backend, device="cpu", dtype="float32", max_batch_size=4)
        try:
            runs[backend] = llm.generate([[5, 6, 7]] * len(params), params)
        finally:
            llm.close()
    for mine, theirs, p in zip(runs["custom-cpu"], runs["hf"], params):
        assert mine.token_ids == theirs.token_ids and len(mine.token_logprobs) == len(mine.logprobs) == 6
        if not p.logprobs:
            assert mine.top_logprobs is None
            continue
        assert [[t for t, _ in top] for top in mine.top_logprobs] == [[t for t, _ in top]
                                                                      for top in theirs.top_logprobs]
        for top, other in zip(mine.top_logprobs, theirs.top_logprobs):
            assert len(top) == p.logprobs and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, other))


def test_a_backend_without_top_logprobs_refuses_k_but_serves_k_0() -> None:
    import dataclasses

    from gemmaserve.engine.engine import Engine
    from gemmaserve.errors import InvalidRequestError
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing.reference_backend import ReferenceBackend

    backend = ReferenceBackend(vocab_size=64)
    backend.capabilities = dataclasses.replace(backend.capabilities, top_logprobs=False)
    engine = Engine(backend, CoreSettings(device="cpu"))
    try:
        with pytest.raises(InvalidRequestError, match="alternatives"):
            engine.submit([5, 6], SamplingParams(max_tokens=3, logprobs=2))
        out = engine.submit([5, 6], SamplingParams(max_tokens=3, logprobs=0, ignore_eos=True)).result(timeout=30)
    finally:
        engine.shutdown(timeout=10)
    assert len(out.logprobs or []) == 3 and out.top_logprobs is None
