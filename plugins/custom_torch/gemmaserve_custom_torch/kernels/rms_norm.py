"""Triton RMSNorm: one kernel per call instead of eager torch's ~9 (upcast, square, mean, add, pow, two
multiplies, weight upcast, downcast). Decode is launch-bound, and norms were ~2/3 of its kernels.

Contract (``models.layers.RMSNorm`` on CUDA): ``y = x * rsqrt(mean(x^2) + eps) * g`` in fp32, rounded once to
x's dtype, with ``g = w`` (style "w"), ``1 + w`` ("one_plus_w") or 1 (no weight). Not bitwise equal to the
eager op sequence (another summation order and rsqrt vs pow): the CPU path keeps the eager module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import await_previous, launch_options

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, inner, stride_xm, stride_xk, n_cols, eps,
                     HAS_WEIGHT: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0)
    m = (row // inner).to(tl.int64)
    k = (row % inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + m * stride_xm + k * stride_xk + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = (tl.sum(x * x, axis=0) / n_cols + eps).to(tl.float32)  # fp32 even if eps arrives as fp64
    y = x * (1.0 / tl.sqrt(mean_sq))
    if HAS_WEIGHT:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ONE_PLUS:
            y = y * (1.0 + w)
        else:
            y = y * w
    tl.store(out_ptr + row.to(tl.int64) * n_cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str, *,
             pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape; the last dim must be contiguous, the dim before
    it may have any stride, e.g. heads sliced out of a fused projection). Returns a new contiguous tensor of
    x's shape and dtype. No host sync (CUDA-graph capturable). ``pdl``: launched as a programmatic dependent
    (``kernels.pdl``; Hopper)."""
    n_cols, shape = x.shape[-1], x.shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    if x.dim() == 1:
        x = x[None]
    view = x.reshape(-1, x.shape[-2], n_cols)  # a view whenever the leading dims merge
    if view.stride(-1) != 1:
        view = view.contiguous()
    rows = view.shape[0] * view.shape[1]
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows,)](
        view, weight if weight is not None else view, out, view.shape[1], view.stride(0), view.stride(1),
        n_cols, float(eps), HAS_WEIGHT=weight is not None, ONE_PLUS=style == "one_plus_w", BLOCK=block,
        num_warps=4 if block >= 1024 else (2 if block >= 256 else 1), **launch_options(pdl),
    )
    return out
