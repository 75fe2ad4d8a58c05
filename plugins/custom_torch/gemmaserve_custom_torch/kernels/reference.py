"""Plain-torch paged decode attention: the oracle for the Triton kernel and the portable path.

Paged KV layout (shared with the paged cache):

- ``k_pool`` / ``v_pool``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, model dtype.
- ``block_tables``: int32 ``[B, max_blocks_per_seq]``; logical block ``j`` of row ``b`` lives in
  physical block ``block_tables[b, j]``. ``-1`` marks a freed (out-of-window) or unused block and is
  never dereferenced.
- ``seq_lens``: int32 ``[B]``: tokens in the row's KV, the current decode token included. The token
  at logical position ``p`` is in block ``p // block_size``, slot ``p % block_size``.
- ``window``: 0 for full attention; otherwise only keys at positions ``>= seq_len - window`` are
  visible (the query token itself included).
- GQA: q head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch

__all__ = ["paged_decode_attention_reference", "validate_paged_decode_inputs"]


def validate_paged_decode_inputs(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    window: int,
    out: torch.Tensor | None,
    num_splits: int | None,
) -> None:
    """Cheap shape/dtype/device checks (no device sync). Raises ``ValueError`` on bad input."""
    if query.dim() != 3:
        raise ValueError(f"query must be [B, num_q_heads, head_dim], got shape {tuple(query.shape)}")
    if k_pool.dim() != 4:
        raise ValueError(
            f"k_pool must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_pool.shape)}"
        )
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}")
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = k_pool.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {kv_head_dim}")
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"degenerate pool shape {tuple(k_pool.shape)}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_pool.dtype != query.dtype or v_pool.dtype != query.dtype:
        raise ValueError(
            f"dtype mismatch: query {query.dtype}, k_pool {k_pool.dtype}, v_pool {v_pool.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [B={batch}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got shape {tuple(seq_lens.shape)}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    devices = {t.device for t in (query, k_pool, v_pool, block_tables, seq_lens)}
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"out must match query ({tuple(query.shape)}, {query.dtype}), "
                f"got ({tuple(out.shape)}, {out.dtype})"
            )
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = full attention), got {window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, in plain torch (fp32 math).

    Gathers each row's visible keys/values through the block table (only in-window positions, so
    sentinel ``-1`` blocks are never touched) and runs softmax attention in fp32.

    Args: see the module docstring for the layout. ``query`` is ``[B, num_q_heads, head_dim]``.
    ``num_splits`` is accepted for signature parity with the kernel and ignored.
    Returns ``[B, num_q_heads, head_dim]`` in ``query.dtype`` (written into ``out`` if given).
    A row with ``seq_len <= 0`` yields zeros. Syncs with the device (reads ``seq_lens``); not for
    CUDA-graph capture.
    """
    validate_paged_decode_inputs(
        query, k_pool, v_pool, block_tables, seq_lens, window=window, out=out, num_splits=num_splits
    )
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    result = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        if seq_len > max_tokens:
            raise ValueError(
                f"row {b}: seq_len {seq_len} exceeds the block table capacity {max_tokens}"
            )
        start = max(seq_len - window, 0) if window > 0 else 0
        pos = torch.arange(start, seq_len, device=query.device)
        blocks = block_tables[b, pos // block_size].long()
        if bool((blocks < 0).any()):
            raise ValueError(f"row {b}: a visible position maps to a sentinel (-1) block")
        slots = pos % block_size
        k = k_pool[blocks, slots].float()  # [n, kv_heads, head_dim]
        v = v_pool[blocks, slots].float()
        q = query[b].float().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,nhd->hgn", q, k) * scale
        probs = torch.softmax(scores, dim=-1)
        result[b] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(num_q_heads, head_dim)
    if out is not None:
        out.copy_(result)
        return out
    return result.to(query.dtype)
