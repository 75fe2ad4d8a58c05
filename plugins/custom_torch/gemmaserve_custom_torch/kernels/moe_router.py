"""The Gemma 4 MoE router and the experts' input norm in two launches instead of eleven eager ops.

:func:`route` computes, for x [T, H] (the pre-MLP residual), what ``MoERouter.forward`` and the layer's
``pre_feedforward_layernorm_2`` compute on CUDA:

1. ``_router_logits_kernel`` (grid: rows x blocks of ``BLOCK_E`` experts, so a decode step's router weights are
   read by many programs at once): each program reads its row, computes ``rms_norm(x) * scale * H**-0.5``
   rounding to the model dtype after each step as the eager ops do, and its experts' logits (fp32 sums,
   rounded to the model dtype like the eager matmul's output); the first expert block also stores the experts'
   input norm (``pre_feedforward_layernorm_2(x)``, the arithmetic of ``kernels.rms_norm``).
2. ``_router_top_k_kernel`` (one program per row): fp32 softmax over all experts, the top k (ties: lower expert
   id first), renormalised over the k, times ``per_expert_scale`` -> weights [T, k] fp32, ids [T, k] int64.

Not bitwise the eager ops (another summation order in the logits and the softmax); the chosen experts agree
unless two probabilities tie within that rounding. Runs under ``TRITON_INTERPRET=1`` on CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import _norm_factor, _weight
from .pdl import await_previous, launch_options

__all__ = ["ROUTE_MAX_ROWS", "route"]

ROUTE_MAX_ROWS = 64
"""Up to this many rows the router runs here (decode and small ticks); above it the layer keeps the eager ops.
Every row's programs re-read the router's weights (0.72 MB a layer at 26B-A4B), so that traffic grows with the
rows while cuBLAS reads them once: measured faster at 1-32 rows on an H100 (run 32), unmeasured above, hence 64."""


@triton.jit
def _router_logits_kernel(x_ptr, scale_ptr, w_ptr, norm_w_ptr, logits_ptr, normed_ptr, stride_x, n_cols,
                          num_experts, eps_router, eps_norm, hidden_scale, ONE_PLUS: tl.constexpr,
                          HAS_NORM_W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    expert_block = tl.program_id(1)
    dtype = normed_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x * x, axis=0)
    if expert_block == 0:
        normed = x * _norm_factor(sum_sq, n_cols, eps_norm)
        if HAS_NORM_W:
            normed = normed * _weight(norm_w_ptr, offs, mask, ONE_PLUS)
        tl.store(normed_ptr + row * n_cols + offs, normed.to(dtype), mask=mask)
    factor = _norm_factor(sum_sq, n_cols, eps_router)
    experts = expert_block * BLOCK_E + tl.arange(0, BLOCK_E)
    real = experts < num_experts
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = cols < n_cols
        z = (tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32) * factor).to(dtype)
        z = (z.to(tl.float32) * tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        z = (z.to(tl.float32) * hidden_scale).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * n_cols + cols[None, :], mask=real[:, None] & ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * z[None, :], axis=1)
    tl.store(logits_ptr + row * num_experts + experts, acc.to(dtype).to(tl.float32), mask=real)


@triton.jit
def _router_top_k_kernel(logits_ptr, expert_scale_ptr, weights_ptr, ids_ptr, num_experts, TOP_K: tl.constexpr,
                         EXPERTS: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS)
    real = experts < num_experts
    logits = tl.load(logits_ptr + row * num_experts + experts, mask=real, other=-float("inf"))
    e = tl.where(real, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probs = tl.where(real, e / tl.sum(e, axis=0), -1.0)  # probabilities are >= 0: -1 is never picked
    slots = tl.arange(0, SLOTS)
    values = tl.zeros((SLOTS,), dtype=tl.float32)
    ids = tl.zeros((SLOTS,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        # a NaN row matches nothing: keep its ids in range (its NaN weights carry on, as the eager ops' would)
        pick = tl.minimum(tl.min(tl.where(probs == best, experts, EXPERTS), axis=0), num_experts - 1)
        values = tl.where(slots == j, best, values)
        ids = tl.where(slots == j, pick, ids)
        probs = tl.where(experts == pick, -1.0, probs)
    used = slots < TOP_K
    total = tl.sum(tl.where(used, values, 0.0), axis=0)
    scale = tl.load(expert_scale_ptr + ids, mask=used, other=0.0).to(tl.float32)
    tl.store(weights_ptr + row * TOP_K + slots, values / total * scale, mask=used)
    tl.store(ids_ptr + row * TOP_K + slots, ids.to(tl.int64), mask=used)


def route(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, expert_scale: torch.Tensor, top_k: int,
          eps: float, norm_weight: torch.Tensor | None, norm_eps: float, norm_style: str, *,
          block_e: int = 4, block_k: int = 1024, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``MoERouter.forward(x)`` and ``RMSNorm(x)`` (the experts' input norm: ``norm_weight``, ``norm_eps``,
    ``norm_style``) for x [T, H] (last dim contiguous): ``scale`` [H] and ``expert_scale`` [E] the router's
    parameters, ``weight`` [E, H] its projection (model dtype, contiguous), ``eps`` its norm's. Returns new
    tensors (routing weights [T, k] fp32, expert ids [T, k] int64, normed [T, H] in x's dtype); mutates nothing.
    No host sync (CUDA-graph capturable). ``pdl``: both launches programmatic dependents (``kernels.pdl``).
    ``block_e`` experts and ``block_k`` columns per step of a logits program (powers of two): 4 and 1,024 took
    26B-A4B bf16 decode on an H100 to 4.98 / 10.57 ms TPOT at N = 1 / 8, against 5.59 / 11.19 with 16 and 64
    (few long steps beat many short ones: a decode step has few programs to hide load latency) and 5.39 / 11.69
    with the eager ops (docs/benchmarks.md, run 32)."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if tuple(weight.shape) != (num_experts, hidden) or not weight.is_contiguous():
        raise ValueError(f"router weight {tuple(weight.shape)} must be a contiguous [E, {hidden}]")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    normed = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return weights, ids, normed
    if x.stride(-1) != 1:
        x = x.contiguous()
    logits = torch.empty((tokens, num_experts), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(hidden)
    _router_logits_kernel[(tokens, triton.cdiv(num_experts, block_e))](
        x, scale, weight, norm_weight if norm_weight is not None else scale, logits, normed, x.stride(0), hidden,
        num_experts, float(eps), float(norm_eps), hidden**-0.5, ONE_PLUS=norm_style == "one_plus_w",
        HAS_NORM_W=norm_weight is not None, BLOCK=block, BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=8 if block >= 2048 else 4, **launch_options(pdl),
    )
    experts = triton.next_power_of_2(num_experts)
    _router_top_k_kernel[(tokens,)](
        logits, expert_scale, weights, ids, num_experts, TOP_K=top_k, EXPERTS=experts,
        SLOTS=max(2, triton.next_power_of_2(top_k)), num_warps=4 if experts >= 512 else 1, **launch_options(pdl),
    )
    return weights, ids, normed
