"""Dynamic per-token FP8 quantization of activations in one Triton kernel (``QUANTIZATION=fp8`` on CUDA).

:func:`quantize_rows` computes what ``models.quantization.quantize_per_token`` computes with ~9 torch kernels:
per row ``scale = max(amax(|x|) / 448, 1e-12)`` (fp32) and ``q = fp8_e4m3fn(clamp(x / scale, -448, 448))``, both
divisions correctly rounded and the FP8 rounding round-to-nearest-even: the torch path's bytes on the CPU (tested);
on CUDA torch divides by the scalar 448 as a multiplication by fl(1/448), so its scales can differ in the last bit.
``quantization.linear`` (FP8 projections on CUDA) and the fused MoE kernels (their input rows) both call it. The
rounding to the e4m3 grid is done in fp32 bit arithmetic before the cast (the cast then only narrows an exact
value): Triton's CPU interpreter rounds some fp32 -> fp8 casts wrongly at exponent boundaries. One program per
row, which reads a row of up to ONE_PASS_MAX values once (a decode step's row quantizations are latency-bound: run
31 measured ~7 µs per launch for two passes over 1,024-value pieces, 1.77 ms of 31B FP8's step at one row); nothing
syncs the host (CUDA-graph capturable).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pdl import await_previous, launch_options

__all__ = ["native_fp8_dot", "quantize_rows"]

_MIN_SCALE = 1e-12  # an all-zero row's scale, as quantize_per_token


@functools.cache
def native_fp8_dot(device: torch.device) -> bool:
    """True where ``tl.dot`` takes FP8 operands itself (CUDA, compute capability 8.9+: e4m3 tensor-core dots, or at
    small row blocks a hardware e4m3 -> f16 conversion before the dot); elsewhere (the CPU interpreter) kernels
    widen the FP8 values to the model dtype first: the same products, exact either way."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to nearest-even on the float8_e4m3fn grid, as fp32: 3 mantissa bits for
    normals (|v| >= 2^-6), steps of 2^-9 below (the subnormals); the sign of zero kept."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    small = (v + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14: its fp32 spacing is 2^-9
    small = tl.where(small == 0.0, v * 0.0, small)
    return tl.where(tl.abs(v) < 0.015625, small, normal)


@triton.jit
def fp8_scale(amax):
    """The dynamic FP8 scale of rows whose largest magnitude is fp32 ``amax``: max(amax / 448, 1e-12), the division
    correctly rounded (Triton's fp32 "/" may round approximately on the GPU)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)


@triton.jit
def fp8_grid(v, scale):
    """The FP8 value of fp32 ``v`` under ``scale`` (broadcast): ``v / scale`` correctly rounded, clamped to +-448 and
    rounded to the e4m3 grid, as fp32 (exact in any float dtype, so callers cast it to fp8 or widen it)."""
    return round_to_e4m3(tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, k, stride_xm, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    """One row. ONE_PASS (BLOCK >= k): the row is loaded once and kept in registers (one load latency per launch);
    else two passes over BLOCK-wide pieces (the amax, then the values)."""
    await_previous(PDL)  # reads only the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < k
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * k + offs, fp8_grid(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, k, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, k, BLOCK):
            mask = k0 + offs < k
            x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * k + k0 + offs, fp8_grid(x, scale).to(q_ptr.dtype.element_ty), mask=mask)


#: Rows up to this many values are quantized in one pass (held in registers: up to 64 fp32 values per thread at 16
#: warps); longer rows in two passes over 1,024-value pieces.
ONE_PASS_MAX = 32768


def _one_pass_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def quantize_rows(x: torch.Tensor, block: int | None = None, *, pdl: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, contiguous last dim) -> (float8_e4m3fn [M, K] contiguous, fp32 scales [M, 1]);
    new tensors, x not mutated. One program per row: rows of at most ONE_PASS_MAX values are read once (``block``
    None), else (or with an explicit ``block``) in two passes over ``block``-wide pieces (default 1,024); the same
    bytes either way. ``pdl``: launch as a programmatic dependent of the previous kernel (``kernels.pdl``;
    Hopper)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"need x [M, K] with a contiguous last dim; got {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m and k:
        whole = triton.next_power_of_2(k)
        one_pass = block is None and whole <= ONE_PASS_MAX
        width = whole if one_pass else min(block or 1024, whole)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=width, ONE_PASS=one_pass,
                                    num_warps=_one_pass_warps(width) if one_pass else 4, **launch_options(pdl))
    elif m:
        scale.fill_(_MIN_SCALE)
    return q, scale
