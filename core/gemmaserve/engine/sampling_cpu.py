"""Pure-Python token sampling over plain lists of floats (no numpy, no torch).

Used by the reference backend and as the executable definition of the sampling semantics other
backends should match:

- first the logits are adjusted: ``logit_bias`` values are added, the penalties applied to the tokens they
  touch (:func:`penalized`: repetition for tokens of the prompt or output, then frequency and presence for the
  output's), then ``banned`` tokens (EOS and stop ids before ``min_tokens``) and tokens outside the ``allowed``
  mask (structured output) become ``-inf``.
- ``temperature == 0``: argmax of the adjusted logits (lowest index wins a tie); no randomness.
- otherwise: scale by ``1 / temperature`` (``scaled_i = adjusted_i / temperature``), keep the ``top_k`` largest
  (0 = all), then the smallest set of most likely tokens whose probability reaches ``top_p`` (ties broken by lower
  index), then (``min_p``) only those at least ``min_p`` times as likely as the most likely one (transformers'
  order: a ratio test, ``scaled >= max + log(min_p)``); tokens at ``-inf`` are never kept (unless every token is,
  then the first in that order, token 0, is). The most likely token is always kept.
- the draw is the Gumbel-max trick (:func:`gumbel_noise`): with ``key = sampling_seed(seed, step)`` every token id
  ``i`` gets its own noise, all arithmetic on 64-bit unsigned integers modulo ``2**64``::

      z   = key + (i + 1) * 0x9E3779B97F4A7C15        # SplitMix64's (i + 1)-th state from key
      z   = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
      z   = (z ^ (z >> 27)) * 0x94D049BB133111EB
      h_i = z ^ (z >> 31)                             # SplitMix64's finalizer: its (i + 1)-th output
      u_i = ((h_i >> 11) + 0.5) * 2**-53              # in (0, 1), exact in float64
      g_i = -log(-log(u_i))                           # a standard Gumbel variable (float64)

  and the token is the kept token with the largest ``scaled_i + g_i`` (float64); an exact tie (equal float64
  sums) goes to the lowest token id. By the Gumbel-max theorem this draws exactly from the renormalised softmax
  of the kept ``scaled`` values, but with no sort (when no filter is on) and no cumulative sum: each token's
  noise depends on (seed, step, id) only, so logits that differ by float rounding (a row batched with others
  against the same row alone) change the pick only when the two best perturbed scores are within that rounding
  of each other (about 1e-6 per token for 1e-6 relative noise; an inverse-CDF draw over the sorted order parts
  whenever two near-tied tokens swap places or a CDF boundary moves past the draw).
- the reported logprob is the chosen token's log-probability under the adjusted, unscaled, unfiltered
  distribution ``log_softmax(adjusted logits)`` (the raw model's when nothing is adjusted).

Everything here is a pure function of its arguments, so it is safe from any thread.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from gemmaserve.sampling_params import RowSampling, allowed_tokens

__all__ = ["SPLITMIX_GAMMA", "SPLITMIX_MIX", "sampling_seed", "gumbel_noise", "noise_bits", "log_softmax",
           "top_logprobs", "adjust_logits", "penalized", "penalty_offset", "sample_row", "sample_rows"]

_MASK64 = (1 << 64) - 1


def sampling_seed(seed: int, step: int) -> int:
    """The RNG seed for token ``step`` of a row seeded with ``seed`` (a 64-bit mix of both)."""
    value = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    value ^= value >> 31
    return (value * 0xD6E8FEB86659FD93) & _MASK64


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's state increment (the golden gamma); the torch and Triton noise import it from here."""
SPLITMIX_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 1))
"""SplitMix64's finalizer: ``z = (z ^ (z >> shift)) * multiplier`` per pair, modulo ``2**64`` (the last
multiplier is 1: a plain xor-shift)."""


def noise_bits(key: int, token: int) -> int:
    """``h_i >> 11`` for token id ``token`` under ``key`` (53 bits): SplitMix64's ``token + 1``-th output from
    state ``key``, its top 53 bits."""
    z = (key + (token + 1) * SPLITMIX_GAMMA) & _MASK64
    for shift, multiplier in SPLITMIX_MIX:
        z = ((z ^ (z >> shift)) * multiplier) & _MASK64
    return z >> 11


def gumbel_noise(key: int, token: int) -> float:
    """``g_i = -log(-log(u_i))``, ``u_i = (noise_bits + 0.5) * 2**-53``: token ``token``'s Gumbel noise under
    ``key = sampling_seed(seed, step)`` (in about [-3.62, 37.43])."""
    u = (noise_bits(key, token) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def log_softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - log_total for x in logits]


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for index in range(1, len(values)):
        if values[index] > values[best]:
            best = index
    return best


def adjust_logits(logits: Sequence[float], row: RowSampling) -> list[float]:
    """The logits after ``logit_bias`` (added), ``banned`` and tokens outside ``allowed`` (-inf); ids beyond the
    vocabulary are ignored."""
    out = list(logits)
    for token, bias in row.logit_bias:
        if token < len(out):
            out[token] += bias
    if row.has_penalties:
        for token, count in row.penalized_tokens():
            if token < len(out):
                out[token] = penalized(out[token], count, row)
    for token in row.banned:
        if token < len(out):
            out[token] = -math.inf
    if row.allowed is not None:
        for token, ok in enumerate(allowed_tokens(row.allowed, len(out))):
            if not ok:
                out[token] = -math.inf
    return out


def penalized(logit: float, count: int, row: RowSampling) -> float:
    """One logit after the penalties: repetition (the token was seen in the prompt or output), then frequency
    (``count`` in the output) and presence (``count > 0``)."""
    rp = row.repetition_penalty
    if rp != 1.0:
        logit = logit / rp if logit > 0 else logit * rp
    return logit - penalty_offset(count, row)


def penalty_offset(count: int, row: RowSampling) -> float:
    """What frequency and presence take off a logit for a token the output holds ``count`` times."""
    return row.frequency_penalty * count + (row.presence_penalty if count > 0 else 0.0)


def _filtered_probs(logits: Sequence[float], row: RowSampling) -> list[tuple[int, float]]:
    """(token, probability) pairs left after temperature, top-k, top-p and min-p, most likely first (the kept
    set; the probabilities are those of the renormalised distribution the draw samples from)."""
    scaled = [x / row.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    if row.top_k > 0:
        order = order[: row.top_k]
    order = [i for i in order if scaled[i] != -math.inf] or order[:1]  # banned tokens can never be drawn
    top = scaled[order[0]]
    weights = [math.exp(scaled[i] - top) for i in order]
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    if row.top_p < 1.0:
        cumulative = 0.0
        for keep, p in enumerate(probs, start=1):
            cumulative += p
            if cumulative >= row.top_p:
                order, probs = order[:keep], probs[:keep]
                break
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    if row.min_p > 0.0:
        floor = scaled[order[0]] + math.log(row.min_p)
        kept = [j for j, i in enumerate(order) if j == 0 or scaled[i] >= floor]
        order, probs = [order[j] for j in kept], [probs[j] for j in kept]
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    return list(zip(order, probs))


def sample_row(logits: Sequence[float], row: RowSampling, *, want_logprob: bool = False) -> tuple[int, float | None]:
    """Pick one token from one row of logits; returns (token, logprob or None)."""
    if row.adjusts_logits:
        logits = adjust_logits(logits, row)
    if row.is_greedy:
        token = _argmax(logits)
    else:
        token = _gumbel_pick(logits, row)
    logprob = log_softmax(logits)[token] if want_logprob else None
    return token, logprob


def _gumbel_pick(logits: Sequence[float], row: RowSampling) -> int:
    """The kept token with the largest ``logit / temperature + gumbel_noise`` (ties: lowest id)."""
    key = sampling_seed(row.seed, row.step)
    best, best_score = -1, -math.inf
    for token in sorted(token for token, _ in _filtered_probs(logits, row)):
        score = logits[token] / row.temperature + gumbel_noise(key, token)
        if best < 0 or score > best_score:
            best, best_score = token, score
    return best


def top_logprobs(logits: Sequence[float], row: RowSampling) -> list[tuple[int, float]]:
    """The ``row.top_logprobs`` most likely ``(token, logprob)`` pairs under the distribution the row samples
    from (the adjusted logits, as the reported logprob): ordered by adjusted logit, highest first (ties: lower
    id first); tokens that cannot be picked (-inf) are left out, so a masked row may return fewer."""
    if row.top_logprobs <= 0:
        return []
    values = adjust_logits(logits, row) if row.adjusts_logits else list(logits)
    log_probs = log_softmax(values)
    best = heapq.nsmallest(row.top_logprobs, range(len(values)), key=lambda i: (-values[i], i))
    return [(i, log_probs[i]) for i in best if values[i] != -math.inf]


def sample_rows(
    logits: Sequence[Sequence[float]], rows: Sequence[RowSampling], *, want_logprobs: bool = False
) -> tuple[list[int], list[float] | None]:
    """``sample_row`` over every row; each row's result depends only on its own logits and params."""
    if len(logits) != len(rows):
        raise ValueError(f"got {len(logits)} logits rows but {len(rows)} sampling rows")
    tokens: list[int] = []
    logprobs: list[float] = []
    for row_logits, row in zip(logits, rows):
        token, logprob = sample_row(row_logits, row, want_logprob=want_logprobs)
        tokens.append(token)
        if logprob is not None:
            logprobs.append(logprob)
    return tokens, (logprobs if want_logprobs else None)
