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
- Split keys: a tile's key range may be walked by several programs (grid axis 2, :func:`ragged_num_splits`
  from shapes only), each of at least ``_SPLIT_MIN_KEYS`` keys, whose unnormalised partials ``(acc, m, l)``
  go to fp32 scratch and one combine kernel merges; both kernels derive a tile's split layout from the same
  ``_tile_geometry``. Without it a tick of few tiles (decode rows at long context beside a short chunk) ran
  one program per tile, serially over every key, on a few of the SMs.
- Online softmax in fp32 (base 2, ``scale * log2(e)`` folded in), ``tl.dot`` with fp32 accumulation; the
  interpreter upcasts bf16 first (its bf16 arithmetic is broken).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from .paged_attention import _tile_kv, _tile_pages
from .ragged_reference import query_tiles

__all__ = ["RaggedKernelConfig", "default_ragged_config", "query_tiles", "ragged_block_m", "ragged_num_splits",
           "ragged_paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _tile_geometry(tile, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, window,
                   BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLITS: tl.constexpr,
                   SPLIT_TILES: tl.constexpr):
    """A tile's sequence, first query, query count, first query position, key range ``[lo, hi)`` walked from
    ``base`` in ``n_tiles`` key tiles, and the key tiles per split ``per`` (the attention and combine kernels
    both derive the split layout from here, so they agree on it)."""
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_lo = tl.load(qstart_ptr + seq)
    n_q = tl.load(qstart_ptr + seq + 1) - q_lo
    first_pos = tl.load(seq_lens_ptr + seq) - n_q  # position of the sequence's first query
    last_q = tl.minimum(q0 + BLOCK_M, n_q) - 1
    hi = first_pos + last_q + 1  # keys after the tile's last query are never visible
    lo = first_pos + q0
    lo = tl.where(window > 0, tl.maximum(lo - window + 1, 0), 0)
    base = (lo // BLOCK_SIZE) * BLOCK_SIZE
    n_tiles = tl.cdiv(hi - base, TILE_N)
    per = tl.maximum(tl.cdiv(n_tiles, SPLITS), SPLIT_TILES)
    return seq, q0, q_lo, n_q, first_pos, lo, hi, base, n_tiles, per


@triton.jit(do_not_specialize=["window"])
def _ragged_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, num_tiles_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, qk_scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bts, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq, q0, q_lo, n_q, first_pos, lo, hi, base, n_tiles, per = _tile_geometry(
        tile, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, window, BLOCK_M, BLOCK_SIZE, TILE_N, SPLITS,
        SPLIT_TILES)
    t_lo = split * per
    if t_lo >= n_tiles:
        return  # a split this tile's key range does not need (the combine reads only the ones it needs)
    t_hi = tl.minimum(t_lo + per, n_tiles)

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

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for t in range(t_lo, t_hi):
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
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    else:  # this split's unnormalised partial: every row of the tile's scratch, valid or not
        slot = ((tile.to(tl.int64) * tl.num_programs(1) + kvh) * SPLITS + split) * ROWS + offs_r
        tl.store(part_acc_ptr + slot[:, None] * DIM_PAD + offs_d[None, :], acc)
        tl.store(part_ml_ptr + slot * 2, m_i)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i)


@triton.jit(do_not_specialize=["window"])
def _ragged_combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, num_tiles_ptr, window,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr,
):
    """out rows of one (tile, kv head, d chunk) = sum_s w_s acc_s / sum_s w_s l_s over the splits the tile's key
    range used, w_s = 2^(m_s - max m); rows no key is visible to (m = -inf everywhere) come out as zeros."""
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    kvh = tl.program_id(1)
    seq, q0, q_lo, n_q, first_pos, lo, hi, base, n_tiles, per = _tile_geometry(
        tile, qstart_ptr, seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, window, BLOCK_M, BLOCK_SIZE, TILE_N, SPLITS,
        SPLIT_TILES)
    used = tl.cdiv(n_tiles, per)
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    offs_r = tl.arange(0, ROWS)
    qi = q0 + offs_r // GROUP_PAD
    g = offs_r % GROUP_PAD
    row_ok = (qi < n_q) & (g < GROUP)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    slot0 = (tile.to(tl.int64) * tl.num_programs(1) + kvh) * SPLITS * ROWS + offs_r
    m_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    for s in range(0, used):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (slot0 + s * ROWS) * 2))
    pivot = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros([ROWS], dtype=tl.float32)
    o = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        slot = slot0 + s * ROWS
        w = tl.exp2(tl.load(part_ml_ptr + slot * 2) - pivot)
        denom += w * tl.load(part_ml_ptr + slot * 2 + 1)
        acc = tl.load(part_acc_ptr + slot[:, None] * DIM_PAD + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        o += acc * w[:, None]
    o = o / tl.where(denom > 0.0, denom, 1.0)[:, None]
    heads = kvh * GROUP + g
    q_rows = (q_lo + qi).to(tl.int64)
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


@dataclass(frozen=True)
class RaggedKernelConfig:
    """Launch parameters of :func:`ragged_paged_attention`. ``block_m``: queries per tile (the tile map must be
    built with it); ``tile_n``: keys per loop step (a power of two, a multiple of the block size)."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


@cache
def default_ragged_config(head_dim: int, group: int, block_size: int) -> RaggedKernelConfig:
    """The configuration a layer of these shapes runs with: :func:`ragged_block_m` queries per tile, 32-key steps (the
    block size when larger), 4 warps; 3 stages at D <= 256, 2 at D = 512. Chosen by
    ``benchmarks/kernels/bench_ragged_attention.py --sweep`` on an H100 at E2B shapes in bf16 (run 33): at D = 512
    the previous 16-key steps with 8 warps took 632 / 2,722 / 148 µs on a 16 x 512-token prompt tick / 16 chunks at
    1,024 context / 32 decode rows + a chunk, this 346 / 1,386 / 81 µs; at D = 256 the third stage gained ~3 %.
    fp32 at D = 512 runs too (the GPU parity tests' fp32 fast path, run 33), untimed."""
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = max(32, triton.next_power_of_2(block_size))
    return RaggedKernelConfig(ragged_block_m(head_dim, group), tile_n, 4, 3 if dim_pad <= 256 else 2)


_SPLIT_MIN_KEYS = 256
"""Fewest keys a split walks: shorter ranges are not worth their partial's round trip through memory."""
_MAX_SPLITS = 16
_SPLIT_SCRATCH_BYTES = 64 << 20
"""Cap of the fp32 partials of one call: ticks with many tiles (big prefills, which fill the GPU anyway)
get fewer splits, down to none."""


def ragged_num_splits(num_tiles: int, num_kv_heads: int, rows: int, dim_pad: int, max_keys: int,
                      tile_n: int) -> tuple[int, int]:
    """``(splits, key tiles per split at least)`` from shapes only (graph-capturable): a tile whose key range
    is long is walked by up to ``splits`` programs of at least ``_SPLIT_MIN_KEYS`` keys each, whose partials a
    combine kernel merges, so a tick of few tiles (decode rows at long context, a short chunk) still spreads
    over the GPU. ``max_keys``: the longest key range a tile can have."""
    split_tiles = max(1, _SPLIT_MIN_KEYS // tile_n)
    by_keys = -(-(-(-max_keys // tile_n)) // split_tiles)
    by_scratch = _SPLIT_SCRATCH_BYTES // max(1, num_tiles * num_kv_heads * rows * dim_pad * 4)
    return max(1, min(_MAX_SPLITS, by_keys, by_scratch)), split_tiles


def ragged_paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, window: int = 0,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    num_splits: int | None = None, config: RaggedKernelConfig | None = None,
) -> torch.Tensor:
    """Ragged paged attention (Triton); arguments as ``ragged_paged_attention_reference``. ``tiles``:
    ``(tile_seq int32 [N], tile_q0 int32 [N], num_valid int32 [1])`` from :func:`query_tiles` with
    :func:`ragged_block_m` of this layer's shapes (built from ``query_start`` on the host, one sync, when
    None); ``N`` may exceed ``num_valid`` (padding programs exit at once). Rows of ``q`` that no tile covers
    (padding tokens) come out as zeros. ``num_splits``: most programs per tile's key range (None: from the
    shapes, :func:`ragged_num_splits`; 1 = no split and no combine). No host sync when ``tiles`` is given:
    graph-capturable. ``config``: launch parameters (default :func:`default_ragged_config`; ``tiles`` must be
    built with its ``block_m``)."""
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
    config = config or default_ragged_config(head_dim, group, block_size)
    block_m, tile_n = config.block_m, config.tile_n
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
    upcast = _INTERPRET and q.dtype == torch.bfloat16
    group_pad = _group_pad(num_q_heads, num_kv_heads)
    rows = block_m * group_pad
    num_tiles = tile_seq.numel()
    max_keys = block_tables.shape[1] * block_size
    if window > 0:  # a tile sees at most its queries' window, from a page boundary
        max_keys = min(max_keys, window + block_m + block_size)
    splits, split_tiles = ragged_num_splits(num_tiles, num_kv_heads, rows, dim_pad, max_keys, tile_n)
    if num_splits is not None:
        if not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits must be in [1, 256], got {num_splits}")
        splits = num_splits
        split_tiles = 1
    if splits > 1:
        part_acc = torch.empty((num_tiles * num_kv_heads * splits * rows, dim_pad), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_tiles * num_kv_heads * splits * rows, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _ragged_kernel[(num_tiles, num_kv_heads, splits)](
        q, k_pool, v_pool, block_tables, query_start, seq_lens, tile_seq, tile_q0, num_valid, out,
        part_acc, part_ml, float(scale) * _LOG2E, int(window),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n, UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits, SPLIT_TILES=split_tiles,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        block_d = min(dim_pad, max(16, 4096 // rows))
        _ragged_combine_kernel[(num_tiles, num_kv_heads, triton.cdiv(head_dim, block_d))](
            part_acc, part_ml, out, query_start, seq_lens, tile_seq, tile_q0, num_valid, int(window),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
            BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n, SPLITS=splits, SPLIT_TILES=split_tiles,
            num_warps=4,
        )
    return out
