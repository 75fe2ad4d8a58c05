"""Fused MoE experts (Triton): the Gemma 4 expert block as four launches, with no host sync anywhere.

:func:`fused_experts` computes what ``MoEExperts.forward`` computes (``x`` [T, H], routing weights [T, k] fp32
and expert ids [T, k] from ``MoERouter``):

1. :func:`group_by_expert`: the T·k (token, slot) pairs are grouped by expert (a counting sort in one
   single-program kernel for small batches, torch sort ops for large ones) and each expert's group is padded
   to ``block_m`` rows. The padded layout has a shape-only upper bound (:func:`max_blocks`), so every launch
   grid depends on shapes alone and the whole call can be captured in a CUDA graph; blocks past the last
   group exit at once.
2. ``_gate_up_geglu_kernel``: one grouped GEMM over ``gate_up_proj`` [E, 2I, H] per block of pairs of one
   expert, with ``gelu_tanh(gate) * up`` in its epilogue -> an [rows, I] intermediate in the model dtype.
3. ``_down_weighted_kernel``: one grouped GEMM over ``down_proj`` [E, H, I] that multiplies each pair's row
   by its routing weight and stores it at the pair's own row of a [T·k, H] buffer (no atomics).
4. ``_sum_slots_kernel``: each token's k rows summed in ascending expert id, the order of the eager
   ``index_add_`` loop, rounding to the model dtype after each add as that loop does (deterministic).

Expert parallel: a rank holding experts [first, first + E) passes ``ids - first``; pairs whose id then lies outside
[0, E) belong to other ranks' experts: no group holds them (step 1), so no GEMM computes them, and step 4 adds
zero for them (their rows of the pair buffer are never written). The ranks' outputs then sum to the full result.

FP8 experts (``gate_up_scale`` / ``down_scale`` given): weights are read as float8_e4m3fn; each GEMM's input rows
(x, then the GeGLU product) are quantized per row beforehand by ``fp8_rows.quantize_rows`` (one launch each), and
the dots take the FP8 operands natively on GPUs that have FP8 tensor cores (see :func:`fused_experts`).

Matmuls accumulate in fp32; each value the eager loop holds in the model dtype (the gate/up and down outputs,
the GeGLU product, the weighted rows, the running sum) is rounded to it here too, so results differ from the
eager experts only by matmul summation order. Block sizes are constexpr and at least 16 (the smallest
``tl.dot`` shape); small batches (decode) use ``block_m`` 16, so a decode step's pairs, mostly one per
expert, waste little of each block. Runs under ``TRITON_INTERPRET=1`` on CPU in fp32/fp16 (the tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8_rows import native_fp8_dot, quantize_rows
from .fused_ops import gelu_tanh
from .pdl import await_previous, launch_options

__all__ = ["ExpertGroups", "fused_experts", "group_by_expert", "max_blocks", "pick_block_m"]


class ExpertGroups(NamedTuple):
    """The (token, slot) pairs of one routing, grouped by expert and padded per expert to ``block_m`` rows.

    Block b holds rows ``b·block_m ..`` of one expert, ``expert_of_block[b]`` [num_blocks] int32 (``num_experts``
    on blocks past the last group, which the kernels skip); its first ``rows_of_block[b]`` [num_blocks] int32
    rows are pairs, the rest padding. ``pair_of_row`` [num_blocks · block_m] int32: the flat pair index
    ``token · k + slot`` of each pair row (padding rows hold unspecified values). Within an expert, pairs keep
    ascending pair order. ``num_blocks`` = :func:`max_blocks`. Pairs whose id lies outside [0, E) (experts held
    by another expert-parallel rank) are in no group.
    """

    pair_of_row: torch.Tensor
    expert_of_block: torch.Tensor
    rows_of_block: torch.Tensor
    block_m: int


SMALL_GROUPING_PAIRS = 1024
"""Up to this many pairs the grouping is one single-program Triton launch (decode and small ticks, where the
dozen-odd torch ops of the sort path would cost more launches than the GEMMs); above it, the torch sort path
(its cost then amortised over larger GEMMs). Untuned."""


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded blocks of ``num_pairs`` pairs over ``num_experts`` experts, from shapes alone:
    each hit expert (at most min(E, pairs)) pads its group by fewer than ``block_m`` rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean pairs per expert (16 for decode-sized batches, up to 64); untuned."""
    mean = num_pairs / max(num_experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 32 else 64)


@triton.jit
def _group_pairs_kernel(ids_ptr, pair_of_row_ptr, expert_of_block_ptr, rows_of_block_ptr, num_pairs, num_blocks,
                        num_experts, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One program: a counting sort of the pairs by expert ([CHUNK, EXPERTS] one-hot tiles), then the blocks."""
    await_previous(PDL)
    experts = tl.arange(0, EXPERTS)
    real = (experts < num_experts)[None, :]  # padding columns count nothing: ids outside [0, E) stay ungrouped
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum(((ids[:, None] == experts[None, :]) & real).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    placed = tl.zeros((EXPERTS,), dtype=tl.int32)  # pairs of each expert placed by earlier chunks
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
        hit = ((ids[:, None] == experts[None, :]) & real).to(tl.int32)
        earlier_in_chunk = tl.cumsum(hit, axis=0) - hit
        row = tl.sum(hit * (padded_start[None, :] + placed[None, :] + earlier_in_chunk), axis=1)
        tl.store(pair_of_row_ptr + row, offs, mask=ok & (ids >= 0) & (ids < num_experts))
        placed += tl.sum(hit, axis=0)
    group_end = padded_start + counts  # one past each expert's last pair row
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        first_row = blocks * BLOCK_M
        # the expert whose padded group holds the block's first row: the count of groups ending at or before it
        ended = (padded_end[None, :] <= first_row[:, None]) & (experts[None, :] < num_experts)
        expert = tl.sum(ended.to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        end = tl.sum(tl.where(mine, group_end[None, :], 0), axis=1)
        rows = tl.minimum(tl.maximum(end - first_row, 0), BLOCK_M)
        rows = tl.where(expert < num_experts, rows, 0)
        ok = blocks < num_blocks
        tl.store(expert_of_block_ptr + blocks, expert, mask=ok)
        tl.store(rows_of_block_ptr + blocks, rows, mask=ok)


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, method: str = "auto", *,
                    pdl: bool = False) -> ExpertGroups:
    """Group the pairs of ``ids`` [T, k] by expert; see :class:`ExpertGroups`. Pairs with an id outside [0, E)
    are skipped (an expert-parallel rank passes every pair, other ranks' experts included). No host sync either
    way. ``method``: "kernel" (one single-program Triton launch), "torch" (sort, searchsorted, cumsum, scatter;
    ``torch.bincount`` would read the max id on the host on CUDA), or "auto" (the kernel up to
    :data:`SMALL_GROUPING_PAIRS` pairs). Both give the same layout. ``ids`` is not mutated. ``pdl``: the kernel
    launched as a programmatic dependent (``kernels.pdl``; Hopper)."""
    flat = ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    if method == "auto":
        method = "kernel" if num_pairs <= SMALL_GROUPING_PAIRS else "torch"
    if method == "kernel":
        pair_of_row = torch.empty((num_blocks * block_m,), dtype=torch.int32, device=device)
        expert_of_block = torch.empty((num_blocks,), dtype=torch.int32, device=device)
        rows_of_block = torch.empty((num_blocks,), dtype=torch.int32, device=device)
        experts_block = max(16, triton.next_power_of_2(num_experts))
        _group_pairs_kernel[(1,)](
            flat.contiguous(), pair_of_row, expert_of_block, rows_of_block, num_pairs, num_blocks, num_experts,
            BLOCK_M=block_m, EXPERTS=experts_block, CHUNK=max(16, 4096 // experts_block), num_warps=4,
            **launch_options(pdl),
        )
        return ExpertGroups(pair_of_row, expert_of_block, rows_of_block, block_m)
    if method != "torch":
        raise ValueError(f"method must be 'auto', 'kernel' or 'torch', got {method!r}")
    flat = flat.to(torch.int64)
    flat = flat.masked_fill((flat < 0) | (flat >= num_experts), num_experts)  # skipped pairs: one E-th "expert"
    sorted_experts, pair_order = torch.sort(flat, stable=True)
    # bounds[e]: the first sorted position of expert e; bounds[E]: of the first skipped pair (or num_pairs)
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=device, dtype=torch.int64))
    counts = bounds[1:] - bounds[:-1]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, dim=0)
    padded_start = padded_end - padded_counts
    rank = torch.arange(num_pairs, device=device, dtype=torch.int64) - bounds[sorted_experts]
    # skipped pairs (sorted last) go to one spare row past the layout, dropped with it
    target = torch.cat([padded_start, padded_start.new_full((1,), num_blocks * block_m)])[sorted_experts]
    target = (target + rank).clamp(max=num_blocks * block_m)
    spare = torch.empty((num_blocks * block_m + 1,), dtype=torch.int32, device=device)
    spare.scatter_(0, target, pair_order.to(torch.int32))
    pair_of_row = spare[: num_blocks * block_m]
    first_row = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    # the first expert whose padded group ends after the block's first row; E past the last group
    expert_of_block = torch.searchsorted(padded_end, first_row, right=True)
    group_end = torch.cat([padded_start + counts, padded_start.new_zeros(1)])  # an E-th "group" of no rows
    rows_of_block = (group_end[expert_of_block] - first_row).clamp(0, block_m)
    return ExpertGroups(pair_of_row, expert_of_block.to(torch.int32), rows_of_block.to(torch.int32), block_m)


@triton.jit
def _block_pairs(block, pair_of_row_ptr, rows_of_block_ptr, BLOCK_M: tl.constexpr):
    """A block's rows, which of them hold pairs, and those pairs' flat indices (0 on padding rows)."""
    local = tl.arange(0, BLOCK_M)
    rows = block * BLOCK_M + local
    valid = local < tl.load(rows_of_block_ptr + block)
    return rows, valid, tl.load(pair_of_row_ptr + rows, mask=valid, other=0)


@triton.jit
def _gate_up_geglu_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, pair_of_row_ptr, expert_of_block_ptr,
                          rows_of_block_ptr, out_ptr, stride_x, hidden, width, num_experts, TOP_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                          FP8: tl.constexpr, FP8_DOT: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    block = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + block)
    if expert >= num_experts:
        return
    rows, valid, pairs = _block_pairs(block, pair_of_row_ptr, rows_of_block_ptr, BLOCK_M)
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    gate_rows = w_ptr + expert.to(tl.int64) * 2 * width * hidden + cols.to(tl.int64) * hidden
    up_rows = gate_rows + width * hidden
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + tokens[:, None] * stride_x
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        gate_w = tl.load(gate_rows[:, None] + ks[None, :], mask=w_mask, other=0.0)
        up_w = tl.load(up_rows[:, None] + ks[None, :], mask=w_mask, other=0.0)
        if FP8_DOT:  # FP8 tensor-core dots, fp32 sums; the scales applied below
            acc_gate = tl.dot(x, tl.trans(gate_w), acc_gate)
            acc_up = tl.dot(x, tl.trans(up_w), acc_up)
        else:
            if FP8:  # the FP8 values widened (exact in the model dtype)
                x = x.to(tl.float32).to(dtype)
                gate_w = gate_w.to(tl.float32).to(dtype)
                up_w = up_w.to(tl.float32).to(dtype)
            acc_gate = tl.dot(x, tl.trans(gate_w), acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, tl.trans(up_w), acc_up, input_precision=PRECISION)
    if FP8:  # as torch._scaled_mm: fp32 sum x row scale x column scale, then one rounding
        x_scale = tl.load(x_scale_ptr + tokens, mask=valid, other=0.0)
        scales = w_scale_ptr + expert.to(tl.int64) * 2 * width + cols
        acc_gate = acc_gate * x_scale[:, None] * tl.load(scales, mask=col_ok, other=0.0)[None, :]
        acc_up = acc_up * x_scale[:, None] * tl.load(scales + width, mask=col_ok, other=0.0)[None, :]
    gate = acc_gate.to(dtype).to(tl.float32)  # eager: F.linear's output in the model dtype, then chunk
    up = acc_up.to(dtype).to(tl.float32)
    gelu = gelu_tanh(gate).to(dtype).to(tl.float32)  # eager rounds gelu's output
    product = gelu * up
    out = out_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(out, product.to(dtype), mask=col_ok[None, :])  # padding rows store zeros (their x rows were 0)


@triton.jit
def _down_weighted_kernel(h_ptr, h_scale_ptr, w_ptr, w_scale_ptr, pair_of_row_ptr, expert_of_block_ptr,
                          rows_of_block_ptr, routing_ptr, out_ptr, hidden, width, num_experts, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                          FP8_DOT: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    block = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + block)
    if expert >= num_experts:
        return
    rows, valid, pairs = _block_pairs(block, pair_of_row_ptr, rows_of_block_ptr, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = w_ptr + expert.to(tl.int64) * hidden * width + cols.to(tl.int64) * width
    h_rows = (h_ptr + rows.to(tl.int64) * width)[:, None]
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < width
        h = tl.load(h_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8_DOT:
            acc = tl.dot(h, tl.trans(w), acc)
        else:
            if FP8:
                h = h.to(tl.float32).to(dtype)
                w = w.to(tl.float32).to(dtype)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if FP8:
        h_scale = tl.load(h_scale_ptr + rows, mask=valid, other=0.0)
        scale = tl.load(w_scale_ptr + expert.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0)
        acc = acc * h_scale[:, None] * scale[None, :]
    routing = tl.load(routing_ptr + pairs, mask=valid, other=0.0)
    # eager: the down output in the model dtype times the fp32 weight, rounded to the model dtype
    y = acc.to(dtype).to(tl.float32) * routing[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(pair_out_ptr, ids_ptr, out_ptr, hidden, num_experts, TOP_K: tl.constexpr,
                      SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    # each slot's rank in (expert id, slot) order: the eager loop adds experts in ascending id
    slots = tl.arange(0, SLOTS)
    real = slots < TOP_K
    ids = tl.load(ids_ptr + token * TOP_K + slots, mask=real, other=0)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None]))
    rank = tl.sum((before & real[None, :]).to(tl.int32), axis=1)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    held = real & (ids >= 0) & (ids < num_experts)  # pairs of other expert-parallel ranks' experts add zero
    for r in tl.static_range(TOP_K):
        slot = tl.sum(tl.where((rank == r) & real, slots, 0), axis=0).to(tl.int64)
        slot_held = tl.sum(tl.where((rank == r) & held, 1, 0), axis=0) > 0
        row = tl.load(pair_out_ptr + (token * TOP_K + slot) * hidden + cols, mask=ok & slot_held,
                      other=0.0).to(tl.float32)
        acc = (acc + row).to(dtype).to(tl.float32)  # eager: index_add_ into a model-dtype output
    tl.store(out_ptr + token * hidden + cols, acc.to(dtype), mask=ok)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None, *, block_m: int | None = None, block_n: int | None = None,
                  block_k: int = 64, grouping: str = "auto", pdl: bool = False) -> torch.Tensor:
    """``MoEExperts.forward`` fused: x [T, H] (last dim contiguous), weights [T, k] (fp32 routing weights),
    ids [T, k] (int; pairs with an id outside [0, E) are skipped: they add zero), gate_up_proj [E, 2I, H] (gate
    rows first), down_proj [E, H, I], both contiguous in x's dtype. Returns a new [T, H] in x's dtype; mutates nothing. No host sync, grids from shapes only
    (CUDA-graph capturable). ``block_m`` (rows per block; default :func:`pick_block_m`), ``block_n`` (output
    columns per program; default 32 with ``block_m`` 16, so a decode step's few blocks still spread over many
    programs, else 64), ``block_k``: powers of two >= 16. Defaults untuned (no GPU measurement yet).
    ``grouping``: :func:`group_by_expert`'s method. ``pdl``: every launch a programmatic dependent of the one
    before (``kernels.pdl``; Hopper; each kernel waits before it reads anything).

    FP8 experts (``quantization.quantize_fp8``): both weights float8_e4m3fn with fp32 per-output-channel scales
    ``gate_up_scale`` [E, 2I] and ``down_scale`` [E, H]. x, then the GeGLU product, are quantized per row to FP8
    by ``quantize_rows`` (the definition ``quantization.linear`` uses per token), the FP8 values multiplied with
    fp32 sums (FP8 tensor-core dots on compute capability 8.9+; elsewhere, e.g. the CPU interpreter, widened to
    the model dtype: the same exact products) and the row and column scales applied before the one rounding:
    the eager FP8 loop's arithmetic up to summation order."""
    tokens, hidden = x.shape
    num_experts, double_width, hidden_w = gate_up_proj.shape
    width = double_width // 2
    top_k = ids.shape[-1] if ids.dim() == 2 else 0
    if hidden_w != hidden or double_width != 2 * width or tuple(down_proj.shape) != (num_experts, hidden, width):
        raise ValueError(f"expert weights gate_up {tuple(gate_up_proj.shape)} / down {tuple(down_proj.shape)} "
                         f"do not fit hidden {hidden}")
    if tuple(ids.shape) != (tokens, top_k) or tuple(weights.shape) != (tokens, top_k):
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{tokens}, k]")
    if not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()):
        raise ValueError("expert weights must be contiguous")
    fp8 = gate_up_scale is not None
    if fp8 != (down_scale is not None) or fp8 != (gate_up_proj.dtype == torch.float8_e4m3fn) \
            or fp8 != (down_proj.dtype == torch.float8_e4m3fn):
        raise ValueError(f"expert weights {gate_up_proj.dtype} / {down_proj.dtype}: FP8 weights need both scales, "
                         "model-dtype weights none")
    if fp8:
        assert gate_up_scale is not None and down_scale is not None
        if tuple(gate_up_scale.shape) != (num_experts, double_width) or tuple(down_scale.shape) != (num_experts,
                                                                                                   hidden):
            raise ValueError(f"FP8 scales {tuple(gate_up_scale.shape)} / {tuple(down_scale.shape)} must be "
                             f"[{num_experts}, {double_width}] / [{num_experts}, {hidden}]")
        gate_up_scale = gate_up_scale.float().contiguous()
        down_scale = down_scale.float().contiguous()
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_pairs = tokens * top_k
    block_m = block_m or pick_block_m(num_pairs, num_experts)
    block_n = block_n or (32 if block_m == 16 else 64)
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    ids = ids.contiguous()
    groups = group_by_expert(ids, num_experts, block_m, grouping, pdl=pdl)
    num_blocks = groups.expert_of_block.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding of the inputs
    fp8_dot = fp8 and native_fp8_dot(x.device)
    x_in, x_scale = quantize_rows(x, pdl=pdl) if fp8 else (x, x)
    intermediate = torch.empty((num_blocks * block_m, width), dtype=x.dtype, device=x.device)
    _gate_up_geglu_kernel[(num_blocks, triton.cdiv(width, block_n))](
        x_in, x_scale, gate_up_proj, gate_up_proj if gate_up_scale is None else gate_up_scale, groups.pair_of_row,
        groups.expert_of_block, groups.rows_of_block, intermediate, x_in.stride(0), hidden, width, num_experts,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, FP8=fp8,
        FP8_DOT=fp8_dot, num_warps=4, **launch_options(pdl),
    )
    h_in, h_scale = quantize_rows(intermediate, pdl=pdl) if fp8 else (intermediate, intermediate)
    pair_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    routing = weights.reshape(-1).to(torch.float32).contiguous()
    _down_weighted_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h_in, h_scale, down_proj, down_proj if down_scale is None else down_scale, groups.pair_of_row,
        groups.expert_of_block, groups.rows_of_block, routing, pair_out, hidden, width, num_experts, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, FP8=fp8, FP8_DOT=fp8_dot, num_warps=4,
        **launch_options(pdl),
    )
    sum_block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, sum_block))](
        pair_out, ids, out, hidden, num_experts, TOP_K=top_k, SLOTS=max(2, triton.next_power_of_2(top_k)),
        BLOCK=sum_block, num_warps=4 if sum_block >= 512 else 1, **launch_options(pdl),
    )
    return out
