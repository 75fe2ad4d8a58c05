"""Token sampling on mlx arrays: greedy, temperature, top-k, top-p, seeded per row.

A sampled row's randomness is Gumbel noise drawn from a key derived from ``(seed, step)`` only, and
every other operation is row-wise, so a row's token never depends on the other rows of the batch.
Filters follow the usual order: temperature, then top-k (ties at the k-th value kept), then top-p
over what top-k left (the smallest prefix of the sorted tokens whose mass reaches ``top_p``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from gemmaserve.backend import SampledTokens
from gemmaserve.sampling_params import RowSampling, SamplingParams

__all__ = ["row_key", "sample_tokens", "sample_rows", "StreamSampler"]

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, step: int) -> mx.array:
    """The PRNG key of token ``step`` of a row seeded with ``seed`` (a pure function of both)."""
    return mx.random.key(_splitmix64((_splitmix64(seed) + step) & _MASK64))


def sample_tokens(logits: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    """One token per row of ``logits`` [R, vocab] as an int32 array [R]; no host synchronisation."""
    assert logits.ndim == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    sampled_idx = [i for i, row in enumerate(rows) if not row.is_greedy]
    if not sampled_idx:
        return greedy
    picked = _sample_filtered(logits[mx.array(sampled_idx)], [rows[i] for i in sampled_idx])
    if len(sampled_idx) == len(rows):
        return picked
    greedy[mx.array(sampled_idx)] = picked
    return greedy


def _sample_filtered(logits: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    vocab = logits.shape[-1]
    temps = mx.array([row.temperature for row in rows], dtype=mx.float32)[:, None]
    scaled = logits.astype(mx.float32) / temps
    ordered = -mx.sort(-scaled, axis=-1)
    kth = mx.array([(row.top_k if 0 < row.top_k < vocab else vocab) - 1 for row in rows])[:, None]
    top_k_floor = mx.take_along_axis(ordered, kth, axis=-1)
    in_top_k = ordered >= top_k_floor
    probs = mx.softmax(mx.where(in_top_k, ordered, -mx.inf), axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    top_p = mx.array([row.top_p for row in rows], dtype=mx.float32)[:, None]
    keep = in_top_k & ((mass_before < top_p) | (top_p >= 1.0))
    num_kept = mx.maximum(keep.astype(mx.int32).sum(axis=-1, keepdims=True), 1)
    floor = mx.maximum(top_k_floor, mx.take_along_axis(ordered, num_kept - 1, axis=-1))
    filtered = mx.where(scaled >= floor, scaled, -mx.inf)
    noise = mx.stack([mx.random.gumbel((vocab,), key=row_key(row.seed, row.step)) for row in rows])
    return mx.argmax(filtered + noise, axis=-1).astype(mx.int32)


def sample_rows(logits: mx.array, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
    """Sample and bring the tokens (and the chosen tokens' log-probabilities under the unfiltered
    model distribution, when asked) to the host."""
    tokens = sample_tokens(logits, rows)
    if not want_logprobs:
        return SampledTokens(cast("list[int]", tokens.tolist()))
    logits32 = logits.astype(mx.float32)
    chosen = mx.take_along_axis(logits32, tokens[:, None], axis=-1)[:, 0]
    logprobs = chosen - mx.logsumexp(logits32, axis=-1)
    mx.eval(tokens, logprobs)
    return SampledTokens(cast("list[int]", tokens.tolist()), cast("list[float]", logprobs.tolist()))


class StreamSampler:
    """An mlx_lm ``sampler`` (log-probs [1, vocab] -> token [1]) that numbers its calls as steps, so a
    seeded stream draws the same tokens as the batched backend would."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self._params = params
        self._seed = seed
        self.step = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        row = RowSampling(self._params.temperature, self._params.top_p, self._params.top_k, self._seed, self.step)
        self.step += 1
        return sample_tokens(logprobs.reshape(1, -1), [row])

    def check_integrity(self) -> None:
        if self.step < 0:
            raise RuntimeError(f"StreamSampler: negative step {self.step}")
