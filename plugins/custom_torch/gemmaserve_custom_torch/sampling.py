"""Token sampling in torch with the semantics of ``gemmaserve.engine.sampling_cpu`` (the executable spec).

- ``temperature == 0``: argmax (lowest index wins a tie).
- otherwise: logits / temperature, keep the ``top_k`` largest (0 = all), then the smallest most-likely prefix
  whose probability reaches ``top_p`` (ties: lower index first), renormalise, and pick with the uniform draw
  ``random.Random(sampling_seed(seed, step)).random()``. So a row's token is a pure function of its logits
  and (seed, step), whatever else is in the batch, and matches the pure-Python reference up to float rounding.
- logprob: the chosen token's ``log_softmax(logits)`` under the raw (unscaled, unfiltered) distribution.

Vectorised over rows; one host sync per call. All-greedy calls without logprobs skip the float64 copy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from gemmaserve.backend import SampledTokens
from gemmaserve.engine.sampling_cpu import sampling_seed
from gemmaserve.sampling_params import RowSampling

__all__ = ["sample_tokens"]


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], *, want_logprobs: bool = False) -> SampledTokens:
    """One token per row of ``logits`` [rows, vocab] (any float dtype, any device). Does not mutate logits."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab] for {len(rows)} rows, got {tuple(logits.shape)}")
    if not want_logprobs and all(row.is_greedy for row in rows):
        # argmax in the logits' own dtype: widening is exact and monotone, so the pick (ties: lowest index) is
        # the same as in float64, without the [rows, vocab] float64 copy
        return SampledTokens(logits.argmax(dim=-1).tolist())
    work_dtype = torch.float32 if logits.device.type == "mps" else torch.float64
    values = logits.to(work_dtype)
    tokens = values.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.is_greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = _sample_filtered(values[index], [rows[i] for i in sampled])
    token_list = tokens.tolist()
    if not want_logprobs:
        return SampledTokens(token_list)
    logprobs = torch.log_softmax(values, dim=-1).gather(1, tokens[:, None])[:, 0]
    return SampledTokens(token_list, [float(x) for x in logprobs.tolist()])


def _sample_filtered(values: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Temperature / top-k / top-p sampling of every row of ``values`` [n, vocab]; returns token ids [n]."""
    n, vocab = values.shape
    device, dtype = values.device, values.dtype
    temps = torch.tensor([row.temperature for row in rows], dtype=dtype, device=device)
    scaled, order = torch.sort(values / temps[:, None], dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)
    top_k = torch.tensor([row.top_k if row.top_k > 0 else vocab for row in rows], device=device)
    keep = ranks[None, :] < top_k[:, None]
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    top_p = torch.tensor([row.top_p for row in rows], dtype=dtype, device=device)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each rank
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep[:, 0] = True  # the most likely token always survives (a tiny top_p or rounding must not empty a row)
    probs = probs.masked_fill(~keep, 0.0)
    cumulative = torch.cumsum(probs / probs.sum(dim=-1, keepdim=True), dim=-1)
    uniform = [random.Random(sampling_seed(r.seed, r.step)).random() for r in rows]
    draws = torch.tensor(uniform, dtype=dtype, device=device)
    picked = torch.searchsorted(cumulative, draws[:, None], right=True)[:, 0]
    picked = torch.minimum(picked, keep.sum(dim=-1) - 1)  # rounding: never past the last kept token
    return order.gather(1, picked[:, None])[:, 0]
