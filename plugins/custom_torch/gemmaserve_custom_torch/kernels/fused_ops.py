"""Triton kernels that fuse the decoder layer's elementwise chains (CUDA fast path, ``CUSTOM_BACKEND_FUSE``).

Decode at small batch is launch-bound: per layer, eager torch spends ~18 small kernels on rotary embeddings,
residual adds, GeGLU and the PLE gate. Each kernel here replaces one chain and keeps the eager chain's
rounding points (every intermediate the eager code holds in the model dtype is rounded to it here too), so
results differ from eager only where fp32 math inside one step differs (rsqrt vs pow, tanh formula):

- :func:`rope_tables`: the rotary cos/sin tables of a batch's positions;
- :func:`norm_rope`: ``apply_rotary(rms_norm(x), cos, sin)`` (q/k norm + RoPE, half-split pairing);
- :func:`qkv_norm_rope`: a KV-storing layer's q and k ``norm_rope`` and v norm in one launch, from the fused
  q/k/v projection;
- :func:`residual_norm`: ``y = (residual + rms_norm(h)) * scale`` and optionally ``next = rms_norm'(y)``
  (post-norm + residual add [+ layer_scalar] [+ the next pre-norm]);
- :func:`moe_residual_norm`: a MoE layer's ``rms_norm(dense) + rms_norm(moe)`` before that (four launches as one);
- :func:`gelu_mul`: ``gelu_tanh(a) * b`` (GeGLU over the fused gate/up output, and the PLE gate);
- :func:`ple_inputs`: Gemma 4's per-layer inputs after their projection (scale, norm, token part, scale).

All take tensors whose last dim is contiguous (leading dims may be strided views, e.g. slices of a fused
projection), return new contiguous tensors, never sync the host (CUDA-graph capturable) and run under
``TRITON_INTERPRET=1`` on CPU in fp32/fp16 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_rows import fp8_grid, fp8_scale
from .pdl import await_previous, launch_options

__all__ = ["gelu_mul", "moe_residual_norm", "norm_rope", "ple_inputs", "qkv_norm_rope", "residual_norm",
           "rope_tables"]

@triton.jit
def _norm_factor(sum_sq, n_cols, eps):
    return 1.0 / tl.sqrt((sum_sq / n_cols + eps).to(tl.float32))


@triton.jit
def _weight(w_ptr, offs, mask, ONE_PLUS: tl.constexpr):
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = 1.0 + w
    return w


@triton.jit
def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, half, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_ptr + offs, mask=mask, other=0.0)
    dtype = cos_ptr.dtype.element_ty
    cos = tl.cos(angle).to(dtype)  # libdevice's correctly range-reduced cos / sin, as torch's
    sin = tl.sin(angle).to(dtype)
    row = token * 2 * half
    tl.store(cos_ptr + row + offs, cos, mask=mask)
    tl.store(cos_ptr + row + half + offs, cos, mask=mask)
    tl.store(sin_ptr + row + offs, sin, mask=mask)
    tl.store(sin_ptr + row + half + offs, sin, mask=mask)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, *,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``models.layers.RotaryEmbedding``'s (cos, sin) in one launch instead of seven: positions [B, S] (any int
    dtype), fp32 inverse frequencies [D / 2] on the same device -> new [B, S, D] each in ``dtype``, angles
    ``float(position) * inv_freq`` in fp32 and the halves repeated (``cat((freqs, freqs))``)."""
    batch, seq = positions.shape
    half = inv_freq.shape[0]
    cos = torch.empty((batch, seq, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if positions.numel():
        flat = positions.reshape(-1)
        if flat.stride(0) != 1:
            flat = flat.contiguous()
        block = triton.next_power_of_2(half)
        _rope_tables_kernel[(flat.shape[0],)](flat, inv_freq, cos, sin, half, BLOCK=block,
                                              num_warps=_head_warps(block), **launch_options(pdl))
    return cos, sin


@triton.jit
def _norm_rope_rows(src, w_ptr, cos_ptr, sin_ptr, dst, token, row_ok, half, eps, HAS_WEIGHT: tl.constexpr,
                    ONE_PLUS: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr = True):
    """Rows of one head each (``src`` / ``dst`` [R] row pointers, ``token`` [R] their cos/sin rows, ``row_ok`` [R]):
    ``dst[:2 * half] = rope(rms_norm(src[:2 * half]))`` (``ROPE`` False: the norm alone; ``NORM`` False too: a
    copy), fp32 math with the eager chain's rounding points. The one copy of this math (:func:`_norm_rope_head`
    runs one row through it)."""
    offs = tl.arange(0, BLOCK)[None, :]
    col_ok = offs < half
    mask = row_ok[:, None] & col_ok
    x1 = tl.load(src[:, None] + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + half + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = x1
    y2 = x2
    if NORM:
        inv = _norm_factor(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), 2 * half, eps)[:, None]
        y1 = x1 * inv
        y2 = x2 * inv
    if HAS_WEIGHT:
        y1 = y1 * _weight(w_ptr, offs, col_ok, ONE_PLUS)
        y2 = y2 * _weight(w_ptr + half, offs, col_ok, ONE_PLUS)
    dtype = dst.dtype.element_ty
    if ROPE:
        y1 = y1.to(dtype).to(tl.float32)  # the eager norm's output rounding
        y2 = y2.to(dtype).to(tl.float32)
        table = token[:, None] * 2 * half
        c1 = tl.load(cos_ptr + table + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + table + half + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + table + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + table + half + offs, mask=mask, other=0.0).to(tl.float32)
        # eager: (x * cos) + (rotate_half(x) * sin), each product rounded to the model dtype
        y1, y2 = ((y1 * c1).to(dtype).to(tl.float32) + (-y2 * s1).to(dtype).to(tl.float32),
                  (y2 * c2).to(dtype).to(tl.float32) + (y1 * s2).to(dtype).to(tl.float32))
    tl.store(dst[:, None] + offs, y1.to(dtype), mask=mask)
    tl.store(dst[:, None] + half + offs, y2.to(dtype), mask=mask)


@triton.jit
def _norm_rope_head(src, w_ptr, cos_ptr, sin_ptr, dst, token, half, eps, HAS_WEIGHT: tl.constexpr,
                    ONE_PLUS: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr = True):
    """One head (``src`` / ``dst`` pointers, ``token`` its cos/sin row): :func:`_norm_rope_rows` of one row."""
    one = tl.zeros([1], dtype=tl.int64)
    _norm_rope_rows(src + one, w_ptr, cos_ptr, sin_ptr, dst + one, token + one, one == 0, half, eps, HAS_WEIGHT,
                    ONE_PLUS, ROPE, BLOCK, NORM)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, half, eps,
                      HAS_WEIGHT: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0)
    token = (row // heads).to(tl.int64)
    head = (row % heads).to(tl.int64)
    _norm_rope_head(x_ptr + token * stride_xt + head * stride_xh, w_ptr, cos_ptr, sin_ptr,
                    out_ptr + row.to(tl.int64) * 2 * half, token, half, eps, HAS_WEIGHT, ONE_PLUS, True, BLOCK)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str, cos: torch.Tensor,
              sin: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``apply_rotary(RMSNorm(x), cos, sin)``: x [B, S, H, D] (last dim contiguous), cos/sin [B, S, D] in x's
    dtype (contiguous). Returns a new contiguous [B, S, H, D]. ``pdl``: launched as a programmatic dependent
    (``kernels.pdl``; Hopper), as every kernel here can be."""
    batch, seq, heads, dim = x.shape
    if dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {dim}")
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    view = x.reshape(batch * seq, heads, dim)
    if view.stride(-1) != 1:
        view = view.contiguous()
    cos, sin = cos.reshape(batch * seq, dim).contiguous(), sin.reshape(batch * seq, dim).contiguous()
    half = dim // 2
    block = triton.next_power_of_2(half)
    _norm_rope_kernel[(batch * seq * heads,)](
        view, weight if weight is not None else view, cos, sin, out, heads, view.stride(0), view.stride(1), half,
        float(eps), HAS_WEIGHT=weight is not None, ONE_PLUS=style == "one_plus_w", BLOCK=block,
        num_warps=_head_warps(block), **launch_options(pdl),
    )
    return out


def _head_warps(block: int) -> int:
    return 4 if block >= 512 else (2 if block >= 128 else 1)


@triton.jit
def _qkv_norm_rope_kernel(x_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr, q_heads, kv_heads,
                          num_tokens, stride_xt, v_col, half, eps, ONE_PLUS: tl.constexpr, V_MODE: tl.constexpr,
                          TO_CACHE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of ``ROWS`` tokens, head) over the q heads, then the k heads, then (V_MODE 1: normed without a
    weight, 2: copied) the v heads of fused q/k/v projection rows: q and k normed with their weights and rotated.
    TO_CACHE: k and v go to rows ``slots[token]`` of the caches k_ptr / v_ptr ([slots, kv_heads, dim]) instead of
    row ``token``."""
    await_previous(PDL)
    heads = q_heads + kv_heads + (kv_heads if V_MODE else 0)
    pid = tl.program_id(0)
    tokens = (pid // heads).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = tokens < num_tokens
    head = (pid % heads).to(tl.int64)
    dim = 2 * half
    rows = x_ptr + tokens * stride_xt
    if head < q_heads:
        _norm_rope_rows(rows + head * dim, q_w_ptr, cos_ptr, sin_ptr, q_ptr + (tokens * q_heads + head) * dim,
                        tokens, row_ok, half, eps, True, ONE_PLUS, True, BLOCK)
    else:
        kv_rows = tokens
        if TO_CACHE:
            kv_rows = tl.load(slots_ptr + tokens, mask=row_ok, other=0).to(tl.int64)
        if head < q_heads + kv_heads:
            kv = head - q_heads
            _norm_rope_rows(rows + (q_heads + kv) * dim, k_w_ptr, cos_ptr, sin_ptr,
                            k_ptr + (kv_rows * kv_heads + kv) * dim, tokens, row_ok, half, eps, True, ONE_PLUS, True,
                            BLOCK)
        else:
            kv = head - q_heads - kv_heads
            _norm_rope_rows(rows + v_col + kv * dim, k_w_ptr, cos_ptr, sin_ptr, v_ptr + (kv_rows * kv_heads + kv) * dim,
                            tokens, row_ok, half, eps, False, ONE_PLUS, False, BLOCK, V_MODE == 1)


QKV_ROWS_FROM_TOKENS = 256
"""From this many tokens on, a :func:`qkv_norm_rope` program of head dim <= 256 takes a head of 8 tokens instead
of one (``qkv_rows_per_program``): one head of one token is too little work per program. H100, run 33
(``bench_qkv_norm_rope.py``), D = 256: 8,192 tokens 52.5 -> 34.7 µs, 1,024 8.8 -> 6.1, 256 4.0 -> 3.4, 32 alike;
D = 512 gained nothing at any count (65-67 µs at 8,192) and lost 0.45 µs at 256, so it keeps one."""


def qkv_rows_per_program(num_tokens: int, head_dim: int) -> int:
    """Tokens per :func:`qkv_norm_rope` program (see QKV_ROWS_FROM_TOKENS)."""
    return 8 if num_tokens >= QKV_ROWS_FROM_TOKENS and head_dim <= 256 else 1


def _program_rows(requested: int | None, default: int) -> int:
    """Rows a program of a row-vectorised kernel takes: ``requested`` (a power of two) or ``default``."""
    rows = default if requested is None else requested
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows}")
    return rows


def qkv_norm_rope(qkv: torch.Tensor, q_heads: int, kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float, style: str, cos: torch.Tensor, sin: torch.Tensor, *, v_norm: bool, k_eq_v: bool = False,
                  cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  pdl: bool = False, rows_per_program: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A KV-storing layer's q, k, v from its fused projection ``qkv`` [B, S, (q_heads + kv_heads (+ kv_heads)) * D]
    (last dim contiguous; ``k_eq_v``: no v columns, v is the raw k) in one launch: ``norm_rope`` of the q heads
    (``q_weight``) and of the k heads (``k_weight``), and with ``v_norm`` the weightless RMSNorm of the v heads.
    cos/sin [B, S, D] as for :func:`norm_rope`. Returns new contiguous q [B, S, q_heads, D] and k [B, S, kv_heads,
    D], and v: new [B, S, kv_heads, D] with ``v_norm``, else the view of the raw v (or k) columns of ``qkv``.
    ``cache=(k_cache, v_cache, slots)``: k and v (v copied when not normed) are written to rows ``slots`` (int64
    [B * S]) of the caches (contiguous, rows of [kv_heads, D]; a paged pool's ``view(-1, kv_heads, D)`` works
    too) instead, and (q, None, None) is returned: the KV-cache write of a decode step in the same launch.
    ``rows_per_program``: tokens a program takes (a power of two; default :func:`qkv_rows_per_program`)."""
    batch, seq, width = qkv.shape
    dim = width // (q_heads + kv_heads * (1 if k_eq_v else 2))
    if dim * (q_heads + kv_heads * (1 if k_eq_v else 2)) != width or dim % 2:
        raise ValueError(f"qkv width {width} is not {q_heads} q + {kv_heads} k (+ {kv_heads} v) heads of one even dim")
    v_col = (q_heads if k_eq_v else q_heads + kv_heads) * dim
    q = torch.empty((batch, seq, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if cache is not None:
        k, v, slots = cache
        if (k.shape[-2:] != (kv_heads, dim) or v.shape[-2:] != (kv_heads, dim) or not k.is_contiguous()
                or not v.is_contiguous() or k.dtype != qkv.dtype or v.dtype != qkv.dtype
                or slots.shape != (batch * seq,) or slots.dtype != torch.int64):
            raise ValueError(f"cache needs contiguous k/v rows of [{kv_heads}, {dim}] in {qkv.dtype} and int64 slots "
                             f"[{batch * seq}]; got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slots.shape)} "
                             f"{slots.dtype}")
    else:
        k = torch.empty((batch, seq, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
        v = (torch.empty_like(k) if v_norm
             else qkv[..., v_col : v_col + kv_heads * dim].view(batch, seq, kv_heads, dim))
        slots = k  # unread
    if qkv.numel() == 0:
        return (q, None, None) if cache is not None else (q, k, v)
    view = qkv.reshape(batch * seq, width)
    if view.stride(-1) != 1:
        view = view.contiguous()
    cos, sin = cos.reshape(batch * seq, dim).contiguous(), sin.reshape(batch * seq, dim).contiguous()
    half = dim // 2
    block = triton.next_power_of_2(half)
    v_mode = 1 if v_norm else (2 if cache is not None else 0)
    heads = q_heads + kv_heads * (2 if v_mode else 1)
    tokens = batch * seq
    rows = _program_rows(rows_per_program, qkv_rows_per_program(tokens, dim))
    _qkv_norm_rope_kernel[(triton.cdiv(tokens, rows) * heads,)](
        view, q_weight, k_weight, cos, sin, q, k, v, slots, q_heads, kv_heads, tokens, view.stride(0), v_col, half,
        float(eps), ONE_PLUS=style == "one_plus_w", V_MODE=v_mode, TO_CACHE=cache is not None, BLOCK=block, ROWS=rows,
        num_warps=min(8, _head_warps(block) * rows), **launch_options(pdl),
    )
    return (q, None, None) if cache is not None else (q, k, v)


@triton.jit
def residual_norm_row(h, res_ptr, w_ptr, scale_ptr, w_next_ptr, out_ptr, next_ptr, offs, mask, n_cols, eps, eps_next,
                      ONE_PLUS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, q_ptr=None,
                      q_scale_ptr=None, NEXT_FP8: tl.constexpr = False):
    """One row of :func:`residual_norm` from ``h`` (fp32 [BLOCK], values of the model dtype): stores
    ``y = (residual + rms_norm_w(h)) (* scale)`` at ``out_ptr`` and, with HAS_NEXT, ``rms_norm_next(y)`` at
    ``next_ptr`` (row pointers), and with NEXT_FP8 also that row quantized as ``fp8_rows.quantize_rows`` would
    quantize it (its FP8 values at ``q_ptr``, its scale at ``q_scale_ptr``: the same bytes). The one copy of this
    math: the split-K reduce of ``kernels.skinny_gemm`` runs it as its epilogue."""
    dtype = out_ptr.dtype.element_ty
    normed = h * _norm_factor(tl.sum(h * h, axis=0), n_cols, eps) * _weight(w_ptr, offs, mask, ONE_PLUS)
    residual = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (residual + normed.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if HAS_SCALE:
        y = (y * tl.load(scale_ptr).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, y.to(dtype), mask=mask)
    if HAS_NEXT:
        z = y * _norm_factor(tl.sum(y * y, axis=0), n_cols, eps_next) * _weight(w_next_ptr, offs, mask, ONE_PLUS)
        tl.store(next_ptr + offs, z.to(dtype), mask=mask)
        if NEXT_FP8:
            stored = tl.where(mask, z.to(dtype).to(tl.float32), 0.0)
            scale = fp8_scale(tl.max(tl.abs(stored), axis=0))
            tl.store(q_scale_ptr, scale)
            tl.store(q_ptr + offs, fp8_grid(stored, scale).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _residual_norm_kernel(res_ptr, h_ptr, w_ptr, scale_ptr, w_next_ptr, out_ptr, next_ptr, q_ptr, q_scale_ptr,
                          stride_r, stride_h, n_cols, eps, eps_next, ONE_PLUS: tl.constexpr, HAS_SCALE: tl.constexpr,
                          HAS_NEXT: tl.constexpr, NEXT_FP8: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    residual_norm_row(h, res_ptr + row * stride_r, w_ptr, scale_ptr, w_next_ptr, out_ptr + row * n_cols,
                      next_ptr + row * n_cols, offs, mask, n_cols, eps, eps_next, ONE_PLUS, HAS_SCALE, HAS_NEXT,
                      q_ptr + row * n_cols, q_scale_ptr + row, NEXT_FP8)


def _rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` [..., H] as [rows, H] with a contiguous last dim (a view where it already has one)."""
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors]
    return [t if t.stride(-1) == 1 else t.contiguous() for t in rows]


def _next_outputs(out: torch.Tensor, next_weight: torch.Tensor | None, next_fp8: bool,
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(next, its FP8 values, their scales) for a residual-norm launch writing into ``out``'s shape: next is None
    without ``next_weight``; without ``next_fp8`` the FP8 outputs are ``out`` itself (unwritten placeholders: the
    kernel's NEXT_FP8 is ``q is not out``). With it, ``next`` carries them (:func:`with_fp8_rows`)."""
    if next_weight is None:
        return None, out, out
    nxt = torch.empty_like(out)
    if not next_fp8:
        return nxt, out, out
    rows, n_cols = nxt.numel() // max(nxt.shape[-1], 1), nxt.shape[-1]
    q = torch.empty((rows, n_cols), dtype=torch.float8_e4m3fn, device=out.device)
    q_scale = torch.empty((rows, 1), dtype=torch.float32, device=out.device)
    return with_fp8_rows(nxt, q, q_scale), q, q_scale


def with_fp8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` with ``x.fp8_rows = (q, scale)``: its rows [M, K] as ``fp8_rows.quantize_rows(x.reshape(-1, K))``
    gives them (written by the kernel that writes ``x``). FP8 projections of few rows read them instead of
    quantizing ``x`` again (``SmallBatchMatmuls.project``); the attribute lives and dies with this tensor object
    (a view or a copy does not carry it)."""
    x.fp8_rows = (q, scale)
    return x


def residual_norm_warps(block: int) -> int:
    """Warps of a one-row-per-program residual-norm kernel whose row block is ``block``."""
    return 8 if block >= 2048 else (4 if block >= 512 else 1)


def residual_norm(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, style: str, *,
                  scale: torch.Tensor | None = None, next_weight: torch.Tensor | None = None,
                  next_eps: float | None = None, next_fp8: bool = False,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y = residual + RMSNorm_w(h)`` (then ``* scale``, a one-element tensor, if given), and with
    ``next_weight`` also ``RMSNorm_next(y)``; with ``next_fp8`` too, that next tensor carries itself quantized
    (``next.fp8_rows``: :func:`with_fp8_rows`). residual, h [..., H] of one shape. Returns (y, next or None), new
    contiguous tensors."""
    if residual.shape != h.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and h {tuple(h.shape)} differ")
    n_cols = h.shape[-1]
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    nxt, q, q_scale = _next_outputs(out, next_weight, next_fp8)
    if h.numel() == 0:
        return out, nxt
    res2, h2 = _rows(residual, h)
    block = triton.next_power_of_2(n_cols)
    _residual_norm_kernel[(h2.shape[0],)](
        res2, h2, weight, scale if scale is not None else weight, next_weight if next_weight is not None else weight,
        out, nxt if nxt is not None else out, q, q_scale, res2.stride(0), h2.stride(0), n_cols, float(eps),
        float(eps if next_eps is None else next_eps), ONE_PLUS=style == "one_plus_w", HAS_SCALE=scale is not None,
        HAS_NEXT=next_weight is not None, NEXT_FP8=q is not out, BLOCK=block, num_warps=residual_norm_warps(block),
        **launch_options(pdl),
    )
    return out, nxt


@triton.jit
def _moe_residual_norm_kernel(res_ptr, dense_ptr, moe_ptr, w_dense_ptr, w_moe_ptr, w_ptr, scale_ptr, w_next_ptr,
                              out_ptr, next_ptr, q_ptr, q_scale_ptr, stride_r, stride_d, stride_m, n_cols, eps_dense,
                              eps_moe, eps, eps_next, ONE_PLUS: tl.constexpr, HAS_SCALE: tl.constexpr,
                              HAS_NEXT: tl.constexpr, NEXT_FP8: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dense = tl.load(dense_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
    moe = tl.load(moe_ptr + row * stride_m + offs, mask=mask, other=0.0).to(tl.float32)
    dense = dense * _norm_factor(tl.sum(dense * dense, axis=0), n_cols, eps_dense) * _weight(w_dense_ptr, offs, mask,
                                                                                            ONE_PLUS)
    moe = moe * _norm_factor(tl.sum(moe * moe, axis=0), n_cols, eps_moe) * _weight(w_moe_ptr, offs, mask, ONE_PLUS)
    h = (dense.to(dtype).to(tl.float32) + moe.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    residual_norm_row(h, res_ptr + row * stride_r, w_ptr, scale_ptr, w_next_ptr, out_ptr + row * n_cols,
                      next_ptr + row * n_cols, offs, mask, n_cols, eps, eps_next, ONE_PLUS, HAS_SCALE, HAS_NEXT,
                      q_ptr + row * n_cols, q_scale_ptr + row, NEXT_FP8)


def moe_residual_norm(residual: torch.Tensor, dense: torch.Tensor, moe: torch.Tensor, dense_weight: torch.Tensor,
                      dense_eps: float, moe_weight: torch.Tensor, moe_eps: float, weight: torch.Tensor, eps: float,
                      style: str, *, scale: torch.Tensor | None = None, next_weight: torch.Tensor | None = None,
                      next_eps: float | None = None, next_fp8: bool = False,
                      pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Gemma 4 MoE layer's feed-forward end in one launch: ``h = RMSNorm_dense(dense) + RMSNorm_moe(moe)``
    (each norm, and the sum, rounded to the model dtype as the eager ops round them), then
    :func:`residual_norm` ``(residual, h, weight, ...)`` (``next_fp8`` as there); every norm of the one
    ``style``. residual, dense, moe [..., H] of one shape. Returns (y, next or None), new contiguous tensors."""
    if not residual.shape == dense.shape == moe.shape:
        raise ValueError(f"residual {tuple(residual.shape)}, dense {tuple(dense.shape)} and moe {tuple(moe.shape)} "
                         "differ")
    n_cols = dense.shape[-1]
    out = torch.empty(dense.shape, dtype=dense.dtype, device=dense.device)
    nxt, q, q_scale = _next_outputs(out, next_weight, next_fp8)
    if dense.numel() == 0:
        return out, nxt
    res2, dense2, moe2 = _rows(residual, dense, moe)
    block = triton.next_power_of_2(n_cols)
    _moe_residual_norm_kernel[(dense2.shape[0],)](
        res2, dense2, moe2, dense_weight, moe_weight, weight, scale if scale is not None else weight,
        next_weight if next_weight is not None else weight, out, nxt if nxt is not None else out, q, q_scale,
        res2.stride(0), dense2.stride(0), moe2.stride(0), n_cols, float(dense_eps), float(moe_eps), float(eps),
        float(eps if next_eps is None else next_eps), ONE_PLUS=style == "one_plus_w", HAS_SCALE=scale is not None,
        HAS_NEXT=next_weight is not None, NEXT_FP8=q is not out, BLOCK=block, num_warps=residual_norm_warps(block),
        **launch_options(pdl),
    )
    return out, nxt


@triton.jit
def gelu_tanh(a):
    """``gelu_pytorch_tanh`` of fp32 ``a`` (the one Triton copy; fused_ops, skinny_gemm and moe use it)."""
    inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)  # sqrt(2 / pi); compiled Triton reads no globals
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1 without overflow trouble
    return 0.5 * a * (1.0 + tanh)


@triton.jit
def _ple_inputs_kernel(proj_ptr, token_ptr, ids_ptr, table_scale_ptr, w_ptr, out_ptr, num_rows, layers, dim, eps,
                       proj_scale, out_scale, ONE_PLUS: tl.constexpr, LOOKUP: tl.constexpr, BLOCK: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """``ROWS`` (token, layer) rows of ``dim`` per program. LOOKUP: the token part is row ``ids[token]`` of the
    table at ``token_ptr`` ([vocab, layers * dim]) times its scale, rounded as the eager lookup rounds."""
    await_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    offs = tl.arange(0, BLOCK)[None, :]
    col_ok = offs < dim
    mask = row_ok[:, None] & col_ok
    at = rows[:, None] * dim + offs
    dtype = out_ptr.dtype.element_ty
    context = tl.load(proj_ptr + at, mask=mask, other=0.0).to(tl.float32) * proj_scale
    context = context.to(dtype).to(tl.float32)  # eager rounds the scaled projection
    factor = _norm_factor(tl.sum(context * context, axis=1), dim, eps)[:, None]
    normed = context * factor * _weight(w_ptr, offs, col_ok, ONE_PLUS)
    if LOOKUP:
        ids = tl.load(ids_ptr + rows // layers, mask=row_ok, other=0).to(tl.int64)
        entry = (ids * layers + rows % layers)[:, None] * dim + offs
        token = tl.load(token_ptr + entry, mask=mask, other=0.0).to(tl.float32)
        token = (token * tl.load(table_scale_ptr).to(tl.float32)).to(dtype).to(tl.float32)
    else:
        token = tl.load(token_ptr + at, mask=mask, other=0.0).to(tl.float32)
    total = (normed.to(dtype).to(tl.float32) + token).to(dtype).to(tl.float32)
    tl.store(out_ptr + at, (total * out_scale).to(dtype), mask=mask)


def ple_inputs(projection: torch.Tensor, token_part: torch.Tensor | None, weight: torch.Tensor, eps: float, style: str,
               projection_scale: float, out_scale: float, *, pdl: bool = False, rows_per_program: int | None = None,
               lookup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Gemma 4's per-layer inputs from the model projection [..., L * P] and the looked-up token part [..., L, P]
    (both contiguous, the model dtype): ``(RMSNorm_w(projection * projection_scale) + token_part) * out_scale`` per
    (token, layer) row of P, rounded where the eager chain rounds. Returns a new [..., L, P].
    ``lookup=(ids [...], table [vocab, L * P], scale)`` instead of ``token_part`` (None): the token part is looked up
    here, ``table[ids] * scale`` rounded to the model dtype (``ScaledEmbedding``'s arithmetic; ids must be valid rows,
    as for ``F.embedding``), so the lookup and its scaling take no launches and no pass of their own.
    ``rows_per_program``: (token, layer) rows a program takes (a power of two; default 1 below 2,048 rows, else 8:
    one short row a program left a prompt tick's launch at ~2.3x its bytes' time, run 33)."""
    if (token_part is None) == (lookup is None):
        raise ValueError("pass exactly one of token_part and lookup")
    if lookup is not None:
        ids, table, table_scale = lookup
        layers_dim = table.shape[-1]
        if projection.shape[-1] != layers_dim or ids.shape != projection.shape[:-1] or not table.is_contiguous():
            raise ValueError(f"lookup table {tuple(table.shape)} / ids {tuple(ids.shape)} do not match projection "
                             f"{tuple(projection.shape)}")
        dim = weight.shape[0]
        shape = (*ids.shape, layers_dim // dim, dim)
        dtype, source = table.dtype, table
        ids = ids.reshape(-1).contiguous()
    else:
        assert token_part is not None
        dim = token_part.shape[-1]
        if projection.numel() != token_part.numel() or projection.shape[-1] % dim:
            raise ValueError(f"projection {tuple(projection.shape)} does not match token part "
                             f"{tuple(token_part.shape)}")
        shape, dtype, source = token_part.shape, token_part.dtype, token_part.contiguous()
        ids = table_scale = source  # unread
    out = torch.empty(shape, dtype=dtype, device=projection.device)
    num_rows = out.numel() // dim if dim else 0
    rows = _program_rows(rows_per_program, 1 if num_rows < 2048 else 8)
    if out.numel():
        block = triton.next_power_of_2(dim)
        _ple_inputs_kernel[(triton.cdiv(num_rows, rows),)](
            projection.contiguous(), source, ids, table_scale, weight, out, num_rows, shape[-2], dim, float(eps),
            float(projection_scale), float(out_scale), ONE_PLUS=style == "one_plus_w", LOOKUP=lookup is not None,
            BLOCK=block, ROWS=rows, num_warps=min(8, _head_warps(block) * rows), **launch_options(pdl))
    return out


@triton.jit
def _gelu_mul_kernel(a_ptr, b_ptr, out_ptr, stride_a, stride_b, n_cols, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = out_ptr.dtype.element_ty
    a = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
    gelu = gelu_tanh(a).to(dtype).to(tl.float32)  # eager rounds gelu's output
    tl.store(out_ptr + row * n_cols + offs, (gelu * b).to(dtype), mask=mask)


def gelu_mul(a: torch.Tensor, b: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``gelu_tanh(a) * b`` for a, b [..., W] of one shape (last dim contiguous; rows may be strided, e.g. the
    two halves of a fused gate/up output). Returns a new contiguous [..., W]."""
    if a.shape != b.shape:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} differ")
    n_cols = a.shape[-1]
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel() == 0:
        return out
    a2, b2 = a.reshape(-1, n_cols), b.reshape(-1, n_cols)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    if b2.stride(-1) != 1:
        b2 = b2.contiguous()
    block = min(1024, triton.next_power_of_2(n_cols))
    _gelu_mul_kernel[(a2.shape[0], triton.cdiv(n_cols, block))](
        a2, b2, out, a2.stride(0), b2.stride(0), n_cols, BLOCK=block, num_warps=4 if block >= 512 else 1,
        **launch_options(pdl),
    )
    return out
