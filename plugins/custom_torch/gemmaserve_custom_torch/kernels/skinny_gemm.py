"""Triton matmuls for few rows (decode at batch 1-64), built to stream the weights near the HBM limit.

At small M a decode step's projections are weight reads: every weight byte is read once per step and the
arithmetic is idle. These kernels tile the output columns and, when that gives too few programs to keep every
SM streaming, also split the reduction dimension (``split_k``): each program reads one ``[BLOCK_N, K / split]``
slab of the weight once, and a second kernel sums the fp32 partials in a fixed order (deterministic, no atomics)
and applies the epilogue.

- :func:`skinny_linear`: ``x @ w.T`` (``F.linear`` without bias);
- :func:`skinny_linear_gelu_mul`: ``gelu_tanh(x @ w.T) * mul`` (the per-layer-embedding gate) in the epilogue;
- :func:`skinny_linear_residual_norm`: ``fused_ops.residual_norm`` of the product, run by the split-K reduce (one
  program per row: the post-norm needs the whole row), so a projection and the residual chain after it are two
  launches, not three;
- :func:`skinny_linear_fp8`: the ``torch._scaled_mm`` product ``(xq @ wq.T) * x_scale * w_scale`` of FP8 operands
  with their row scales, the weights streamed as one byte each and dotted as FP8 where the GPU takes FP8 dots
  (compute capability 8.9+: e4m3 tensor cores from 64-row blocks, a hardware e4m3 -> f16 conversion below), else
  widened exactly to the dot's dtype (bf16, fp32 for fp32 outputs; the CPU interpreter);
- :func:`skinny_fp8_linear`: ``quantization.linear`` of model-dtype rows and an FP8 weight: the rows quantized
  (``fp8_rows.quantize_rows``), then :func:`skinny_linear_fp8`;
- :func:`skinny_geglu`: ``gelu_tanh(x @ gate.T) * (x @ up.T)`` over a fused ``[gate; up]`` weight, the GeGLU
  MLP's first half, rounding where the eager chain rounds (the projections, gelu's output, the product);
- :func:`lm_head_argmax`: the greedy token of ``softcap(x @ w.T)`` without writing the logits: each program
  keeps its tile's largest (rounded, soft-capped) logit and its first index; ties go to the lowest token id,
  as ``torch.argmax`` does.

Weights are ``[N, K]`` row-major as the model holds them (no repacking). Inputs must have a contiguous last
dim. Accumulation is fp32, so results equal cuBLAS's up to summation order (last-bit differences in bf16).
Nothing syncs the host; every launch grid depends on shapes only (CUDA-graph capturable). Runs on CPU under
``TRITON_INTERPRET=1`` (fp32 / fp16, tiny shapes) for the tests.

``skinny_linear`` and ``skinny_geglu`` run decode's model-dtype projections of at most
``CUSTOM_BACKEND_SKINNY_MAX_ROWS`` rows (``fusion.fuse_small_batch``; 32 by default on CUDA), launched as programmatic
dependents on Hopper (``pdl=True``, ``kernels.pdl``): per product they tie cuBLAS, chained with PDL they took 13 % off
E2B's decode step at one row on an H100 (docs/benchmarks.md, run 28). ``skinny_fp8_linear`` runs the FP8 products
of as many rows, in the same chain: with its native FP8 dots the product beat ``torch._scaled_mm`` in 31B FP8
decode on an H100 (run 29). ``lm_head_argmax`` is not wired (``benchmarks/kernels/bench_skinny_gemm.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8_rows import native_fp8_dot, quantize_rows
from .fused_ops import gelu_tanh, residual_norm_row, residual_norm_warps
from .pdl import await_previous, launch_options

__all__ = [
    "choose_split_k", "lm_head_argmax", "skinny_fp8_linear", "skinny_geglu", "skinny_linear", "skinny_linear_fp8",
    "skinny_linear_gelu_mul", "skinny_linear_residual_norm",
]

#: Programs to aim for when choosing ``split_k``: two waves of the H200's 132 SMs.
TARGET_PROGRAMS = 264


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _precision(x: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"; Triton's default for fp32 on the GPU is tf32)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def choose_split_k(m: int, n: int, k: int, block_n: int = 64, block_k: int = 128) -> int:
    """How many slices to cut K into so that ``column tiles x row tiles x slices`` reaches TARGET_PROGRAMS,
    keeping at least two K blocks per slice. 1 when the column tiles alone fill the GPU. Shapes only."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, _block_m(m))
    if tiles >= TARGET_PROGRAMS:
        return 1
    most = max(1, k // (2 * block_k))
    return max(1, min(most, triton.cdiv(TARGET_PROGRAMS, tiles)))


@triton.jit
def _accumulate(acc, x_ptr, w_ptr, offs_m, offs_n, m, n, k_start, k_stop, stride_xm, stride_wn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                WIDEN: tl.constexpr = None):
    """fp32 ``acc`` [BLOCK_M, BLOCK_N] += x[offs_m, k_start:k_stop] @ w[offs_n, k_start:k_stop].T (masked), one
    BLOCK_K tile at a time in ascending K. ``WIDEN``: the dtype both tiles are converted to before the dot (FP8
    operands; exact)."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_stop
        xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                     mask=(offs_m[:, None] < m) & k_mask[None, :], other=0.0)
        ws = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :],
                     mask=(offs_n[:, None] < n) & k_mask[None, :], other=0.0)
        if WIDEN is not None:
            xs = xs.to(WIDEN)
            ws = ws.to(WIDEN)
        acc += tl.dot(xs, tl.trans(ws), input_precision=PRECISION, out_dtype=tl.float32)
    return acc


@triton.jit
def _dot_slab(x_ptr, w_ptr, offs_m, offs_n, m, n, k_start, k_stop, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
              WIDEN: tl.constexpr = None):
    """fp32 [BLOCK_M, BLOCK_N] = x[offs_m, k_start:k_stop] @ w[offs_n, k_start:k_stop].T (masked)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return _accumulate(acc, x_ptr, w_ptr, offs_m, offs_n, m, n, k_start, k_stop, stride_xm, stride_wn,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, WIDEN)


@triton.jit
def _dot_slab_after_wait(x_ptr, w_ptr, offs_m, offs_n, m, n, k_start, k_stop, stride_xm, stride_wn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, WIDEN: tl.constexpr = None):
    """:func:`_dot_slab` for a programmatic dependent launch: the slab's first weight tile (which no earlier kernel
    writes) is loaded before ``gdc_wait`` so it streams while the previous kernel finishes; ``x`` (its output)
    only after. Same products, same order."""
    offs_k = tl.arange(0, BLOCK_K)
    ks = k_start + offs_k
    k_mask = ks < k_stop
    ws = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=(offs_n[:, None] < n) & k_mask[None, :],
                 other=0.0)
    tl.extra.cuda.gdc_wait()
    xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=(offs_m[:, None] < m) & k_mask[None, :],
                 other=0.0)
    if WIDEN is not None:
        xs = xs.to(WIDEN)
        ws = ws.to(WIDEN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc += tl.dot(xs, tl.trans(ws), input_precision=PRECISION, out_dtype=tl.float32)
    return _accumulate(acc, x_ptr, w_ptr, offs_m, offs_n, m, n, k_start + BLOCK_K, k_stop, stride_xm, stride_wn,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, WIDEN)


@triton.jit
def _gelu_times(acc, up, dtype):
    """``gelu_tanh(round(acc)) * up`` rounded where the eager chain rounds (the projection, gelu's output); ``up``
    fp32 holding model-dtype values. Returns fp32 (the caller rounds once more when it stores)."""
    gate = acc.to(dtype).to(tl.float32)
    return gelu_tanh(gate).to(dtype).to(tl.float32) * up


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, part_ptr, x_scale_ptr, w_scale_ptr, mul_ptr, m, n_out, k, k_per_split,
                   stride_xm, stride_wn, stride_mul, up_offset, GEGLU: tl.constexpr, GELU_MUL: tl.constexpr,
                   SPLIT: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (column tile, row tile, K slice). SPLIT: write fp32 partials [slices, m, n_out(x2 for GEGLU)];
    else write the rounded result with the epilogue: times the row scales (SCALED), ``gelu(gate) * up`` of the
    two products (GEGLU) or ``gelu(product) * mul`` (GELU_MUL). PDL: launched as a programmatic dependent (see
    :func:`_dot_slab_after_wait`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight loads
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, k)
    if PDL:
        acc = _dot_slab_after_wait(x_ptr, w_ptr, offs_m, offs_n, m, n_out, k_start, k_stop, stride_xm, stride_wn,
                                   BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, WIDEN)
    else:
        acc = _dot_slab(x_ptr, w_ptr, offs_m, offs_n, m, n_out, k_start, k_stop, stride_xm, stride_wn,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, WIDEN)
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < n_out)
    if GEGLU:
        acc_up = _dot_slab(x_ptr, w_ptr + up_offset * stride_wn, offs_m, offs_n, m, n_out, k_start, k_stop,
                           stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, None)
    if SPLIT:
        width = n_out * 2 if GEGLU else n_out
        base = part_ptr + pid_k.to(tl.int64) * m * width + offs_m[:, None] * width + offs_n[None, :]
        tl.store(base, acc, mask=mask)
        if GEGLU:
            tl.store(base + n_out, acc_up, mask=mask)
    else:
        dtype = out_ptr.dtype.element_ty
        if SCALED:
            x_scale = tl.load(x_scale_ptr + offs_m, mask=offs_m < m, other=0.0)
            acc = _scaled(acc, x_scale, w_scale_ptr, offs_n, n_out)
        if GEGLU:
            acc = _gelu_times(acc, acc_up.to(dtype).to(tl.float32), dtype)
        if GELU_MUL:
            up = tl.load(mul_ptr + offs_m[:, None].to(tl.int64) * stride_mul + offs_n[None, :], mask=mask, other=0.0)
            acc = _gelu_times(acc, up.to(tl.float32), dtype)
        tl.store(out_ptr + offs_m[:, None] * n_out + offs_n[None, :], acc.to(dtype), mask=mask)


@triton.jit
def _scaled(acc, x_scale, w_scale_ptr, offs_n, n):
    """fp32 ``acc`` [rows, cols] times ``x_scale`` [rows] (per row) and w_scale[offs_n] (per column)."""
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < n, other=0.0)
    return acc * x_scale[:, None] * w_scale[None, :]


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, x_scale_ptr, w_scale_ptr, mul_ptr, m, n_out, slices, stride_mul,
                   GEGLU: tl.constexpr, GELU_MUL: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    """out[row, cols] = epilogue(sum over slices, in slice order)."""
    await_previous(PDL)  # the partials are the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_out
    width = n_out * 2 if GEGLU else n_out
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, slices):
        base = part_ptr + (s * m + row) * width + cols
        acc += tl.load(base, mask=mask, other=0.0)
        if GEGLU:
            acc_up += tl.load(base + n_out, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if SCALED:
        acc = acc * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + cols, mask=mask, other=0.0)
    if GEGLU:
        acc = _gelu_times(acc, acc_up.to(dtype).to(tl.float32), dtype)
    if GELU_MUL:
        acc = _gelu_times(acc, tl.load(mul_ptr + row * stride_mul + cols, mask=mask, other=0.0).to(tl.float32), dtype)
    tl.store(out_ptr + row * n_out + cols, acc.to(dtype), mask=mask)


@triton.jit
def _reduce_residual_norm_kernel(part_ptr, res_ptr, norm_ptr, scale_ptr, next_norm_ptr, out_ptr, next_ptr, m, n_out,
                                 slices, stride_r, eps, eps_next, ONE_PLUS: tl.constexpr, HAS_SCALE: tl.constexpr,
                                 HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row: the product (sum over slices, in slice order, rounded to the model dtype) through
    ``fused_ops.residual_norm_row`` (post-norm, residual add, scale, next norm)."""
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_out
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, slices):
        acc += tl.load(part_ptr + (s * m + row) * n_out + offs, mask=mask, other=0.0)
    h = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, as the eager linear rounds it
    residual_norm_row(h, res_ptr + row * stride_r, norm_ptr, scale_ptr, next_norm_ptr, out_ptr + row * n_out,
                      next_ptr + row * n_out, offs, mask, n_out, eps, eps_next, ONE_PLUS, HAS_SCALE, HAS_NEXT)


_WIDEN = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a contiguous last dimension")


class _Plan(NamedTuple):
    """A product's row block, K slices and K per slice (shapes only), and its grid."""

    block_m: int
    slices: int
    k_per_split: int
    grid: tuple[int, int, int]


def _split_plan(m: int, n_out: int, k: int, geglu: bool, split_k: int | None, block_n: int, block_k: int) -> _Plan:
    slices = split_k if split_k is not None else choose_split_k(m, n_out * (2 if geglu else 1), k, block_n, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, slices), block_k) * block_k
    slices, block_m = triton.cdiv(k, k_per_split), _block_m(m)
    return _Plan(block_m, slices, k_per_split, (triton.cdiv(n_out, block_n), triton.cdiv(m, block_m), slices))


def _products(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n_out: int, geglu: bool, plan: _Plan,
              block_n: int, block_k: int, num_warps: int, *, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
              mul: torch.Tensor | None = None, pdl: bool = False, always_split: bool = False) -> torch.Tensor | None:
    """Launch the product kernel for x [M, K] (M > 0) into ``out`` [M, n_out] with its epilogue, or, when K is split
    (or ``always_split``), into fp32 partials: then returns them ([slices, M, width]) for a reduce kernel to
    finish; else None."""
    m, k = x.shape
    split = plan.slices > 1 or always_split
    partials = (torch.empty(plan.slices, m, n_out * (2 if geglu else 1), device=x.device, dtype=torch.float32)
                if split else out)
    x_scale, w_scale = scales if scales is not None else (out, out)  # unread unless SCALED
    _skinny_kernel[plan.grid](x, w, out, partials, x_scale, w_scale, out if mul is None else mul, m, n_out, k,
                              plan.k_per_split, x.stride(0), w.stride(0), 0 if mul is None else mul.stride(0), n_out,
                              GEGLU=geglu, GELU_MUL=mul is not None, SPLIT=split, SCALED=scales is not None,
                              BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(out),
                              WIDEN=_WIDEN[out.dtype] if scales is not None and not native_fp8_dot(x.device) else None,
                              num_warps=num_warps, **launch_options(pdl))
    return partials if split else None


def _launch(x: torch.Tensor, w: torch.Tensor, n_out: int, geglu: bool, split_k: int | None, block_n: int,
            block_k: int, num_warps: int, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
            out_dtype: torch.dtype | None = None, pdl: bool = False, mul: torch.Tensor | None = None) -> torch.Tensor:
    _check_operands(x, w)
    m = x.shape[0]
    out = torch.empty(m, n_out, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0 or n_out == 0:
        return out
    plan = _split_plan(m, n_out, x.shape[1], geglu, split_k, block_n, block_k)
    partials = _products(x, w, out, n_out, geglu, plan, block_n, block_k, num_warps, scales=scales, mul=mul, pdl=pdl)
    if partials is not None:
        x_scale, w_scale = scales if scales is not None else (out, out)
        reduce_block = 256
        _reduce_kernel[(m, triton.cdiv(n_out, reduce_block))](
            partials, out, x_scale, w_scale, out if mul is None else mul, m, n_out, plan.slices,
            0 if mul is None else mul.stride(0), GEGLU=geglu, GELU_MUL=mul is not None, SCALED=scales is not None,
            BLOCK=reduce_block, num_warps=4, **launch_options(pdl))
    return out


def skinny_linear(x: torch.Tensor, w: torch.Tensor, *, split_k: int | None = None, block_n: int = 64,
                  block_k: int = 128, num_warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """``x @ w.T`` for x [M, K], w [N, K] -> new [M, N] in x's dtype. ``split_k=None`` picks the slices from
    the shapes (:func:`choose_split_k`). ``pdl``: launch as a programmatic dependent of the previous kernel
    (Hopper; ``kernels.pdl``): the first weight tiles stream while that kernel finishes."""
    return _launch(x, w, w.shape[0], False, split_k, block_n, block_k, num_warps, pdl=pdl)


def skinny_linear_gelu_mul(x: torch.Tensor, w: torch.Tensor, mul: torch.Tensor, *, split_k: int | None = None,
                           block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                           pdl: bool = False) -> torch.Tensor:
    """``gelu_tanh(x @ w.T) * mul`` (the per-layer-embedding gate) for x [M, K], w [N, K] and mul [M, N] (last
    dim contiguous, rows may be strided) -> new [M, N] in x's dtype, rounded where the eager chain rounds."""
    if mul.shape != (x.shape[0], w.shape[0]) or (mul.numel() and mul.stride(1) != 1) or mul.dtype != x.dtype:
        raise ValueError(f"mul must be [{x.shape[0]}, {w.shape[0]}] in {x.dtype} with a contiguous last dim; got "
                         f"{tuple(mul.shape)} {mul.dtype}")
    return _launch(x, w, w.shape[0], False, split_k, block_n, block_k, num_warps, pdl=pdl, mul=mul)


def skinny_linear_residual_norm(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, style: str, *,
    scale: torch.Tensor | None = None, next_weight: torch.Tensor | None = None, next_eps: float | None = None,
    split_k: int | None = None, block_n: int = 64, block_k: int = 128, num_warps: int = 4, pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_ops.residual_norm(residual, x @ w.T, weight, eps, style, scale=, next_weight=, next_eps=)`` in two
    launches: the product into fp32 partials (K split as :func:`skinny_linear` splits it, one slice at least),
    then one program per row sums them and runs the residual chain (post-norm, residual add, scale, next norm).
    x [M, K], w [N, K], residual [M, N] (last dim contiguous). Returns new (y [M, N], next [M, N] or None)."""
    _check_operands(x, w)
    m, n = x.shape[0], w.shape[0]
    if residual.shape != (m, n) or (residual.numel() and residual.stride(1) != 1):
        raise ValueError(f"residual must be [{m}, {n}] with a contiguous last dim; got {tuple(residual.shape)}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    nxt = torch.empty_like(out) if next_weight is not None else None
    if m == 0 or n == 0:
        return out, nxt
    block = triton.next_power_of_2(n)
    chain = {"res_ptr": residual, "norm_ptr": weight, "scale_ptr": weight if scale is None else scale,
             "next_norm_ptr": weight if next_weight is None else next_weight, "next_ptr": out if nxt is None else nxt,
             "stride_r": residual.stride(0), "eps": float(eps),
             "eps_next": float(eps if next_eps is None else next_eps),
             "ONE_PLUS": style == "one_plus_w", "HAS_SCALE": scale is not None, "HAS_NEXT": next_weight is not None}
    plan = _split_plan(m, n, x.shape[1], False, split_k, block_n, block_k)
    partials = _products(x, w, out, n, False, plan, block_n, block_k, num_warps, pdl=pdl, always_split=True)
    assert partials is not None
    _reduce_residual_norm_kernel[(m,)](partials, out_ptr=out, m=m, n_out=n, slices=plan.slices, BLOCK=block,
                                       num_warps=residual_norm_warps(block), **chain, **launch_options(pdl))
    return out, nxt


def skinny_linear_fp8(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, *, split_k: int | None = None, block_n: int = 64, block_k: int = 128,
                      num_warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """What ``torch._scaled_mm(xq, wq.T, scale_a=x_scale, scale_b=w_scale[None], out_dtype=out_dtype)`` computes,
    for few rows: xq float8_e4m3fn [M, K] with fp32 per-row scales ``x_scale`` [M, 1] (or [M]), wq float8_e4m3fn
    [N, K] with fp32 per-row scales ``w_scale`` [N] -> new [M, N] in ``out_dtype`` (fp32 accumulation, then the
    scales, then one rounding). ``pdl`` as :func:`skinny_linear`."""
    fp8 = torch.float8_e4m3fn
    if xq.dtype != fp8 or wq.dtype != fp8 or out_dtype not in _WIDEN:
        raise ValueError(f"need float8_e4m3fn operands and a float out_dtype; got {xq.dtype}, {wq.dtype}, {out_dtype}")
    m, n = xq.shape[0], wq.shape[0]
    x_scale, w_scale = x_scale.reshape(-1).contiguous(), w_scale.reshape(-1).contiguous()
    if x_scale.numel() != m or w_scale.numel() != n or x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(f"need fp32 scales [{m}] and [{n}]; got {tuple(x_scale.shape)} {x_scale.dtype} and "
                         f"{tuple(w_scale.shape)} {w_scale.dtype}")
    return _launch(xq, wq, n, False, split_k, block_n, block_k, num_warps, (x_scale, w_scale), out_dtype, pdl=pdl)


def skinny_fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, *,
                      quantized: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = False) -> torch.Tensor:
    """``quantization.linear(x, wq, w_scale)`` for few rows: x [M, K] in the model dtype quantized per row
    (``fp8_rows.quantize_rows``), then :func:`skinny_linear_fp8` -> new [M, N] in x's dtype. Two launches, both
    programmatic dependents with ``pdl``; one when ``quantized`` gives x's rows already quantized that way (the
    kernel that wrote x did it: ``fused_ops.with_fp8_rows``)."""
    if quantized is not None and tuple(quantized[0].shape) != tuple(x.shape):
        raise ValueError(f"quantized rows {tuple(quantized[0].shape)} are not x's {tuple(x.shape)}")
    xq, x_scale = quantized if quantized is not None else quantize_rows(x, pdl=pdl)
    return skinny_linear_fp8(xq, x_scale, wq, w_scale, x.dtype, pdl=pdl)


def skinny_geglu(x: torch.Tensor, gate_up: torch.Tensor, *, split_k: int | None = None, block_n: int = 64,
                 block_k: int = 128, num_warps: int = 4, pdl: bool = False) -> torch.Tensor:
    """``gelu_tanh(x @ gate.T) * (x @ up.T)`` for x [M, K] and gate_up [2 * W, K] (gate rows first, as
    ``fusion.fuse_projections`` lays them out) -> new [M, W] in x's dtype."""
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up needs an even number of rows (gate then up); got {gate_up.shape[0]}")
    return _launch(x, gate_up, gate_up.shape[0] // 2, True, split_k, block_n, block_k, num_warps, pdl=pdl)


@triton.jit
def _argmax_kernel(x_ptr, w_ptr, best_ptr, index_ptr, m, n, k, stride_xm, stride_wn, softcap,
                   HAS_CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Program (column tile, row tile): each row's largest rounded, soft-capped logit in the tile and its
    first index, written to best/index [m, tiles]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _dot_slab(x_ptr, w_ptr, offs_m, offs_n, m, n, 0, k, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                    PRECISION)
    dtype = x_ptr.dtype.element_ty
    logits = acc.to(dtype).to(tl.float32)  # eager's logits are in the model dtype
    if HAS_CAP:  # eager: tanh(logits / cap) * cap, each op rounded to the model dtype
        scaled = (logits / softcap).to(dtype).to(tl.float32)
        tanh = (1.0 - 2.0 / (tl.exp(2.0 * scaled) + 1.0)).to(dtype).to(tl.float32)
        logits = (tanh * softcap).to(dtype).to(tl.float32)
    logits = tl.where(offs_n[None, :] < n, logits, float("-inf"))
    best = tl.max(logits, axis=1)
    is_best = logits == best[:, None]
    first = tl.min(tl.where(is_best, offs_n[None, :], n), axis=1)
    tiles = tl.num_programs(0)
    row_mask = offs_m < m
    tl.store(best_ptr + offs_m * tiles + pid_n, best, mask=row_mask)
    tl.store(index_ptr + offs_m * tiles + pid_n, first, mask=row_mask)


def lm_head_argmax(x: torch.Tensor, w: torch.Tensor, softcap: float | None = None, *, block_n: int = 128,
                   block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """Greedy tokens (int64 [M]) of ``softcap(x @ w.T)`` for hidden x [M, K] and the LM head w [V, K], the
    logits never written out. Ties pick the lowest token id. ``softcap``: the model's final logit softcap."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"need x [M, K] and w [V, K] with contiguous last dims; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return torch.empty(0, device=x.device, dtype=torch.int64)
    block_m = _block_m(m)
    tiles = triton.cdiv(n, block_n)
    best = torch.empty(m, tiles, device=x.device, dtype=torch.float32)
    index = torch.empty(m, tiles, device=x.device, dtype=torch.int32)
    _argmax_kernel[(tiles, triton.cdiv(m, block_m))](
        x, w, best, index, m, n, k, x.stride(0), w.stride(0), 1.0 if softcap is None else float(softcap),
        HAS_CAP=softcap is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x),
        num_warps=num_warps)
    tile = best.argmax(dim=1, keepdim=True)  # the first tile holding the maximum: tiles ascend in token id
    return index.gather(1, tile).squeeze(1).to(torch.int64)
