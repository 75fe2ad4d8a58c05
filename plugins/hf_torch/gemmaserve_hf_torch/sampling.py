"""Token sampling over a [rows, vocab] logits tensor.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p (nucleus), and
draw with a per-row ``torch.Generator`` seeded from a hash of ``(seed, step)`` only, so a row's token
never depends on the other rows of the batch. Log-probabilities, when asked for, are those of the
chosen token under the model's raw distribution (``log_softmax`` of the unscaled logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gemmaserve.backend import SampledTokens
from gemmaserve.sampling_params import RowSampling

__all__ = ["sample_tokens", "generator_seed"]

_MASK64 = (1 << 64) - 1


def generator_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for ``(seed, step)`` (splitmix64 finaliser over both)."""
    value = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & ((1 << 63) - 1)


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
    """Pick one token per row of ``logits`` (shape [len(rows), vocab], any float dtype; not mutated)."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sample: logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    scores = logits.float()
    chosen = scores.argmax(dim=-1)
    for index, row in enumerate(rows):
        if not row.is_greedy:
            chosen[index] = _sample_row(scores[index], row)
    token_ids = chosen.tolist()
    if not want_logprobs:
        return SampledTokens(token_ids)
    logprobs = torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None])[:, 0]
    return SampledTokens(token_ids, [float(x) for x in logprobs.tolist()])


def _sample_row(scores: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """One draw from ``scores`` ([vocab] fp32) under ``row``'s temperature / top-k / top-p."""
    scaled = scores / row.temperature
    vocab = scaled.shape[0]
    if 0 < row.top_k < vocab:
        kth = torch.topk(scaled, row.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if row.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= row.top_p
        drop[0] = False  # the most likely token always survives (rounding can make its mass_before > 0)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator(device=scores.device)
    generator.manual_seed(generator_seed(row.seed, row.step))
    return torch.multinomial(probs, 1, generator=generator)[0]
