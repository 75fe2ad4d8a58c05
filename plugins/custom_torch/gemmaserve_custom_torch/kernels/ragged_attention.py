"""Triton ragged paged attention: the queries of many sequences (prefill chunks and decode rows) in one launch.

Contract: :mod:`.ragged_reference` (its module docstring). Design:

- One program per ``(query tile, kv head)``. A query tile is up to ``BLOCK_M`` consecutive queries of ONE
  sequence; the tile map (``tile_seq``, ``tile_q0``: sequence and first query of each tile) is built on the
  host with the batch (:func:`query_tiles`), so the kernel needs no search. Programs past the map's valid
  length (read from the device) exit at once: the grid may be sized for a padded batch (graph capture).
- GQA packing: a program loads its tile's queries for all ``G`` q heads of its kv head as one
  ``[BLOCK_M * G_PAD, D]`` operand, so every K/V tile is read once for the whole group (row ``r`` is query
  ``r // G_PAD``, head ``r % G_PAD``).
- Keys are walked in tiles of ``TILE_N`` positions from the page holding the first key the tile's first
  query sees (window) up to its last query's position, gathered through the block table (no gather copy);
  loads are masked to that range, so freed (``-1``) pages are never read. Scores are masked per row:
  causal, and ``k > p - W`` on sliding layers.
- Online softmax in fp32 (base 2, ``scale * log2(e)`` folded in), ``tl.dot`` with fp32 accumulation; the
  interpreter upcasts bf16 first (its bf16 arithmetic is broken).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _tile_kv, _tile_pages
from .ragged_reference import query_tiles

__all__ = ["query_tiles", "ragged_block_m", "ragged_paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["window"])
def _ragged_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, num_tiles_ptr, out_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bts, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_lo = tl.load(qstart_ptr + seq)
    n_q = tl.load(qstart_ptr + seq + 1) - q_lo
    ctx = tl.load(seq_lens_ptr + seq)
    first_pos = ctx - n_q  # position of the sequence's first query

    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    offs_r = tl.arange(0, ROWS)
    qi = q0 + offs_r // GROUP_PAD  # query index inside the sequence
    g = offs_r % GROUP_PAD
    row_ok = (qi < n_q) & (g < GROUP)
    pos = first_pos + qi  # query positions [ROWS]
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    q_rows = (q_lo + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    last_q = tl.minimum(q0 + BLOCK_M, n_q) - 1
    hi = first_pos + last_q + 1  # keys after the tile's last query are never visible
    lo = first_pos + q0
    lo = tl.where(window > 0, tl.maximum(lo - window + 1, 0), 0)
    base = (lo // BLOCK_SIZE) * BLOCK_SIZE
    n_tiles = tl.cdiv(hi - base, TILE_N)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for t in range(0, n_tiles):
        kpos = base + t * TILE_N + offs_n
        in_range, page = _tile_pages(bt_row, base, t, lo, hi, offs_n, TILE_N, BLOCK_SIZE)  # the decode kernel's
        k, v = _tile_kv(k_head, v_head, base, t, page, in_range, offs_n, offs_d, d_mask,
                        stride_kb, stride_ks, stride_vb, stride_vs, TILE_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, UPCAST)
        s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale).to(tl.float32)
        visible = in_range[None, :] & (kpos[None, :] <= pos[:, None])
        visible = visible & ((window <= 0) | (kpos[None, :] > pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_pivot)
        p = tl.exp2(s - m_pivot[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


_INTERPRET = type(_ragged_kernel).__name__ == "InterpretedFunction"


def _group_pad(num_q_heads: int, num_kv_heads: int) -> int:
    return triton.next_power_of_2(num_q_heads // num_kv_heads)


def ragged_block_m(head_dim: int, group: int) -> int:
    """Queries per tile: about 64 rows of ``[rows, D]`` accumulator at D <= 256, 32 at D = 512 (registers),
    at least 16 rows in all (``tl.dot`` needs 16)."""
    pad = triton.next_power_of_2(group)
    rows = 64 if head_dim <= 256 else 32
    return max(1, rows // pad, -(-16 // pad))


def ragged_paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, window: int = 0,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged paged attention (Triton); arguments as ``ragged_paged_attention_reference``. ``tiles``:
    ``(tile_seq int32 [N], tile_q0 int32 [N], num_valid int32 [1])`` from :func:`query_tiles` with
    :func:`ragged_block_m` of this layer's shapes (built from ``query_start`` on the host, one sync, when
    None); ``N`` may exceed ``num_valid`` (padding programs exit at once). Rows of ``q`` that no tile covers
    (padding tokens) come out as zeros. No host sync when ``tiles`` is given: graph-capturable."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"q must be [T, H, D] and pools [blocks, block_size, kv_heads, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, pool_dim = k_pool.shape
    if pool_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"head dims {head_dim}/{pool_dim} or heads {num_q_heads}/{num_kv_heads} do not match")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("q and the pools need a contiguous last dim")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
    out = torch.zeros_like(q) if out is None else out
    group = num_q_heads // num_kv_heads
    block_m = ragged_block_m(head_dim, group)
    if tiles is None:
        starts = query_start.tolist()
        seqs, firsts = query_tiles([b - a for a, b in zip(starts, starts[1:])], block_m)
        tiles = (torch.tensor(seqs, dtype=torch.int32, device=q.device),
                 torch.tensor(firsts, dtype=torch.int32, device=q.device),
                 torch.tensor([len(seqs)], dtype=torch.int32, device=q.device))
    tile_seq, tile_q0, num_valid = tiles
    if num_tokens == 0 or tile_seq.numel() == 0:
        return out
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = max(32 if dim_pad <= 256 else 16, triton.next_power_of_2(block_size))
    upcast = _INTERPRET and q.dtype == torch.bfloat16
    _ragged_kernel[(tile_seq.numel(), num_kv_heads)](
        q, k_pool, v_pool, block_tables, query_start, seq_lens, tile_seq, tile_q0, num_valid, out,
        float(scale) * _LOG2E, int(window),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=_group_pad(num_q_heads, num_kv_heads), BLOCK_M=block_m, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n, UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if dim_pad <= 256 else 8, num_stages=2,
    )
    return out
