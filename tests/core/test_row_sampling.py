"""``Request.row_sampling`` builds the per-step view of its parameters directly when nothing but the parameters
shapes it (no constraint, bad words or penalties, past ``min_tokens``): the same ``RowSampling`` the general
construction (``RowSampling.for_params``) gives, for every parameter mix and step, ahead or not, finished or not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.engine.request import MAX_TOP_K, FinishReason, Request, RequestState
from gemmaserve.sampling_params import RowSampling, SamplingParams

_EOS = (1, 2)

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.sampled_from([0, 5, 10**30]),
    min_p=st.sampled_from([0.0, 0.1]),
    min_tokens=st.integers(0, 6),
    ignore_eos=st.booleans(),
    stop_token_ids=st.sampled_from([(), (7, 9)]),
    logit_bias=st.sampled_from([(), ((3, 1.5), (4, -2.0))]),
    logprobs=st.sampled_from([None, 0, 3]),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**40),
)


@settings(max_examples=200, deadline=None)
@given(params=params_strategy, generated=st.lists(st.integers(3, 60), max_size=10), ahead=st.integers(0, 1),
       finish=st.booleans())
def test_row_sampling_is_the_general_construction(params: SamplingParams, generated: list[int], ahead: int,
                                                 finish: bool) -> None:
    request = Request("r", (5, 6, 7), params, eos_token_ids=_EOS)
    request.advance(RequestState.PREFILLING)
    request.advance(RequestState.DECODING)
    for token in generated:
        if request.is_finished:
            break
        request.append_token(token, None, _EOS)
    if finish and not request.is_finished:
        request.finish(FinishReason.LENGTH)
    if params.has_penalties and ahead and not request.is_finished:
        return  # a penalized row samples ahead only with its token taken (deferred sampling): other tests
    got = request.row_sampling(ahead=ahead)
    step = len(request.output_token_ids) + ahead
    top_k = min(params.top_k, MAX_TOP_K)
    if request.is_finished or not params.has_penalties:
        expected = RowSampling.for_params(params, request.seed, step, _EOS, top_k=top_k)
    else:
        counts: dict[int, int] = {}
        for token in request.output_token_ids:
            counts[token] = counts.get(token, 0) + 1
        expected = RowSampling.for_params(
            params, request.seed, step, _EOS, top_k=top_k,
            prompt_tokens=frozenset(request.prompt_token_ids) if params.repetition_penalty != 1.0 else frozenset(),
            output_counts=tuple(counts.items()))
    assert got == expected
