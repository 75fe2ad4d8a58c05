"""Token sampling on mlx arrays, following the one sampling definition (``gemmaserve.engine.sampling_cpu``):

the logits get ``logit_bias`` added and ``banned`` tokens (and those outside ``allowed``) set to -inf first; greedy is then the argmax (lowest
index on a tie); a sampled row scales by ``1 / temperature``, keeps the ``top_k`` largest, then the smallest
most-likely prefix whose probability reaches ``top_p``, then those at least ``min_p`` times as likely as the
most likely one, and picks the kept token with the largest ``scaled + g`` (ties: lowest id), ``g`` the
definition's per-token Gumbel noise of (``sampling_seed(seed, step)``, token id) (:func:`gumbel_noise`: the
same SplitMix64 integers as ``sampling_cpu.noise_bits``, with numpy uint64 arithmetic, which wraps, and the
logs in float64 on the host). The score ``scaled + g`` is then summed in float32 on the mlx device (the
definition's is float64), so a pick can part from the definition's only when the two best scores are within
float32 rounding (~1e-6) of each other. So a seed gives the same tokens as on the torch backends (up to that
rounding) and a row's token never depends on the other rows of the batch. With no top_k / top_p / min_p on any
row there is no sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import numpy as np

from gemmaserve.backend import SampledTokens
from gemmaserve.engine.sampling_cpu import penalty_offset, sampling_seed
from gemmaserve.sampling_params import RowSampling, SamplingParams

__all__ = ["sample_tokens", "sample_rows", "StreamSampler"]


def sample_tokens(logits: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    """One token per row of ``logits`` [R, vocab] as an int32 array [R]; no host synchronisation."""
    assert logits.ndim == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    if any(row.adjusts_logits for row in rows):
        logits = adjust_logits(logits, rows)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    sampled_idx = [i for i, row in enumerate(rows) if not row.is_greedy]
    if not sampled_idx:
        return greedy
    picked = _sample_filtered(logits[mx.array(sampled_idx)], [rows[i] for i in sampled_idx])
    if len(sampled_idx) == len(rows):
        return picked
    greedy[mx.array(sampled_idx)] = picked
    return greedy


def adjust_logits(logits: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    """``logits`` (as float32) plus each row's ``logit_bias``, its ``banned`` tokens at -inf (ids beyond the
    vocabulary ignored); a new array."""
    vocab = logits.shape[-1]
    out = logits.astype(mx.float32)
    bias_at = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.logit_bias if token < vocab]
    if bias_at:
        out = out.at[mx.array([i for i, _, _ in bias_at]), mx.array([t for _, t, _ in bias_at])].add(
            mx.array([b for _, _, b in bias_at], dtype=mx.float32))
    penalized_at = [(i, token, count) for i, row in enumerate(rows) if row.has_penalties
                    for token, count in row.penalized_tokens() if token < vocab]
    if penalized_at:
        rows_at, tokens_at = mx.array([i for i, _, _ in penalized_at]), mx.array([t for _, t, _ in penalized_at])
        rp = mx.array([rows[i].repetition_penalty for i, _, _ in penalized_at], dtype=mx.float32)
        offset = mx.array([penalty_offset(c, rows[i]) for i, _, c in penalized_at], dtype=mx.float32)
        current = out[rows_at, tokens_at]
        out[rows_at, tokens_at] = mx.where(current > 0, current / rp, current * rp) - offset
    banned_at = [(i, token) for i, row in enumerate(rows) for token in row.banned if token < vocab]
    if banned_at:
        out = out.at[mx.array([i for i, _ in banned_at]), mx.array([t for _, t in banned_at])].add(-mx.inf)
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    if masked:
        keep = mx.ones(out.shape, dtype=mx.bool_)
        keep[mx.array(masked)] = allowed_mask(rows, masked, vocab)
        out = mx.where(keep, out, -mx.inf)
    return out


def allowed_mask(rows: Sequence[RowSampling], masked: Sequence[int], vocab: int) -> mx.array:
    """bool [len(masked), vocab]: the ``allowed`` bitmasks of ``rows[masked]`` unpacked (tokens past a mask's
    end are not allowed)."""
    width = -(-vocab // 8)
    packed = b"".join(bytes(rows[i].allowed or b"")[:width].ljust(width, b"\0") for i in masked)
    array = mx.array(np.frombuffer(packed, dtype=np.uint8).reshape(len(masked), width))
    bits = mx.arange(8, dtype=mx.uint8)
    return ((array[:, :, None] >> bits) & 1).astype(mx.bool_).reshape(len(masked), width * 8)[:, :vocab]


def _sample_filtered(logits: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    """Temperature / top-k / top-p / min-p sampling of every row of ``logits`` [n, vocab] (the definition
    above)."""
    vocab = logits.shape[-1]
    temps = mx.array([row.temperature for row in rows], dtype=mx.float32)[:, None]
    scaled = logits.astype(mx.float32) / temps
    noise = mx.array(gumbel_noise([sampling_seed(row.seed, row.step) for row in rows], vocab).astype(np.float32))
    score = scaled + noise  # -inf (banned) stays -inf
    if all(row.top_k <= 0 or row.top_k >= vocab for row in rows) and all(
            row.top_p >= 1.0 and row.min_p <= 0.0 for row in rows):
        return mx.argmax(score, axis=-1).astype(mx.int32)  # every finite token is kept: no sort
    order = mx.argsort(-scaled, axis=-1)
    ordered = mx.take_along_axis(scaled, order, axis=-1)
    ranks = mx.arange(vocab)[None, :]
    top_k = mx.array([min(row.top_k, vocab) if row.top_k > 0 else vocab for row in rows])[:, None]
    keep = ranks < top_k
    probs = mx.softmax(mx.where(keep, ordered, -mx.inf), axis=-1)
    top_p = mx.array([row.top_p for row in rows], dtype=mx.float32)[:, None]
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly before each rank
    keep = keep & ((before < top_p) | (top_p >= 1.0))
    if any(row.min_p > 0.0 for row in rows):  # a ratio to the most likely token: scaled >= max + log(min_p)
        log_min_p = mx.array([math.log(row.min_p) if row.min_p > 0.0 else -math.inf for row in rows],
                             dtype=mx.float32)[:, None]
        keep = keep & (ordered >= ordered[:, :1] + log_min_p)
    keep = keep & (probs > 0)  # banned (-inf) tokens can never be drawn
    keep = keep | (ranks == 0)  # the most likely token always survives
    kept_score = mx.where(keep, mx.take_along_axis(score, order, axis=-1), -mx.inf)
    # the largest kept score; among equal ones the lowest id (mx.argmax over sorted ranks would prefer the rank)
    best = mx.max(kept_score, axis=-1, keepdims=True)
    return mx.min(mx.where(kept_score == best, order, vocab), axis=-1).astype(mx.int32)


_U64 = np.uint64


def noise_bits(keys: Sequence[int], vocab: int) -> np.ndarray:
    """uint64 [len(keys), vocab]: ``sampling_cpu.noise_bits(key, i)`` for every key and token id ``i``."""
    with np.errstate(over="ignore"):
        z = np.arange(1, vocab + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15) + np.array(keys, dtype=_U64)[:, None]
        z ^= z >> _U64(30)
        z *= _U64(0xBF58476D1CE4E5B9)
        z ^= z >> _U64(27)
        z *= _U64(0x94D049BB133111EB)
        z ^= z >> _U64(31)
    return z >> _U64(11)


def gumbel_noise(keys: Sequence[int], vocab: int) -> np.ndarray:
    """float64 [len(keys), vocab]: the definition's Gumbel noise ``-log(-log((bits + 0.5) * 2**-53))``."""
    u = (noise_bits(keys, vocab).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(-np.log(u))


def sample_rows(logits: mx.array, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
    """Sample and bring the tokens (and, when asked, the chosen tokens' log-probabilities under the adjusted,
    unfiltered distribution, with each row's ``top_logprobs`` alternatives) to the host."""
    tokens = sample_tokens(logits, rows)
    if any(row.adjusts_logits for row in rows):
        logits = adjust_logits(logits, rows)  # logprobs of the distribution actually sampled from
    if not want_logprobs:
        return SampledTokens(cast("list[int]", tokens.tolist()))
    logits32 = logits.astype(mx.float32)
    log_probs = logits32 - mx.logsumexp(logits32, axis=-1, keepdims=True)
    logprobs = mx.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    mx.eval(tokens, logprobs, log_probs)
    top = _top_logprobs(logits32, log_probs, rows) if any(row.top_logprobs > 0 for row in rows) else None
    return SampledTokens(cast("list[int]", tokens.tolist()), cast("list[float]", logprobs.tolist()), top)


def _top_logprobs(logits: mx.array, log_probs: mx.array, rows: Sequence[RowSampling]) -> list[list[tuple[int, float]]]:
    """Per row its ``top_logprobs`` most likely ``(token, logprob)`` pairs under the adjusted distribution, as
    ``sampling_cpu.top_logprobs`` defines them: ranked by adjusted logit, ties lower id first, -inf left out.
    On the host, for the rows that ask."""
    out: list[list[tuple[int, float]]] = []
    for index, row in enumerate(rows):
        if row.top_logprobs <= 0:
            out.append([])
            continue
        ranked, values = np.asarray(logits[index]), np.asarray(log_probs[index])
        best = np.argsort(-ranked, kind="stable")[: row.top_logprobs]  # stable: equal logits keep id order
        out.append([(int(t), float(values[t])) for t in best if ranked[t] != -math.inf])
    return out


class StreamSampler:
    """An mlx_lm ``sampler`` (log-probs [1, vocab] -> token [1]) that numbers its calls as steps, so a
    seeded stream draws the same tokens as the batched backend would."""

    def __init__(self, params: SamplingParams, seed: int, eos_token_ids: Sequence[int] = ()) -> None:
        self._params = params
        self._seed = seed
        self._eos_token_ids = tuple(eos_token_ids)  # banned before min_tokens
        self.step = 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        row = RowSampling.for_params(self._params, self._seed, self.step, self._eos_token_ids)
        self.step += 1
        return sample_tokens(logprobs.reshape(1, -1), [row])

    def check_integrity(self) -> None:
        if self.step < 0:
            raise RuntimeError(f"StreamSampler: negative step {self.step}")
