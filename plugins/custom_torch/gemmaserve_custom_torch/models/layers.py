"""Gemma building blocks in plain torch: RMSNorm, rotary tables, GeGLU MLP and the Gemma 4 MoE block.

Every op order and dtype step mirrors transformers' eager Gemma code, so a model built from these is bitwise
identical to it (fp32 and bf16) on CPU. Do not "simplify" casts or fuse ops without re-running the parity
tests (tests/custom_torch/test_model_parity.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import NormStyle, RopeParams
from .quantization import Fp8Linear, linear

Device = torch.device | str | None
# Triton kernels run on CPU tensors in the interpreter (tests only; set before the process starts)
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(tensor: Tensor) -> bool:
    """Whether the Triton kernels a module holds take ``tensor``: CUDA tensors, and CPU ones under
    ``TRITON_INTERPRET=1`` (the tests)."""
    return tensor.is_cuda or (_TRITON_INTERPRET and tensor.device.type == "cpu")


def gelu_tanh(x: Tensor) -> Tensor:
    """The `gelu_pytorch_tanh` activation."""
    return F.gelu(x, approximate="tanh")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 and rounded once to the input dtype.

    style "w" (Gemma 4): x * pow(mean(x²)+eps, -0.5) * w.   style "one_plus_w" (Gemma 3): x * rsqrt(...) * (1+w).
    `with_weight=False` (Gemma 4 v_norm / router norm) skips the weight. Input is not mutated.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        style: NormStyle = "w",
        with_weight: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.style = style
        self.weight: nn.Parameter | None = (
            nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if with_weight else None
        )
        # A fused kernel with this module's contract (``kernels.rms_norm.rms_norm``), used for CUDA inputs
        # when set (``fusion.fuse_norms``); None = the eager op sequence (bitwise transformers).
        self.kernel: Callable[[Tensor, Tensor | None, float, str], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and x.is_cuda:
            return self.kernel(x, self.weight, self.eps, self.style)
        xf = x.float()
        mean_sq = xf.pow(2).mean(-1, keepdim=True) + self.eps
        if self.style == "one_plus_w":
            y = xf * torch.rsqrt(mean_sq)
            if self.weight is not None:
                y = y * (1.0 + self.weight.float())
        else:
            y = xf * torch.pow(mean_sq, -0.5)
            if self.weight is not None:
                y = y * self.weight.float()
        return y.type_as(x)


def compute_inv_freq(rope: RopeParams, head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim // 2], fp32, always computed on the CPU (GPU pow differs by 1 ulp)."""
    if rope.rope_type == "proportional":
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv = 1.0 / (rope.theta**exponents)
        inv = torch.cat([inv, torch.zeros(head_dim // 2 - rotated, dtype=torch.float32, device="cpu")])
        return inv / rope.factor
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    return inv


class RotaryEmbedding:
    """cos/sin tables for one layer type. Not an nn.Module on purpose: the fp32 inverse frequencies must not
    follow `model.to(dtype)` (casting them to bf16 changes logits); they follow the positions' device instead,
    one cached copy per device. ``kernel`` (``kernels.fused_ops.rope_tables``, set by ``fusion.fuse_elementwise``)
    computes the tables of CUDA positions in one launch (and of CPU ones under ``TRITON_INTERPRET=1``: the tests)."""

    def __init__(self, rope: RopeParams, head_dim: int) -> None:
        self.rope = rope
        self.head_dim = head_dim
        self._inv_freq_cpu = compute_inv_freq(rope, head_dim)
        self._inv_freq_by_device: dict[torch.device, Tensor] = {self._inv_freq_cpu.device: self._inv_freq_cpu}
        self.kernel: Callable[[Tensor, Tensor, torch.dtype], tuple[Tensor, Tensor]] | None = None

    def inv_freq(self, device: torch.device) -> Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, S] (any int dtype) -> (cos, sin), each [B, S, head_dim] in `dtype` (angles in fp32)."""
        if self.kernel is not None and triton_runs_on(positions):
            return self.kernel(positions, self.inv_freq(positions.device), dtype)
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, D]; cos/sin [B, S, D] in x's dtype. Half-split ("neox") pairing (i, i + D/2). Returns new."""
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return (x * cos) + (rotate_half(x) * sin)


def _linear(in_features: int, out_features: int, device: Device, dtype: torch.dtype | None) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)


@dataclass(frozen=True)
class FusedElementwise:
    """The fused elementwise kernels a model runs on CUDA (``kernels.fused_ops``, set by
    ``fusion.fuse_elementwise``); plain callables so the model package never imports triton."""

    norm_rope: Callable[..., Tensor]
    qkv_norm_rope: Callable[..., tuple[Tensor, Tensor, Tensor]]
    residual_norm: Callable[..., tuple[Tensor, Tensor | None]]
    gelu_mul: Callable[[Tensor, Tensor], Tensor]
    moe_residual_norm: Callable[..., tuple[Tensor, Tensor | None]]
    route: Callable[..., tuple[Tensor, Tensor, Tensor]]
    """``kernels.moe_router.route``: the MoE router and the experts' input norm, for at most ``route_max_rows``
    rows."""
    route_max_rows: int


@dataclass(frozen=True)
class SmallBatchMatmuls:
    """Few-row matmul kernels (``kernels.skinny_gemm``, set by ``fusion.fuse_small_batch``) that replace cuBLAS
    and ``torch._scaled_mm`` for products of at most ``max_rows`` rows (decode at small batch); larger products
    keep ``quantization.linear``. Plain callables so the model package never imports triton.
    ``linear(x [M, K], w [N, K])`` -> [M, N]; ``geglu(x [M, K], gate_up [2W, K])`` -> gelu_tanh(gate) * up [M, W];
    ``gelu_mul(x, w, mul [M, N])`` -> gelu_tanh(x @ w.T) * mul; ``residual_norm(x, w, residual [M, N], weight, eps,
    style, scale=, next_weight=, next_eps=)`` -> ``kernels.fused_ops.residual_norm`` of ``x @ w.T`` (y, next);
    ``fp8_linear(x [M, K], wq [N, K] FP8, w_scale [N], quantized=)`` -> ``quantization.linear(x, wq, w_scale)``
    [M, N] (``quantized``: x's rows already quantized, or None). All but ``fp8_linear`` take model-dtype weights.
    ``fp8_rows_ahead``: the model's FP8 projections read activations through here, so the residual kernels that
    write a norm's output for them also quantize it (``fused_ops.with_fp8_rows``)."""

    max_rows: int
    linear: Callable[[Tensor, Tensor], Tensor]
    geglu: Callable[[Tensor, Tensor], Tensor]
    gelu_mul: Callable[[Tensor, Tensor, Tensor], Tensor]
    residual_norm: Callable[..., tuple[Tensor, Tensor | None]]
    fp8_linear: Callable[..., Tensor]
    fp8_rows_ahead: bool = False

    def takes(self, x: Tensor) -> bool:
        """Whether a product with input ``x`` [..., K] runs here (its row count only: graph-capture safe)."""
        return x.numel() > 0 and x.numel() // x.shape[-1] <= self.max_rows

    def takes_linear(self, module: nn.Module, x: Tensor) -> bool:
        """Whether ``module(x)`` runs here: a plain model-dtype ``nn.Linear`` without bias, and :meth:`takes` x."""
        return type(module) is nn.Linear and module.bias is None and self.takes(x)

    def project(self, x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        """``quantization.linear(x, weight, scale)`` for x [..., K] through the few-row kernels (``scale`` None: a
        model-dtype weight; else an FP8 weight with its row scales)."""
        rows = x.reshape(-1, x.shape[-1])
        if scale is None:
            out = self.linear(rows, weight)
        else:  # the kernel that wrote x may have quantized its rows too (a view of x does not carry them)
            out = self.fp8_linear(rows, weight, scale, quantized=getattr(x, "fp8_rows", None))
        return out.view(*x.shape[:-1], weight.shape[0])


def small_batch_project(x: Tensor, weight: Tensor, scale: Tensor | None, small: SmallBatchMatmuls | None) -> Tensor:
    """``quantization.linear(x, weight, scale)``, through ``small`` when it takes ``x``."""
    if small is not None and small.takes(x):
        return small.project(x, weight, scale)
    return linear(x, weight, scale)


def small_batch_linear(module: nn.Module, x: Tensor, small: SmallBatchMatmuls | None) -> Tensor:
    """``module(x)`` for a projection module; through ``small`` when it takes ``x`` and the module is a plain
    model-dtype ``nn.Linear`` without bias or an ``Fp8Linear`` (other layers run their own forward)."""
    if small is not None:
        if small.takes_linear(module, x):
            return small.project(x, module.weight)
        if type(module) is Fp8Linear and small.takes(x):
            return small.project(x, module.weight, module.weight_scale)
    return module(x)


class GeGLUMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); x [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, width: int, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, width, device, dtype)
        self.up_proj = _linear(hidden, width, device, dtype)
        self.down_proj = _linear(width, hidden, device, dtype)
        self.fused_gate_up: Tensor | None = None  # [gate; up] rows, set by `fusion.fuse_projections`
        self.fused_gate_up_scale: Tensor | None = None  # their FP8 scales (FP8 weights only)
        self.gelu_mul: Callable[[Tensor, Tensor], Tensor] | None = None  # set by `fusion.fuse_elementwise`
        self.small_batch: SmallBatchMatmuls | None = None  # set by `fusion.fuse_small_batch`

    def forward(self, x: Tensor) -> Tensor:
        return small_batch_linear(self.down_proj, self.activation(x), self.small_batch)

    def activation(self, x: Tensor) -> Tensor:
        """``gelu_tanh(gate(x)) * up(x)`` [..., width]: what ``down_proj`` reads (one kernel for the few-row path)."""
        small = self.small_batch
        if small is not None and self.fused_gate_up is not None and self.fused_gate_up_scale is None and small.takes(x):
            return small.geglu(x.reshape(-1, x.shape[-1]), self.fused_gate_up).view(*x.shape[:-1], -1)
        if self.fused_gate_up is not None:
            gate, up = small_batch_project(x, self.fused_gate_up, self.fused_gate_up_scale, small).chunk(2, dim=-1)
            return self.gelu_mul(gate, up) if self.gelu_mul is not None else gelu_tanh(gate) * up
        return gelu_tanh(self.gate_proj(x)) * self.up_proj(x)


class MoERouter(nn.Module):
    """Gemma 4 router: softmax over all experts in fp32, top-k, renormalise, then × per_expert_scale.

    x [T, hidden] (the pre-MLP residual) -> (weights [T, k] fp32, expert ids [T, k] int64).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        eps: float,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_scale = hidden**-0.5  # a Python float on purpose (not rounded to the model dtype)
        self.norm = RMSNorm(hidden, eps, style="w", with_weight=False)
        self.proj = _linear(hidden, num_experts, device, dtype)
        self.scale = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.norm(x) * self.scale * self.hidden_scale
        probs = F.softmax(self.proj(z), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class MoEExperts(nn.Module):
    """Expert weights as 3-D tensors: gate_up_proj [E, 2·I, H] (gate rows first), down_proj [E, H, I].

    forward(x [T, H], weights [T, k] fp32, ids [T, k]) -> [T, H] in x's dtype. Accumulates expert by expert
    (ascending id) with a model-dtype `index_add_`, the order transformers' "eager" experts use. That loop
    syncs the host (`.tolist()` over the hit experts); `fused` (``kernels.moe.fused_experts``, set by
    ``fusion.fuse_moe``) replaces it on CUDA inputs, and on CPU under ``TRITON_INTERPRET=1`` (tests).

    After ``quantization.quantize_fp8`` both weights are float8_e4m3fn with fp32 per-output-channel scales
    ``gate_up_proj_scale`` [E, 2I] and ``down_proj_scale`` [E, H] (None otherwise); the eager loop then runs each
    expert through the FP8 matmul (``quantization.linear``) and the fused kernel reads the FP8 weights with
    their scales (the same arithmetic up to summation order).

    Expert parallel (``distributed.shards``): the block holds ``num_experts`` whole experts, the global experts
    ``[first_expert, first_expert + num_experts)`` of ``total_experts``; ``ids`` stay global (the router is
    replicated) and only the pairs routed to the held experts are computed, the rest add zero, so the ranks'
    outputs sum to the full block's.
    """

    def __init__(
        self, hidden: int, num_experts: int, width: int, device: Device = None, dtype: torch.dtype | None = None,
        *, first_expert: int = 0, total_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.total_experts = num_experts if total_experts is None else total_experts
        if not 0 <= first_expert <= self.total_experts - num_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + num_experts}) are not within the "
                             f"{self.total_experts} experts")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width, device=device, dtype=dtype))
        self.register_buffer("gate_up_proj_scale", None)
        self.register_buffer("down_proj_scale", None)
        self.gate_up_proj_scale: Tensor | None
        self.down_proj_scale: Tensor | None
        # fused(x, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale) -> [T, H]: the same contract
        # with no host sync; None = the eager loop below (bitwise transformers' eager experts).
        self.fused: Callable[..., Tensor] | None = None

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        if self.fused is not None and triton_runs_on(x):
            # local ids; the kernel skips pairs whose local id falls outside [0, num_experts)
            local = ids - self.first_expert if self.first_expert else ids
            return self.fused(x, weights, local, self.gate_up_proj, self.down_proj, self.gate_up_proj_scale,
                              self.down_proj_scale)
        out = torch.zeros_like(x)
        # hits[e, j, t]: token t picked held expert e (local index) in its j-th top-k slot
        hits = F.one_hot(ids, num_classes=self.total_experts).permute(2, 1, 0)
        hits = hits[self.first_expert : self.first_expert + self.num_experts]
        for expert in torch.nonzero(hits.sum(dim=(1, 2)) > 0).flatten().tolist():
            slot, token = torch.where(hits[expert])
            gate, up = linear(x[token], self.gate_up_proj[expert], _row(self.gate_up_proj_scale, expert)).chunk(2, -1)
            y = linear(gelu_tanh(gate) * up, self.down_proj[expert], _row(self.down_proj_scale, expert))
            y = y * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _row(scales: Tensor | None, expert: int) -> Tensor | None:
    """One expert's FP8 scales (None for model-dtype experts)."""
    return None if scales is None else scales[expert]
