"""``QUANTIZATION=int8`` (CPU): every ``nn.Linear`` of a model as int8 weights times int8 activations on fbgemm.

Weights are quantized once at load, symmetric per output channel (``scale = max|w_row| / 127``); activations per
token at run time; the int32 products are exact and ``torch.ops.quantized.linear_dynamic`` dequantizes them.
A decode step then reads a quarter of the float32 bytes (the Gemma 3 270M head alone: 671 -> 168 MB), which is
what bounds CPU decode.

**Batch invariance.** fbgemm quantizes its whole input with ONE (scale, zero point) taken from the tensor's
min and max, so rows would change each other's rounding. :class:`Int8Linear` divides each row by its own max
``|x|`` and appends two anchor rows ``(-1, 0, ...)``, ``(+1, 0, ...)``: the tensor's range is then always exactly ``[-1, 1]``,
so a row's int8 values, its exact integer products and their per-element dequantization depend on that row
alone, and a row's output is bitwise the same whatever else is batched with it (property-tested).
``reduce_range`` (7-bit activations) keeps fbgemm's u8 x s8 pair sums from saturating. The float parts of the
model (attention, norms) still round differently batched and alone; int8 turns such a difference into a whole
step when it crosses a quantization boundary, so the model as a whole is not batch-invariant (docs/reliability.md).

Who owns what: :func:`quantize_linears` replaces the modules in place and returns how many it replaced; the
float weights of replaced modules are dropped unless another module (a tied embedding) still holds them.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

__all__ = ["Int8Linear", "int8_unavailable_reason", "quantize_linears"]

_TINY = torch.finfo(torch.float32).tiny


class Int8Linear(nn.Module):
    """The int8 twin of an ``nn.Linear`` (see the module docstring). Inputs of any float dtype and leading shape;
    computes in float32 and returns the input's dtype. Immutable after construction."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().to(torch.float32)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(_TINY).to(torch.float64)
        zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        with warnings.catch_warnings():  # torch marks its quantized tensor types deprecated; fbgemm still runs them
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        anchor = torch.zeros(2, self.in_features)
        anchor[0, 0], anchor[1, 0] = -1.0, 1.0
        self.register_buffer("_anchor", anchor, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        row_max = rows.abs().amax(dim=1, keepdim=True).clamp_min(_TINY)
        normalized = torch.cat([rows / row_max, self._anchor])
        out = torch.ops.quantized.linear_dynamic(normalized, self._packed, True)[:-2] * row_max
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 x int8 (fbgemm)"


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` (exactly that type) under ``model`` by an :class:`Int8Linear`, in place;
    returns how many were replaced. Raises ValueError if there is none."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to quantize")
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child))
    return len(targets)


def int8_unavailable_reason(device: str) -> str | None:
    """Why ``QUANTIZATION=int8`` cannot run on ``device`` here, or None (one tiny quantized matmul is tried)."""
    if torch.device(device).type != "cpu":
        return (f"QUANTIZATION=int8 runs on the CPU only (fbgemm); on {device} use QUANTIZATION=fp8 with "
                "custom-cuda, or unset QUANTIZATION")
    try:
        Int8Linear(nn.Linear(4, 2, bias=False))(torch.ones(1, 4))
    except Exception as exc:  # no fbgemm / x86 quantized engine in this torch build
        return (f"QUANTIZATION=int8 needs torch's fbgemm int8 kernels, which fail here ({type(exc).__name__}: "
                f"{exc}; quantized engines: {', '.join(torch.backends.quantized.supported_engines)})")
    return None
