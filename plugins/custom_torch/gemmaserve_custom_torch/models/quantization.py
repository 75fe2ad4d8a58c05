"""FP8 weights (``QUANTIZATION=fp8``): float8_e4m3fn weights with per-output-channel fp32 scales, activations
quantized per token at run time, matmuls through ``torch._scaled_mm`` with row-wise scales.

One seam: :func:`linear` is the matmul every projection of the model runs (``Fp8Linear.forward``, the fused
q/k/v and gate/up weights of ``fusion.fuse_projections``, each expert of ``MoEExperts``); it takes a model-dtype
weight (plain ``F.linear``) or an FP8 weight with its scales.

- :func:`quantize_fp8` quantizes a loaded model in place (online quantization from a bf16/fp32 checkpoint): every
  decoder projection (q/k/v/o, gate/up/down, PLE gate/projection, ``per_layer_model_projection``) becomes an
  :class:`Fp8Linear`, and MoE experts keep their 3-D layout in FP8 with ``[E, rows]`` scales. Embeddings, the
  (tied) LM head, norms and the MoE router stay in the model dtype.
- :func:`read_checkpoint_scheme` reads a ``compressed-tensors`` ``quantization_config`` (pre-quantized FP8
  checkpoints, format ``float-quantized``: channel or tensor weight scales, dynamic per-token activations) and
  :func:`prepare_fp8` swaps the targeted projections of a meta-device model for empty :class:`Fp8Linear` so the
  checkpoint's ``weight`` / ``weight_scale`` tensors load into them as they are (no dequantization; a tensor-wise
  scale is broadcast to one per output channel).

Numerics: a weight row w is stored as ``q = fp8(w / s)`` with ``s = amax(|w|) / 448``; an activation row the same
way per token; ``_scaled_mm`` accumulates in fp32 and rounds once to the output dtype. On CUDA the activations are
quantized by one Triton kernel (``kernels.fp8_rows``: the same definition, divisions correctly rounded). Decode's
few-row products skip this seam: ``fusion.fuse_small_batch`` routes them to ``kernels.skinny_gemm.skinny_fp8_linear``
(same arithmetic, another summation order; ``layers.SmallBatchMatmuls``). Nothing here syncs
the host (CUDA-graph safe). On CUDA, FP8 matmuls need compute capability 8.9 or newer (:func:`check_fp8_device`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gemmaserve.errors import ConfigurationError

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "Fp8Linear", "Fp8Scheme", "check_fp8_device", "check_fp8_shapes", "dequantize", "is_fp8",
    "linear", "parse_scheme", "prepare_fp8", "quantize_fp8", "quantize_per_token", "quantize_weight",
    "read_checkpoint_scheme", "uses_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero
SUPPORTED_CHECKPOINTS = ("compressed-tensors, format float-quantized: 8-bit float weights with channel or tensor "
                         "scales (symmetric, static) and dynamic per-token (or no) input activations")


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel FP8: weight [..., out, in] (any float dtype) -> (float8_e4m3fn [..., out, in], fp32
    scales [..., out]) with ``weight ≈ q * scale[..., None]``; scale = amax over the row / 448. Input not mutated."""
    wf = weight.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``q`` [..., out, in] (FP8) with scales [..., out] stand for, in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-row FP8 of activations: x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]). Device ops
    only (no host sync)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def is_fp8(tensor: Tensor) -> bool:
    return tensor.dtype == FP8_DTYPE


def linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """The model's one projection matmul, x [..., in] -> [..., out] in x's dtype. ``scale`` None: ``F.linear`` with a
    model-dtype weight [out, in]. Else ``weight`` is float8_e4m3fn [out, in] with fp32 per-row scales ``scale``
    [out]: x is quantized per token and multiplied by ``torch._scaled_mm`` (fp32 accumulation, row-wise scales)."""
    if scale is None:
        return F.linear(x, weight)
    lead = x.shape[:-1]
    if x.numel() == 0:  # a shape test, no sync; cuBLAS FP8 kernels are not asked for empty products
        return x.new_empty(*lead, weight.shape[0])
    rows = x.reshape(-1, x.shape[-1])
    quantize_rows = _triton_quantize_rows() if x.is_cuda else None
    if quantize_rows is None:
        xq, x_scale = quantize_per_token(rows)
    else:  # one Triton kernel for the ~9 torch ones
        xq, x_scale = quantize_rows(rows.contiguous())
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return out.view(*lead, weight.shape[0])


@functools.cache
def _triton_quantize_rows() -> Any:
    """``kernels.fp8_rows.quantize_rows``, or None where triton does not import (the torch ops then)."""
    from ..kernels import HAS_TRITON

    if not HAS_TRITON:
        return None
    from ..kernels.fp8_rows import quantize_rows

    return quantize_rows


class Fp8Linear(nn.Module):
    """A bias-free linear layer with FP8 weights: ``weight`` float8_e4m3fn [out, in] (a parameter, frozen) and
    ``weight_scale`` fp32 [out] (a buffer); the names of compressed-tensors checkpoints. x [..., in] -> [..., out]
    in x's dtype (the model dtype)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, device=device, dtype=torch.float32))
        self.weight_scale: Tensor

    @classmethod
    def from_linear(cls, source: nn.Linear) -> Fp8Linear:
        """A new layer holding ``source``'s weight quantized per output channel (``source`` is not mutated)."""
        if source.bias is not None:
            raise ValueError("Fp8Linear has no bias; Gemma projections have none")
        layer = cls(source.in_features, source.out_features, device="meta")
        q, scale = quantize_weight(source.weight.detach())
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"


def _projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder projections FP8 applies to: every nn.Linear but the MoE router's (``router.proj``, kept in the
    model dtype: routing picks experts by small logit differences) and an untied ``lm_head``."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not name.endswith("router.proj") and name != "lm_head"]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> int:
    """Online FP8 (``QUANTIZATION=fp8``) of a loaded model, in place: each decoder projection becomes an
    :class:`Fp8Linear` (per-output-channel scales), each ``MoEExperts`` block gets FP8 ``gate_up_proj`` /
    ``down_proj`` with fp32 ``gate_up_proj_scale`` [E, 2I] / ``down_proj_scale`` [E, H]. Must run before
    ``fusion.fuse_projections`` (ValueError after it). Returns the number of weights quantized (0 if already
    quantized)."""
    from .layers import MoEExperts

    if any(getattr(m, "fused_qkv", None) is not None or getattr(m, "fused_gate_up", None) is not None
           for m in model.modules()):
        raise ValueError("quantize_fp8 after fusion.fuse_projections would leave the fused weights in the model "
                         "dtype; quantize first, then fuse")
    count = 0
    for name in [name for name, _ in _projections(model)]:  # names only: each replaced layer is freed at once
        _replace(model, name, Fp8Linear.from_linear(model.get_submodule(name)))
        count += 1
    for block in model.modules():
        if isinstance(block, MoEExperts) and block.gate_up_proj_scale is None:
            for attr in ("gate_up_proj", "down_proj"):
                weight = getattr(block, attr).detach()
                q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
                scale = torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device)
                for expert in range(weight.shape[0]):  # one expert's fp32 temporaries at a time
                    q[expert], scale[expert] = quantize_weight(weight[expert])
                setattr(block, attr, nn.Parameter(q, requires_grad=False))
                setattr(block, attr + "_scale", scale)
                count += 1
    return count


def uses_fp8(model: nn.Module) -> bool:
    """True when ``model`` holds FP8 weights (an :class:`Fp8Linear` or quantized experts)."""
    return any(p.dtype == FP8_DTYPE for p in model.parameters())


def check_fp8_device(device: torch.device | str, dtype: torch.dtype) -> None:
    """Raise ConfigurationError unless ``device`` runs FP8 matmuls with ``dtype`` outputs: the CPU (slow: tests), or
    a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); there ``torch._scaled_mm`` with
    row-wise scales writes fp32 on compute capability 9.0 only, so other GPUs need DTYPE bfloat16 or float16."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ConfigurationError(f"QUANTIZATION=fp8 runs on CUDA GPUs of compute capability >= 8.9 or on the CPU, "
                                 f"not on {device.type}; unset QUANTIZATION")
    major, minor = torch.cuda.get_device_capability(device)
    name = f"{torch.cuda.get_device_name(device)} ({device})"
    if (major, minor) < (8, 9):
        raise ConfigurationError(
            f"QUANTIZATION=fp8 (or an FP8 checkpoint) needs FP8 matmuls: compute capability >= 8.9 (Ada, Hopper, "
            f"Blackwell); {name} has {major}.{minor}. Unset QUANTIZATION and load a bf16 checkpoint")
    if dtype == torch.float32 and (major, minor) != (9, 0):
        raise ConfigurationError(f"QUANTIZATION=fp8 with DTYPE=float32 on {name} (compute capability {major}.{minor}): "
                                 "its row-wise FP8 matmuls write bfloat16 or float16 only; set DTYPE=bfloat16")


def check_fp8_shapes(model: nn.Module) -> None:
    """Raise ConfigurationError naming the FP8 projections whose in or out features are not multiples of 16, which
    ``torch._scaled_mm`` needs on CUDA (every Gemma checkpoint's are; tiny test shapes need not be, on the CPU)."""
    odd = [f"{name} [{m.out_features}, {m.in_features}]" for name, m in model.named_modules()
           if isinstance(m, Fp8Linear) and (m.in_features % 16 or m.out_features % 16)]
    if odd:
        raise ConfigurationError(f"FP8 matmuls on CUDA need dimensions that are multiples of 16; {', '.join(odd[:4])}"
                                 f"{' ...' if len(odd) > 4 else ''} are not (under tensor parallel: per rank). Unset "
                                 "QUANTIZATION or change TENSOR_PARALLEL_SIZE")


# ---- pre-quantized checkpoints (compressed-tensors) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """What a compressed-tensors FP8 checkpoint quantizes: modules matched by ``targets`` and by no ``ignore``
    entry (class names such as "Linear", exact or dotted-suffix module names, or ``re:`` regexes). Channel and
    tensor scales need no flag: the loader tells them apart by the ``weight_scale`` shape."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def quantizes(self, module_name: str, class_name: str = "Linear") -> bool:
        """True when the checkpoint's module ``module_name`` (its full checkpoint name) holds FP8 weights."""
        return (any(_matches(t, module_name, class_name) for t in self.targets)
                and not any(_matches(i, module_name, class_name) for i in self.ignore))


def _matches(pattern: str, name: str, class_name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in (class_name, name) or name.endswith("." + pattern)


def read_checkpoint_scheme(folder: str | Path) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint in ``folder`` (config.json ``quantization_config``, also under
    ``text_config``), or None when it has none. Raises ConfigurationError naming what is not supported (another
    quant_method or format, block or group scales, static input scales, non-8-bit-float weights)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    raw = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not raw:
        return None
    return parse_scheme(raw, str(folder))


def parse_scheme(raw: dict[str, Any], where: str = "the checkpoint") -> Fp8Scheme:
    """:func:`read_checkpoint_scheme` on a parsed ``quantization_config``."""
    def refuse(what: str) -> ConfigurationError:
        return ConfigurationError(f"{where}: quantization_config {what} is not supported; gemmaserve loads "
                                  f"{SUPPORTED_CHECKPOINTS} (e.g. llm-compressor's FP8_DYNAMIC), or a bf16 checkpoint "
                                  "with QUANTIZATION=fp8")

    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r}")
    groups = raw.get("config_groups") or {}
    if not groups:
        raise refuse("without config_groups")
    targets: list[str] = []
    for name, group in groups.items():
        for fmt in (raw.get("format"), group.get("format")):
            if fmt not in ("float-quantized", None):
                raise refuse(f"format {fmt!r} (group {name})")
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(f"weights {weights.get('num_bits')}-bit {weights.get('type')!r} (group {name})")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise refuse(f"weight strategy {strategy!r} (group {name}; channel and tensor are)")
        if weights.get("dynamic") or weights.get("symmetric") is False:
            raise refuse(f"dynamic or asymmetric weight scales (group {name})")
        inputs = group.get("input_activations")
        if inputs is not None:
            if not inputs.get("dynamic"):
                raise refuse(f"static input activations (input_scale tensors, group {name}; dynamic per-token "
                             "activations are)")
            if inputs.get("strategy") not in ("token", None) or inputs.get("type", "float") != "float" \
                    or inputs.get("num_bits", 8) != 8:
                raise refuse(f"input activations {inputs.get('strategy')!r} {inputs.get('num_bits')}-bit (group "
                             f"{name}; dynamic 8-bit float per token is)")
        if group.get("output_activations"):
            raise refuse(f"output activations (group {name})")
        targets += list(group.get("targets") or [])
    if raw.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (FP8 KV caches)")
    return Fp8Scheme(tuple(targets), tuple(raw.get("ignore") or ()))


def prepare_fp8(model: nn.Module, scheme: Fp8Scheme, checkpoint_prefix: str) -> list[str]:
    """Swap the projections ``scheme`` quantizes (full checkpoint name = ``checkpoint_prefix`` + model name) of a
    meta-device model for empty :class:`Fp8Linear`, in place; returns their model names. The checkpoint's
    ``<name>.weight`` (FP8) and ``<name>.weight_scale`` ([out, 1], [1] or []) then load into them."""
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head" and scheme.quantizes(checkpoint_prefix + name):
            _replace(model, name, Fp8Linear(module.in_features, module.out_features, device="meta"))
            swapped.append(name)
    return swapped
