"""Load-time fusion on CUDA: fewer, longer matmuls, one kernel per RMSNorm (`fuse_norms`) and per
elementwise chain of a layer (`fuse_elementwise`), fused MoE experts (`fuse_moe`), and optionally few-row Triton
matmuls and programmatic dependent launches for decode at small batch (`fuse_small_batch`).

`fuse_projections(model)` concatenates, per layer, the q/k/v weights of KV-storing layers (q/k on K=V layers)
into one ``[q_width + k_width (+ v_width), hidden]`` weight and the MLP's gate/up weights into one
``[2 * width, hidden]`` weight. The original parameters are re-pointed at row slices of the fused tensors,
so no memory is duplicated and ``state_dict`` keeps its names and values. Each output element is still a
dot product of the same row and input, but cuBLAS may pick another kernel for the wider matmul, so results
can differ in the last bit: greedy tokens are what the GPU tests compare. Mutates ``model`` (every backend
sharing it then runs fused); idempotent. FP8 projections (``quantization.Fp8Linear``) fuse too: their per-row
scales are concatenated the same way (run ``quantize_fp8`` first).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .gemma import GemmaForCausalLM
from .layers import FusedElementwise
from .quantization import Fp8Linear

__all__ = [
    "fuse_elementwise", "fuse_moe", "fuse_norms", "fuse_projections", "fuse_small_batch", "is_fused", "moe_is_fused",
]


def _fuse(linears: list[nn.Module]) -> tuple[Tensor, Tensor | None]:
    """One weight holding ``linears``' weight rows in order (and, for FP8 layers, one fp32 scale vector holding
    their ``weight_scale`` entries); each layer's weight (and scale) becomes a view of it. All of ``linears`` are
    nn.Linear or all are ``Fp8Linear``."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    fp8 = [isinstance(lin, Fp8Linear) for lin in linears]
    if any(fp8) and not all(fp8):
        raise ValueError("cannot fuse FP8 and model-dtype projections into one matmul")
    scale = torch.cat([lin.weight_scale for lin in linears]) if all(fp8) else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        if scale is not None:
            lin.weight_scale = scale[start : start + rows]
        start += rows
    return fused, scale


@torch.no_grad()
def fuse_projections(model: GemmaForCausalLM) -> int:
    """Fuse q/k/v and gate/up projections of every layer (see the module docstring); returns the number of
    fused weights made by this call (0 if already fused)."""
    made = 0
    for layer in model.layers:
        attn = layer.self_attn
        if attn.fused_qkv is None and attn.k_proj is not None:
            parts = [attn.q_proj, attn.k_proj] + ([attn.v_proj] if attn.v_proj is not None else [])
            attn.fused_widths = tuple(lin.weight.shape[0] for lin in parts)
            attn.fused_qkv, attn.fused_qkv_scale = _fuse(parts)
            made += 1
        mlp = layer.mlp
        if mlp.fused_gate_up is None:
            mlp.fused_gate_up, mlp.fused_gate_up_scale = _fuse([mlp.gate_proj, mlp.up_proj])
            made += 1
    return made


def is_fused(model: GemmaForCausalLM) -> bool:
    """True once `fuse_projections` ran on ``model``."""
    return all(layer.mlp.fused_gate_up is not None for layer in model.layers)


def fuse_norms(model: torch.nn.Module) -> int:
    """Run every RMSNorm of ``model`` through the Triton kernel (``kernels.rms_norm``) on CUDA inputs; returns
    how many norms were switched. Mutates ``model``; idempotent. Needs triton (the caller checks)."""
    from ..kernels.rms_norm import rms_norm
    from .layers import RMSNorm

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernel = rms_norm
    return len(norms)


def fuse_elementwise(model: GemmaForCausalLM) -> int:
    """Run the elementwise chains of every layer through ``kernels.fused_ops`` (the rotary tables, the PLE inputs'
    chain, q/k norm + RoPE and the v norm of a KV-storing layer in one launch, post-norm + residual (+ next
    pre-norm, + layer_scalar), GeGLU and PLE gates); on MoE layers the router with the experts' input norm
    (decode-sized batches), and the two feed-forward norms' sum with the post-norm + residual (its experts are
    ``fuse_moe``'s). Returns how many layers were switched. Mutates
    ``model``; idempotent. Needs triton (the caller checks); the kernels run on the model's device (CUDA, or
    CPU under ``TRITON_INTERPRET=1`` in tests)."""
    from ..kernels import fused_ops

    ops = _fused_elementwise(pdl=False)
    for rope in model.rotary.values():
        rope.kernel = fused_ops.rope_tables
    model.ple_inputs_kernel = fused_ops.ple_inputs
    for layer in model.layers:
        layer.fused_ops = ops
        layer.self_attn.fused_ops = ops
        layer.mlp.gelu_mul = ops.gelu_mul
    return len(model.layers)


def _fused_elementwise(*, pdl: bool) -> FusedElementwise:
    """The fused elementwise kernels of a layer, each launched as a programmatic dependent with ``pdl``."""
    from functools import partial

    from ..kernels import fused_ops, moe_router

    kernels = (fused_ops.norm_rope, fused_ops.qkv_norm_rope, fused_ops.residual_norm, fused_ops.gelu_mul,
               fused_ops.moe_residual_norm, moe_router.route)
    return FusedElementwise(*(partial(kernel, pdl=True) if pdl else kernel for kernel in kernels),
                            route_max_rows=moe_router.ROUTE_MAX_ROWS)


def fuse_moe(model: torch.nn.Module) -> int:
    """Run every MoE expert block of ``model`` through ``kernels.moe.fused_experts`` (grouped GEMMs, no host
    sync, so MoE layers can be captured in CUDA graphs) on CUDA inputs; returns how many blocks were switched.
    Mutates ``model``; idempotent. Needs triton (the caller checks). FP8 experts (``quantize_fp8``) run through
    the kernel's FP8 variant."""
    from ..kernels.moe import fused_experts
    from .layers import MoEExperts

    blocks = [m for m in model.modules() if isinstance(m, MoEExperts)]
    for block in blocks:
        block.fused = fused_experts
    return len(blocks)


def moe_is_fused(model: torch.nn.Module) -> bool:
    """True when ``model`` has no MoE expert block on the host-syncing eager loop (none at all, or all
    switched by ``fuse_moe``): its forward can then be captured in a CUDA graph."""
    from .layers import MoEExperts

    return all(m.fused is not None for m in model.modules() if isinstance(m, MoEExperts))


def fuse_small_batch(model: GemmaForCausalLM, max_rows: int, *, pdl: bool = False) -> int:
    """Run the model-dtype projections of at most ``max_rows`` rows (decode at small batch) through the few-row
    Triton kernels (``kernels.skinny_gemm``: q/k/v, o, gate/up with its GeGLU in one kernel, down, and the PLE
    projections) instead of cuBLAS, and FP8 projections through ``skinny_fp8_linear`` instead of
    ``torch._scaled_mm``, with the fused layers' folds (model-dtype weights): the residual chain after o, down and
    the PLE projection runs in their split-K reduce, the PLE gate in its projection's epilogue (tensor parallel and
    MoE blocks keep the separate kernels); larger products keep ``quantization.linear``. With ``pdl`` (Hopper)
    those kernels, the norms, the elementwise kernels and the fused MoE experts (``fuse_moe``) launch as
    programmatic dependents (``kernels.pdl``): each kernel's weight reads start while the previous kernel finishes
    (the expert kernels wait before they read anything). Run after ``fuse_projections``, ``fuse_norms`` /
    ``fuse_elementwise`` and ``fuse_moe``. ``max_rows`` 0 switches the few-row path off (the PDL launches stay as
    set). Returns how many layers were switched. Mutates ``model``; idempotent."""
    from functools import partial

    from ..kernels import fused_ops
    from ..kernels.moe import fused_experts
    from ..kernels.rms_norm import rms_norm
    from ..kernels.skinny_gemm import (
        skinny_fp8_linear,
        skinny_geglu,
        skinny_linear,
        skinny_linear_gelu_mul,
        skinny_linear_residual_norm,
    )
    from .layers import MoEExperts, RMSNorm, SmallBatchMatmuls
    from .quantization import uses_fp8

    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    small = (SmallBatchMatmuls(max_rows, *(partial(kernel, pdl=pdl) for kernel in (
        skinny_linear, skinny_geglu, skinny_linear_gelu_mul, skinny_linear_residual_norm, skinny_fp8_linear)),
        fp8_rows_ahead=uses_fp8(model)) if max_rows else None)
    if pdl:
        ops = _fused_elementwise(pdl=True)
        for norm in (m for m in model.modules() if isinstance(m, RMSNorm) and m.kernel is not None):
            norm.kernel = partial(rms_norm, pdl=True)
        for rope in (rope for rope in model.rotary.values() if rope.kernel is not None):
            rope.kernel = partial(fused_ops.rope_tables, pdl=True)
        if model.ple_inputs_kernel is not None:
            model.ple_inputs_kernel = partial(fused_ops.ple_inputs, pdl=True)
        for block in (m for m in model.modules() if isinstance(m, MoEExperts) and m.fused is not None):
            block.fused = partial(fused_experts, pdl=True)  # the expert kernels (fuse_moe) join the chain
    for layer in model.layers:
        layer.small_batch = layer.self_attn.small_batch = layer.mlp.small_batch = small
        if pdl and layer.fused_ops is not None:
            layer.fused_ops = layer.self_attn.fused_ops = ops
            layer.mlp.gelu_mul = ops.gelu_mul
    return len(model.layers)
