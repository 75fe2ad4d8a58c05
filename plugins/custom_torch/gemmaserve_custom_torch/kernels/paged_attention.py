"""Triton paged-attention decode kernel (one query token per row, paged KV cache).

Layout and semantics are those of :mod:`.reference` (its module docstring is the contract).

Design:

- One program per ``(row, kv head, split)``. It loads all ``G = num_q_heads // num_kv_heads`` q
  heads of its kv head group once, as a ``[G_PAD, D]`` tile (``G_PAD = max(8, pow2(G))``; both
  products are ``tl.dot`` on tensor cores, bf16/fp16 operands, fp32 accumulation), so each K/V
  element is read from HBM once per group.
- The program walks logical key positions in tiles of ``TILE_N`` keys (several pages per tile when
  ``block_size`` is small), gathering each key row through the block table: no gather copy, no
  padding. Loads are masked by visibility (``start <= pos < seq_len``), so sentinel ``-1`` blocks
  and stale slots are never dereferenced.
- The loop bounds come from ``seq_lens`` at run time; the tile walk starts at the page holding the
  first in-window key, so a sliding-window row only touches ~``window`` keys.
- Online softmax in fp32 (base-2 exponent, ``scale * log2(e)`` folded into the scores). Under the
  Triton interpreter bf16 operands are upcast to fp32 first (its bf16 arithmetic is broken).
- Triton's software pipeliner (``num_stages``) turns the K/V gathers into ``cp.async`` copies into
  shared memory issued ahead of the tile being computed.
- Split-KV (flash-decoding): with ``num_splits > 1`` the row's tiles are cut into ``num_splits``
  contiguous ranges; each program writes an unnormalised ``(m, l, acc)`` partial and a small
  combine kernel merges them. Empty ranges write ``m = -inf, l = 0, acc = 0`` and drop out.
- The grid and every launch argument derive from tensor shapes only (no ``.item()``, no sync), so
  the wrapper can be captured in a CUDA graph and replayed with new ``seq_lens``/``block_tables``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import await_previous, launch_options
from .reference import validate_paged_decode_inputs

__all__ = [
    "DecodeKernelConfig",
    "default_decode_config",
    "default_num_splits",
    "paged_decode_attention",
]

_LOG2E = 1.4426950408889634
# Each split covers at least this many key tiles of the longest possible row.
_MIN_TILES_PER_SPLIT = 1
_MAX_SPLITS = 64


@triton.jit
def _tile_pages(bt_row, base, t, start, seq_len, offs_n, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Visibility mask and physical page of each key of tile ``t``."""
    pos = base + t * TILE_N + offs_n
    valid = (pos >= start) & (pos < seq_len)
    page = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return valid, page


@triton.jit
def _tile_kv(k_head, v_head, base, t, page, valid, offs_n, offs_d, d_mask,
             stride_kb, stride_ks, stride_vb, stride_vs,
             TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
             DIM_PAD: tl.constexpr, UPCAST: tl.constexpr):
    """Masked gather of the ``[TILE_N, DIM_PAD]`` K and V tiles (invisible keys read as 0)."""
    slot = (base + t * TILE_N + offs_n) % BLOCK_SIZE
    if HEAD_DIM == DIM_PAD:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_head + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_head + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_tile(q, k, v, valid, acc, m_i, l_i, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step (base 2) of the ``[GROUP_PAD]`` q rows over a K/V tile."""
    # the cast keeps s fp32 when a caller (torch.compile's Inductor) passes qk_scale as an fp64 scalar;
    # fp64 scores would make the acc of the second dot fp64 and fail to compile
    s = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale).to(tl.float32)  # [GROUP_PAD, TILE_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A fully masked history keeps m = -inf; pin the pivot to 0 to avoid (-inf) - (-inf).
    m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_pivot)
    p = tl.exp2(s - m_pivot[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window", "max_blocks", "num_splits"])
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    window,
    max_blocks,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (sequence, KV head, split). SPLIT: unnormalised partials for ``_combine_splits_kernel``; else the
    normalised output."""
    await_previous(PDL)  # q and the pools' new K/V are the previous kernels' output
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    b64 = b.to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.maximum(tl.minimum(seq_len, max_blocks * BLOCK_SIZE), 0)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Tiles are aligned to the page holding `start`: pages before it may be freed (-1).
    base = (start // BLOCK_SIZE) * BLOCK_SIZE
    n_tiles = tl.cdiv(seq_len - base, TILE_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)

    bt_row = bt_ptr + b64 * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    for t in range(t_lo, t_hi):
        valid, page = _tile_pages(bt_row, base, t, start, seq_len, offs_n, TILE_N, BLOCK_SIZE)
        k, v = _tile_kv(k_head, v_head, base, t, page, valid, offs_n, offs_d, d_mask,
                        stride_kb, stride_ks, stride_vb, stride_vs,
                        TILE_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, UPCAST)
        acc, m_i, l_i = _attend_tile(q, k, v, valid, acc, m_i, l_i, qk_scale, DOT_PRECISION)

    if SPLIT:
        # Partials: acc [B, Hq, S, HEAD_DIM] fp32, (m, l) [B, Hq, S, 2] fp32, unnormalised.
        row = (b64 * (num_kv_heads * GROUP) + heads) * num_splits + split
        tl.store(
            part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
    else:
        # l == 0 only for an empty row (acc == 0 too): divide by 1 instead.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[b, h, d-chunk] = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m); all splits
    are loaded at once (one memory round trip). Empty splits have m = -inf, so w = 0."""
    await_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    row0 = (b.to(tl.int64) * num_q_heads + h) * num_splits
    offs_s = tl.arange(0, SPLIT_PAD)
    s_mask = offs_s < num_splits
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m = tl.load(part_ml_ptr + (row0 + offs_s) * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + (row0 + offs_s) * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


_INTERPRET = type(_paged_decode_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch parameters of the split kernel. ``tile_n``: keys per loop iteration (power of two,
    >= 16 and a multiple of the block size)."""

    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(head_dim: int, block_size: int) -> DecodeKernelConfig:
    """Tuned on an H200 (bf16, block 16, E2B shapes; see benchmarks/kernels/bench_paged_attention.py).

    - D <= 128: 64-key tiles, 4 warps, 5 stages.
    - D = 256: 32-key tiles, 4 warps, 5 stages (two K/V tile buffers in flight, ~75 KB smem).
    - D = 512: 32-key tiles, 4 warps, 3 stages (one buffer, ~70 KB smem; 5 stages would need
      ~140 KB and cap occupancy at one program per SM, which loses at large batch).
    """
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if dim_pad <= 128 else 32
    tile_n = max(tile_n, triton.next_power_of_2(block_size))
    num_stages = 3 if dim_pad >= 512 else 5
    return DecodeKernelConfig(tile_n=tile_n, num_warps=4, num_stages=num_stages)


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, device_index: int | None) -> int:
    if device_type == "cuda":
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 132  # CPU / interpreter: behave like an H200 so tests see the same split choices


def default_num_splits(
    batch: int,
    num_kv_heads: int,
    max_blocks_per_seq: int,
    block_size: int,
    window: int,
    tile_n: int,
    num_sms: int,
) -> int:
    """Split count from shapes only (graph-capturable).

    ``floor(2 * num_sms / (batch * num_kv_heads))``: about two programs per SM in total (each
    program keeps only one or two K/V tiles in flight, so the GPU needs several per SM to cover
    HBM latency), capped so that every split owns at least ``_MIN_TILES_PER_SPLIT`` tiles of the
    longest possible visible range (``window + block_size - 1`` keys for sliding layers, the table
    capacity for full ones) and at ``_MAX_SPLITS``. Measured optimum on an H200 at ctx 4096 (E2B,
    one kv head): full D=512 layers 64/32/8/2/1 splits at B=1/8/32/128/256, sliding window-512
    layers 16/16/4-8/1-2/1 (flat near the optimum); this rule gives 64/33/8/2/1 and 17/17/8/2/1.
    """
    programs = max(batch * num_kv_heads, 1)
    max_keys = max_blocks_per_seq * block_size
    if window > 0:
        max_keys = min(max_keys, window + block_size - 1)
    max_tiles = -(-max_keys // tile_n)
    want = 2 * num_sms // programs
    return max(1, min(want, max_tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS))


def paged_decode_attention(
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
    config: DecodeKernelConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Decode attention over a paged KV cache (Triton).

    Args:
        query: ``[B, num_q_heads, head_dim]``, fp32/fp16/bf16, last dim contiguous.
        k_pool, v_pool: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query dtype, last dim
            contiguous.
        block_tables: int32 ``[B, max_blocks_per_seq]``; ``-1`` = freed/unused page (never read).
        seq_lens: int32 ``[B]``, tokens in KV including the current one (values above the table
            capacity are clamped to it; ``0`` gives a zero output row).
        scale: softmax scale on ``q . k``.
        window: 0 = full attention, else keys at positions ``>= seq_len - window`` only.
        out: optional ``[B, num_q_heads, head_dim]`` output in query dtype.
        num_splits: split-KV factor, 1..256; ``None`` picks one from shapes
            (:func:`default_num_splits`).
        config: tile/warps/stages override (:func:`default_decode_config` if ``None``).
        pdl: launch as a programmatic dependent (``kernels.pdl``; Hopper).

    Returns ``out`` (allocated if ``None``). No host sync; CUDA-graph capturable.
    """
    validate_paged_decode_inputs(
        query, k_pool, v_pool, block_tables, seq_lens, window=window, out=out, num_splits=num_splits
    )
    for name, t in (("query", query), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")

    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    if batch == 0:
        return out
    if block_tables.stride(1) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("block_tables rows and seq_lens must be contiguous")

    cfg = config or default_decode_config(head_dim, block_size)
    if cfg.tile_n < 16 or cfg.tile_n & (cfg.tile_n - 1) or cfg.tile_n % block_size:
        raise ValueError(
            f"tile_n {cfg.tile_n} must be a power of two >= 16 and a multiple of block_size {block_size}"
        )
    if num_splits is not None and num_splits > 256:
        raise ValueError(f"num_splits must be <= 256, got {num_splits}")
    if num_splits is None:
        num_splits = default_num_splits(
            batch, num_kv_heads, max_blocks, block_size, window, cfg.tile_n,
            _num_sms(query.device.type, query.device.index),
        )

    group = num_q_heads // num_kv_heads
    group_pad = max(8, triton.next_power_of_2(group))
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (batch, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_acc = part_ml = out  # unused
    upcast = _INTERPRET and query.dtype == torch.bfloat16  # interpreter bf16 math is broken
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"

    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_pool, v_pool, block_tables, seq_lens, out, part_acc, part_ml,
        float(scale) * _LOG2E, int(window), max_blocks, num_splits,
        query.stride(0), query.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, SPLIT=split, UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    if split:
        split_pad = triton.next_power_of_2(num_splits)
        block_d = max(16, min(dim_pad, 4096 // split_pad))
        _combine_splits_kernel[(batch, num_q_heads, triton.cdiv(head_dim, block_d))](
            part_acc, part_ml, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT_PAD=split_pad, num_warps=4, **launch_options(pdl),
        )
    return out
