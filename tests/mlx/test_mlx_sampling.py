"""Sampling on mlx arrays: greedy, filters, and randomness that depends only on (seed, step)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from gemmaserve.sampling_params import RowSampling, SamplingParams

from gemmaserve_mlx.sampling import StreamSampler, sample_rows, sample_tokens

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3.0


def test_greedy_is_argmax_and_ignores_seed_and_step() -> None:
    logits = _logits(4)
    expected = np.argmax(np.array(logits), axis=-1).tolist()
    for seed, step in ((0, 0), (5, 9)):
        assert sample_rows(logits, [RowSampling(0.0, 0.5, 3, seed, step)] * 4).token_ids == expected


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch() -> None:
    logits = _logits(5, seed=1)
    rows = [RowSampling(0.8 + 0.1 * i, 0.9, 10 * i, 100 + i, i) for i in range(5)]
    together = sample_rows(logits, rows).token_ids
    alone = [sample_rows(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(5)]
    assert together == alone
    mixed = [RowSampling(0.0, 1.0, 0, 0, 0), rows[1], RowSampling(0.0, 1.0, 0, 0, 0), rows[3], rows[4]]
    assert sample_rows(logits, mixed).token_ids[1::2] == [together[1], together[3]]


def test_seed_and_step_each_change_the_draw() -> None:
    logits = mx.zeros((1, VOCAB))  # uniform: the draw is pure noise
    by_seed = {sample_rows(logits, [RowSampling(1.0, 1.0, 0, seed, 0)]).token_ids[0] for seed in range(20)}
    by_step = {sample_rows(logits, [RowSampling(1.0, 1.0, 0, 3, step)]).token_ids[0] for step in range(20)}
    assert len(by_seed) > 5 and len(by_step) > 5


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = mx.array([[5.0, 4.0, 3.0, 2.0] + [-10.0] * (VOCAB - 4)])
    probs = np.exp(np.array(logits[0]) - np.array(mx.logsumexp(logits[0])))
    top2 = {sample_rows(logits, [RowSampling(5.0, 1.0, 2, s, 0)]).token_ids[0] for s in range(60)}
    assert top2 == {0, 1}
    nucleus = float(probs[0] + probs[1]) - 1e-4  # smallest prefix reaching it: tokens 0 and 1
    top_p = {sample_rows(logits, [RowSampling(1.0, nucleus, 0, s, 0)]).token_ids[0] for s in range(60)}
    assert top_p == {0, 1}
    only_first = {sample_rows(logits, [RowSampling(3.0, 0.01, 0, s, 0)]).token_ids[0] for s in range(20)}
    assert only_first == {0}


def test_sampled_frequencies_follow_the_softmax() -> None:
    logits = mx.array([[math.log(0.6), math.log(0.3), math.log(0.1)] + [-30.0] * (VOCAB - 3)])
    draws = [sample_rows(logits, [RowSampling(1.0, 1.0, 0, seed, 0)]).token_ids[0] for seed in range(600)]
    freq = np.bincount(draws, minlength=3)[:3] / len(draws)
    assert np.allclose(freq, [0.6, 0.3, 0.1], atol=0.07), freq


def test_logprobs_are_log_softmax_of_the_unfiltered_logits() -> None:
    logits = _logits(3, seed=2)
    rows = [RowSampling(0.0, 1.0, 0, 0, 0), RowSampling(0.7, 0.8, 5, 1, 2), RowSampling(1.0, 1.0, 0, 2, 3)]
    out = sample_rows(logits, rows, want_logprobs=True)
    reference = np.array(logits) - np.array(mx.logsumexp(logits, axis=-1, keepdims=True))
    assert out.logprobs == pytest.approx([reference[i, t] for i, t in enumerate(out.token_ids)], abs=1e-5)


def test_stream_sampler_numbers_its_calls_as_steps() -> None:
    params = SamplingParams(temperature=0.9, top_k=20, seed=4)
    sampler = StreamSampler(params, 4)
    logits = _logits(3, seed=3)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    drawn = [sampler(logprobs[i : i + 1]).item() for i in range(3)]
    expected = [
        sample_tokens(logprobs[i : i + 1], [RowSampling(0.9, 1.0, 20, 4, i)]).item() for i in range(3)
    ]
    assert drawn == expected and sampler.step == 3
