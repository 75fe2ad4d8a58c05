"""Plain-torch ragged paged attention: the oracle of the Triton kernel and the portable path's attention.

Contract (shared with ``ragged_attention.ragged_paged_attention``). Queries of ``S`` sequences are packed in
one tensor ``q [T, num_q_heads, D]``: sequence ``s`` owns rows ``query_start[s] .. query_start[s+1]`` (``n_s``
rows) and its KV holds ``seq_lens[s]`` tokens (``ctx_s``) *including* its ``n_s`` new ones, which are already
written into the pools. Query row ``i`` of ``s`` is at position ``ctx_s - n_s + i`` and sees keys at positions
``k`` with ``k <= p`` (causal) and, with a window ``W > 0``, ``k > p - W``. Key ``k`` of ``s`` lives at slot
``k % block_size`` of block ``block_tables[s, k // block_size]`` (``-1`` = not held; never read for a visible
key). GQA: q head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``. Returns ``[T, num_q_heads, D]``
in q's dtype. Decode rows are ``n_s = 1``.

The reference attends each sequence with the model package's ``eager_attention`` over the keys from the first
one its first query sees: the op sequence of transformers' eager path, so a cold prompt's logits equal it bit
for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..models.attention_context import build_attention_mask, eager_attention

__all__ = ["query_tiles", "ragged_paged_attention_reference", "sequence_key_slots"]


def query_tiles(query_lens: Sequence[int], block_m: int) -> tuple[list[int], list[int]]:
    """Host tile map of a batch for the Triton kernel: (sequence, first query) of each ``block_m``-query tile."""
    seqs: list[int] = []
    firsts: list[int] = []
    for s, n in enumerate(query_lens):
        for q0 in range(0, n, block_m):
            seqs.append(s)
            firsts.append(q0)
    return seqs, firsts


def sequence_key_slots(table: Sequence[int], first: int, end: int, block_size: int) -> Tensor:
    """Flat pool slots (int64, CPU) of positions ``[first, end)`` through one block table."""
    positions = torch.arange(first, end)
    blocks = torch.tensor(list(table), dtype=torch.int64)[positions // block_size] if end > first else positions
    if bool((blocks < 0).any()):
        raise ValueError(f"positions [{first}, {end}) include blocks that are not held: {list(table)}")
    return blocks * block_size + positions % block_size


def ragged_paged_attention_reference(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, query_start: Tensor, seq_lens: Tensor, *,
    scale: float, window: int = 0,
) -> Tensor:
    """See the module docstring. Reads the metadata on the host (one sync); any device."""
    starts = query_start.tolist()
    lengths = seq_lens.tolist()
    tables = block_tables.tolist()
    block_size = k_pool.shape[1]
    flat_k = k_pool.view(-1, *k_pool.shape[2:])
    flat_v = v_pool.view(-1, *v_pool.shape[2:])
    out = torch.zeros_like(q)  # rows no sequence covers (padding tokens) stay zero
    for s, ctx in enumerate(lengths):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        first_q = ctx - (hi - lo)
        first_k = max(0, first_q - window + 1) if window else 0
        slots = sequence_key_slots(tables[s], first_k, ctx, block_size).to(q.device)
        keys = flat_k[slots].transpose(0, 1)[None].contiguous()
        values = flat_v[slots].transpose(0, 1)[None].contiguous()
        q_pos = torch.arange(first_q, ctx, device=q.device)
        k_pos = torch.arange(first_k, ctx, device=q.device)
        mask = build_attention_mask(q_pos, k_pos, window or None)
        attended = eager_attention(q[lo:hi].transpose(0, 1)[None], keys, values, mask, scale)
        out[lo:hi] = attended[0].transpose(0, 1)
    return out
