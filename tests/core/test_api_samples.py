"""``SamplingParams(n=...)`` offline: ``LLM.generate`` runs n samples of a prompt, each its own engine request
(``for_sample``: seed + i), and returns one output per prompt whose ``outputs`` hold the samples in order, as
vLLM's ``RequestOutput.outputs``; the samples share the prompt's prefill (prefix cache); n is refused where one
sample is all that can come back (``stream``, a raw engine request)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gemmaserve.api import LLM
from gemmaserve.engine.engine import Engine
from gemmaserve.errors import InvalidRequestError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import MAX_N, SamplingParams
from gemmaserve.settings import load_settings
from gemmaserve.testing.reference_backend import ReferenceBackend


@pytest.fixture
def llm() -> Iterator[LLM]:
    backend = ReferenceBackend(max_model_len=512)
    settings = load_settings(device="cpu", max_batch_size=8, prefill_chunk_tokens=8, kv_block_size=4)
    cache = CacheManager(256, 4)  # what build_engine attaches (PREFIX_CACHE_BLOCKS)
    backend.set_cache_adapter(cache)
    engine = Engine(backend, settings, cache, owns_backend=True)
    with LLM(settings=engine.settings, engine=engine) as model:
        yield model


def test_n_samples_are_the_per_sample_requests(llm: LLM) -> None:
    prompt = [5 + i % 7 for i in range(30)]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    out = llm.generate([prompt], params)
    assert len(out) == 1
    samples = out[0].outputs
    assert [s.index for s in samples] == [0, 1, 2] and out[0].token_ids == samples[0].token_ids
    for i, sample in enumerate(samples):
        alone = llm.generate([prompt], params.for_sample(i))[0]
        assert sample.token_ids == alone.token_ids and alone.outputs == [alone] and alone.samples == ()
    assert len({tuple(s.token_ids) for s in samples}) > 1  # seeds 11, 12, 13 draw differently here


def test_prompts_with_different_n_keep_their_order(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(n=2, max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(n=4, max_tokens=2, temperature=0.8, seed=1, ignore_eos=True, stop=["\x00\x01"])]
    out = llm.generate(prompts, params)
    assert [len(o.outputs) for o in out] == [1, 2, 4]
    assert [o.prompt_token_ids for o in out] == prompts
    greedy = llm.generate([prompts[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    assert all(s.token_ids == greedy for s in out[1].outputs)  # greedy samples agree


def test_the_samples_share_the_prompts_prefill(llm: LLM) -> None:
    prompt = [5 + (3 * i) % 11 for i in range(64)]
    before = llm.engine.scheduler.stats()
    llm.generate([prompt], SamplingParams(n=4, max_tokens=2, temperature=1.0, seed=3, ignore_eos=True))
    after = llm.engine.scheduler.stats()
    computed = (after.prompt_tokens - after.cached_tokens) - (before.prompt_tokens - before.cached_tokens)
    assert after.prompt_tokens - before.prompt_tokens == 4 * 64
    assert computed <= 64 + 3 * 8, computed  # the prompt once, then at most a chunk each


def test_n_is_refused_where_one_sample_comes_back(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="n=2"):
        list(llm.stream([5, 6], SamplingParams(n=2, temperature=0)))
    with pytest.raises(InvalidRequestError, match="one sample"):
        llm.engine.submit([5, 6], SamplingParams(n=2, temperature=0))
    for bad in (0, MAX_N + 1, True, 2.0):
        with pytest.raises(InvalidRequestError, match="n must be an integer"):
            SamplingParams(n=bad, temperature=0)
    with pytest.raises(ValueError, match="outside"):
        SamplingParams(n=2, temperature=0).for_sample(2)
    assert SamplingParams(n=3, temperature=1.0, seed=2**63 - 1).for_sample(2).seed == 1
    assert SamplingParams(n=3, temperature=1.0).for_sample(1).seed is None
