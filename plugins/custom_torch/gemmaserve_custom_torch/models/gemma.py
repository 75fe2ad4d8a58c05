"""`GemmaForCausalLM`: the Gemma 3 / Gemma 4 text decoder in plain torch, one code path with config switches.

Attention itself is delegated to an `AttentionContext` (see attention_context.py); this module computes
embeddings, Q/K/V, MLPs, per-layer embeddings (PLE) and logits. Parameter names equal the Hugging Face
checkpoint names with the text prefix stripped (`layers.3.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from gemmaserve.errors import ConfigurationError

from ..distributed.collectives import SINGLE, TensorParallel
from ..distributed.shards import Shard, expert_range, read_shard, shard_config, shard_for, vocab_range
from .attention_context import AttentionContext
from .config import GemmaTextConfig
from .layers import (
    Device,
    FusedElementwise,
    GeGLUMLP,
    MoEExperts,
    MoERouter,
    RMSNorm,
    RotaryEmbedding,
    SmallBatchMatmuls,
    apply_rotary,
    gelu_tanh,
    small_batch_linear,
    small_batch_project,
    triton_runs_on,
)
from .quantization import (
    FP8_DTYPE,
    check_fp8_device,
    check_fp8_shapes,
    is_fp8,
    prepare_fp8,
    quantize_fp8,
    read_checkpoint_scheme,
)

logger = logging.getLogger(__name__)


class ScaledEmbedding(nn.Module):
    """Token lookup × scale, where the scale is rounded from the exact Python float to the weight dtype
    (bf16(√H) in a bf16 model, as transformers does). ids [...] -> [..., dim] in the weight dtype.

    Vocabulary-parallel under tensor parallel: ``weight`` holds this rank's rows (`shards.vocab_range`, padded);
    ids outside them look up zeros and one all-reduce completes the rows (exact: one rank adds a value, the
    others zeros)."""

    def __init__(
        self, num_embeddings: int, dim: int, scale: float, device: Device = None, dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.scale = scale
        self.tp = tp
        self.first_row, _, rows = vocab_range(num_embeddings, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype))
        self._scale_cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def scale_tensor(self) -> Tensor:
        """The scale in the weight's dtype and device (cached): what the lookup multiplies by."""
        key = (self.weight.dtype, self.weight.device)
        cached = self._scale_cache.get(key)
        if cached is None:
            cached = torch.tensor(self.scale, dtype=torch.float64).to(dtype=key[0], device=key[1])
            self._scale_cache[key] = cached
        return cached

    def forward(self, ids: Tensor) -> Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight) * self.scale_tensor()
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[..., None], 0)
        return self.tp.all_reduce(rows * self.scale_tensor())


class GemmaAttention(nn.Module):
    """Q/K/V projections, QK(V)-norms and RoPE of one layer; attention itself runs in the context.

    KV-shared layers own only q_proj, q_norm and o_proj. K=V layers have no v_proj: V is the raw k_proj
    output, v-normed. x [B, S, H] -> [B, S, H]. Under tensor parallel ``config`` is the rank's shard
    (`shards.shard_config`: its heads) and the o_proj output is all-reduced.
    """

    def __init__(
        self, config: GemmaTextConfig, layer_idx: int, device: Device = None, dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads[layer_idx]
        self.head_dim = config.head_dims[layer_idx]
        self.stores_kv = config.stores_kv(layer_idx)
        self.k_eq_v = config.k_eq_v[layer_idx]
        hidden, eps, style = config.hidden_size, config.rms_norm_eps, config.norm_style
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        self.q_proj = nn.Linear(hidden, q_width, bias=False, device=device, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, eps, style, device=device, dtype=dtype)
        self.o_proj = nn.Linear(q_width, hidden, bias=False, device=device, dtype=dtype)
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        self.k_norm: RMSNorm | None = None
        self.v_norm: RMSNorm | None = None
        if self.stores_kv:
            self.k_proj = nn.Linear(hidden, kv_width, bias=False, device=device, dtype=dtype)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(hidden, kv_width, bias=False, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, eps, style, device=device, dtype=dtype)
            if config.has_v_norm:
                self.v_norm = RMSNorm(self.head_dim, eps, style, with_weight=False)
        # Set by `fusion.fuse_projections`: [q; k; v] weight rows (q/k/v_proj.weight become views of it).
        self.fused_qkv: Tensor | None = None
        self.fused_qkv_scale: Tensor | None = None  # its FP8 scales (FP8 weights only)
        self.fused_widths: tuple[int, ...] = ()
        self.fused_ops: FusedElementwise | None = None  # set by `fusion.fuse_elementwise`
        self.small_batch: SmallBatchMatmuls | None = None  # set by `fusion.fuse_small_batch`

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        return self.tp.all_reduce(small_batch_linear(self.o_proj, self.attention(x, cos, sin, attn), self.small_batch))

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext) -> Tensor:
        """The attention output [B, S, heads * head_dim] that ``o_proj`` reads."""
        batch, seq, _ = x.shape
        if self.fused_ops is not None and self.fused_qkv is not None:  # a KV-storing layer: one kernel after the matmul
            assert self.k_norm is not None and self.q_norm.weight is not None and self.k_norm.weight is not None
            qkv = small_batch_project(x, self.fused_qkv, self.fused_qkv_scale, self.small_batch)
            target = getattr(attn, "kv_cache_target", None)  # the context's option: K/V written by this kernel
            q, k, v = self.fused_ops.qkv_norm_rope(
                qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                self.q_norm.style, cos, sin, v_norm=self.v_norm is not None, k_eq_v=self.k_eq_v,
                cache=None if target is None else target(self.layer_idx))
            return self._attend(q, k, v, attn)
        q_lin, k_lin, v_lin = self._project(x)
        q = self._norm_rope(self.q_norm, q_lin.view(batch, seq, self.num_heads, self.head_dim), cos, sin)
        k = v = None
        if k_lin is not None:
            assert self.k_norm is not None
            k_raw = k_lin.view(batch, seq, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if v_lin is None else v_lin.view(batch, seq, self.num_kv_heads, -1)
            k = self._norm_rope(self.k_norm, k_raw, cos, sin)
            v = self.v_norm(v_raw) if self.v_norm is not None else v_raw
        return self._attend(q, k, v, attn)

    def _attend(self, q: Tensor, k: Tensor | None, v: Tensor | None, attn: AttentionContext) -> Tensor:
        batch, seq = q.shape[:2]
        return attn.attend(self.layer_idx, q, k, v).reshape(batch, seq, self.num_heads * self.head_dim)

    def _norm_rope(self, norm: RMSNorm, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.norm_rope(x, norm.weight, norm.eps, norm.style, cos, sin)
        return apply_rotary(norm(x), cos, sin)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(q, k, v) projections of x; k/v None where the layer has none. One matmul after `fuse_projections`."""
        if self.fused_qkv is not None:
            fused = small_batch_project(x, self.fused_qkv, self.fused_qkv_scale, self.small_batch)
            parts = fused.split(self.fused_widths, dim=-1)
            return parts[0], parts[1], parts[2] if len(parts) > 2 else None
        if self.k_proj is None:
            return small_batch_linear(self.q_proj, x, self.small_batch), None, None
        return self.q_proj(x), self.k_proj(x), None if self.v_proj is None else self.v_proj(x)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: attention, GeGLU MLP (+ parallel MoE on Gemma 4 26B-style models), then the
    Gemma 4 PLE injection and `layer_scalar`. x [B, S, H] -> new [B, S, H]; input not mutated. Under tensor
    parallel the MLP's and the experts' outputs (row-parallel partial sums) are all-reduced here."""

    def __init__(
        self, config: GemmaTextConfig, layer_idx: int, device: Device = None, dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        hidden, eps, style = config.hidden_size, config.rms_norm_eps, config.norm_style

        def norm(dim: int = hidden) -> RMSNorm:
            return RMSNorm(dim, eps, style, device=device, dtype=dtype)

        self.self_attn = GemmaAttention(config, layer_idx, device, dtype, tp)
        self.mlp = GeGLUMLP(hidden, config.mlp_widths[layer_idx], device, dtype)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.has_moe = config.moe_num_experts > 0
        if self.has_moe:
            self.router = MoERouter(hidden, config.moe_num_experts, config.moe_top_k, eps, device, dtype)
            total = config.moe_num_experts
            first, end = expert_range(total, tp.rank, tp.world_size) if tp.expert_parallel else (0, total)
            self.experts = MoEExperts(hidden, end - first, config.moe_intermediate_size, device, dtype,
                                      first_expert=first, total_experts=total)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
        self.has_ple = config.ple_dim > 0
        if self.has_ple:
            self.per_layer_input_gate = nn.Linear(hidden, config.ple_dim, bias=False, device=device, dtype=dtype)
            self.per_layer_projection = nn.Linear(config.ple_dim, hidden, bias=False, device=device, dtype=dtype)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar: Tensor | None
        if config.has_layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1, device=device, dtype=dtype))
        else:
            self.layer_scalar = None
        self.fused_ops: FusedElementwise | None = None  # set by `fusion.fuse_elementwise`
        self.small_batch: SmallBatchMatmuls | None = None  # set by `fusion.fuse_small_batch` (the PLE projections)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, ple: Tensor | None = None) -> Tensor:
        if self.fused_ops is not None:
            return self.forward_fused(self.fused_ops, x, cos, sin, attn, ple)[0]
        residual = x
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = residual + self.post_attention_layernorm(h)

        residual = x
        h = self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.has_moe:
            h = self._with_moe(residual, h)
        x = residual + self.post_feedforward_layernorm(h)

        if self.has_ple:
            assert ple is not None, "PLE model layers need their per-layer input"
            gated = gelu_tanh(self.per_layer_input_gate(x)) * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x

    def _with_moe(self, residual: Tensor, h: Tensor) -> Tensor:
        """The MoE block's sum with the dense MLP output ``h``: post_ff_1(h) + post_ff_2(experts(residual))."""
        moe = self._experts_out(residual)
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)

    def _experts_out(self, residual: Tensor, ops: FusedElementwise | None = None) -> Tensor:
        """The MoE experts' output for the pre-MLP ``residual``, all-reduced over the tensor-parallel ranks (each
        holds a slice of every expert's width, or under expert parallel whole experts: either way a partial sum).
        With ``ops`` (:meth:`forward_fused`) the router and the experts' input norm run as ``ops.route``'s two
        launches for batches of at most ``ops.route_max_rows`` rows; else as the eager modules."""
        flat = residual.reshape(-1, residual.shape[-1])
        router, norm = self.router, self.pre_feedforward_layernorm_2
        if ops is not None and flat.shape[0] <= ops.route_max_rows:
            weights, ids, normed = ops.route(flat, router.scale, router.proj.weight, router.per_expert_scale,
                                             router.top_k, router.norm.eps, norm.weight, norm.eps, norm.style)
        else:
            (weights, ids), normed = router(flat), norm(flat)
        return self.tp.all_reduce(self.experts(normed, weights, ids)).reshape(residual.shape)

    def forward_fused(self, ops: FusedElementwise, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
                      ple: Tensor | None, *, normed: Tensor | None = None,
                      next_norm: RMSNorm | None = None) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward` with each post-norm + residual add (+ the next pre-norm, + layer_scalar) and the
        PLE gate as one kernel, or, on the few-row path, inside the projection before them (:meth:`_residual`,
        :meth:`_ple_gate`). On MoE layers the router, the experts (``experts.fused`` when set) and the MoE
        block's own norms run as in :meth:`forward`. ``normed``: this layer's ``input_layernorm(x)`` when the
        previous layer's last kernel already computed it; ``next_norm``: the norm that follows this layer (the
        next layer's input norm, or the model's final norm), folded into this layer's last kernel. Returns
        (x, next_norm(x) or None)."""
        post_attn, pre_ff, post_ff = (self.post_attention_layernorm, self.pre_feedforward_layernorm,
                                      self.post_feedforward_layernorm)
        attention = self.self_attn.attention(self.input_layernorm(x) if normed is None else normed, cos, sin, attn)
        x, normed = self._residual(ops, self.self_attn.o_proj, attention, x, post_attn, next_norm=pre_ff)
        mlp_next = None if self.has_ple else next_norm
        mlp_scale = None if self.has_ple else self.layer_scalar
        if self.has_moe:
            dense, moe = self.tp.all_reduce(self.mlp(normed)), self._experts_out(x, ops)
            dense_norm, moe_norm = self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2
            x, after = ops.moe_residual_norm(x, dense, moe, dense_norm.weight, dense_norm.eps, moe_norm.weight,
                                             moe_norm.eps, post_ff.weight, post_ff.eps, post_ff.style,
                                             scale=mlp_scale, **_next_norm_args(mlp_next, self._fp8_rows_for(x)))
        else:
            x, after = self._residual(ops, self.mlp.down_proj, self.mlp.activation(normed), x, post_ff,
                                      scale=mlp_scale, next_norm=mlp_next)
        if self.has_ple:
            assert ple is not None, "PLE model layers need their per-layer input"
            x, after = self._residual(ops, self.per_layer_projection, self._ple_gate(ops, x, ple), x,
                                      self.post_per_layer_input_norm, scale=self.layer_scalar, next_norm=next_norm,
                                      all_reduce=False)
        return x, after

    def _residual(self, ops: FusedElementwise, projection: nn.Module, x: Tensor, residual: Tensor, norm: RMSNorm, *,
                  scale: Tensor | None = None, next_norm: RMSNorm | None = None,
                  all_reduce: bool = True) -> tuple[Tensor, Tensor | None]:
        """``ops.residual_norm(residual, projection(x), norm, scale=, next norm)`` (the projection all-reduced over
        tensor-parallel ranks unless ``all_reduce`` is False). On the few-row path (one rank, a plain model-dtype
        projection) the chain runs in the projection's split-K reduce: two launches instead of three."""
        small = self.small_batch
        if small is not None and not self.tp.enabled and small.takes_linear(projection, x):
            y, after = small.residual_norm(x.reshape(-1, x.shape[-1]), projection.weight,
                                           residual.reshape(-1, residual.shape[-1]), norm.weight, norm.eps, norm.style,
                                           scale=scale, **_next_norm_args(next_norm))
            return y.view(residual.shape), None if after is None else after.view(residual.shape)
        h = small_batch_linear(projection, x, small)
        if all_reduce:
            h = self.tp.all_reduce(h)
        return ops.residual_norm(residual, h, norm.weight, norm.eps, norm.style, scale=scale,
                                 **_next_norm_args(next_norm, self._fp8_rows_for(residual)))

    def _fp8_rows_for(self, x: Tensor) -> bool:
        """Whether the FP8 projection that reads a next norm's output of ``x``'s rows (the next layer's q/k/v, this
        layer's gate/up) takes them through the few-row kernels, so the residual kernel writing that output should
        quantize it too (``next_fp8``) and spare the projection its own quantization launch."""
        small = self.small_batch
        return small is not None and small.fp8_rows_ahead and small.takes(x)

    def _ple_gate(self, ops: FusedElementwise, x: Tensor, ple: Tensor) -> Tensor:
        """``gelu_tanh(per_layer_input_gate(x)) * ple``: on the few-row path one kernel (the gate in the
        projection's epilogue), else the projection and ``ops.gelu_mul``."""
        gate, small = self.per_layer_input_gate, self.small_batch
        if small is not None and small.takes_linear(gate, x):
            flat = small.gelu_mul(x.reshape(-1, x.shape[-1]), gate.weight, ple.reshape(-1, ple.shape[-1]))
            return flat.view(*x.shape[:-1], -1)
        return ops.gelu_mul(small_batch_linear(gate, x, small), ple)


def _next_norm_args(norm: RMSNorm | None, fp8: bool = False) -> dict[str, Any]:
    """The keywords that make a residual-norm kernel also write ``norm`` of its output (none for None), quantized
    for FP8 projections too with ``fp8``."""
    args: dict[str, Any] = {} if norm is None else {"next_weight": norm.weight, "next_eps": norm.eps}
    if args and fp8:
        args["next_fp8"] = True
    return args


class GemmaForCausalLM(nn.Module):
    """Gemma 3 / Gemma 4 text decoder with a (normally tied) LM head.

    `model(input_ids [B, S], positions [B, S], attn, logits_to_keep=0)` -> logits [B, S or n, V] in the model
    dtype (final softcap applied when configured). Attention state lives in `attn`; the module itself is
    stateless across calls. Build with `GemmaForCausalLM.from_hf(path)` or from a `GemmaTextConfig` (then the
    weights are uninitialised; load a state dict).

    With ``tp`` of world size N > 1 the module is rank ``tp.rank``'s shard (`distributed.shards`): ``config`` is
    the unsharded config (kept as ``full_config``), ``self.config`` the shard's geometry; every rank must run
    the same forwards in the same order (the collectives pair them up) and all get the full logits.
    """

    def __init__(
        self, config: GemmaTextConfig, device: Device = None, dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full_config = config
        config = shard_config(config, tp.world_size, tp.expert_parallel) if tp.enabled else config
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = ScaledEmbedding(config.vocab_size, hidden, config.embed_scale, device, dtype, tp)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, device, dtype, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, config.norm_style, device=device, dtype=dtype)
        if config.ple_dim:
            total = config.num_hidden_layers * config.ple_dim
            self.embed_tokens_per_layer = ScaledEmbedding(
                config.ple_vocab_size, total, config.ple_dim**0.5, device, dtype, tp
            )
            self.per_layer_model_projection = nn.Linear(hidden, total, bias=False, device=device, dtype=dtype)
            self.per_layer_projection_norm = RMSNorm(
                config.ple_dim, config.rms_norm_eps, config.norm_style, device=device, dtype=dtype
            )
        # ``kernels.fused_ops.ple_inputs`` (set by ``fusion.fuse_elementwise``): the PLE chain after its projection
        self.ple_inputs_kernel: Callable[..., Tensor] | None = None
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            rows = vocab_range(config.vocab_size, tp.rank, tp.world_size)[2]  # vocabulary-parallel, like the table
            self.lm_head = nn.Linear(hidden, rows, bias=False, device=device, dtype=dtype)
        self.rotary = {
            t: RotaryEmbedding(config.rope[t], config.head_dim_for_type(t)) for t in sorted(set(config.layer_types))
        }

    # ---- forward -------------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, logits_to_keep: int = 0) -> Tensor:
        """Logits for all positions (`logits_to_keep=0`) or the last `logits_to_keep` ones."""
        hidden = self.forward_hidden(input_ids, positions, attn)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        return self.compute_logits(hidden)

    def forward_hidden(
        self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, narrow: tuple[int, Tensor] | None = None
    ) -> Tensor:
        """Final-normed hidden states [B, S, H]. Calls `attn.attend` once per layer, in layer order.

        ``narrow=(layer, index)``: from layer ``layer`` on, only the sequence positions ``index`` (int64 [S'])
        are computed (hidden states, RoPE tables and PLE inputs are narrowed before that layer; the context
        must expect S' queries from then on) and [B, S', H] is returned. Exact for the kept positions when the
        layers from ``layer`` on store no K/V (KV-shared layers): the positions dropped change nothing kept."""
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [batch, seq]; got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}."
            )
        x = self.embed_tokens(input_ids)
        ple = self._per_layer_inputs(input_ids, x) if self.config.ple_dim else None
        tables = {t: rope(positions, x.dtype) for t, rope in self.rotary.items()}
        carried: Tensor | None = None  # the next input norm, computed by the previous fused layer's last kernel
        for i, layer in enumerate(self.layers):
            if narrow is not None and i == narrow[0]:
                index = narrow[1]
                x = x[:, index]
                carried = None if carried is None else carried[:, index]
                ple = None if ple is None else ple[:, index]
                tables = {t: (cos[:, index], sin[:, index]) for t, (cos, sin) in tables.items()}
                if x.shape[1] == 0:  # nothing downstream is needed
                    break
            cos, sin = tables[self.config.layer_types[i]]
            layer_ple = None if ple is None else ple[:, :, i, :]
            if layer.fused_ops is None:
                x, carried = layer(x, cos, sin, attn, layer_ple), None
                continue
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, carried = layer.forward_fused(layer.fused_ops, x, cos, sin, attn, layer_ple, normed=carried,
                                             next_norm=following)
        return self.norm(x) if carried is None else carried

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> logits [..., V] in the model dtype; softcap `tanh(x/c)*c` in that dtype. Under
        tensor parallel each rank computes its vocabulary rows and every rank gets all of them (gathered before
        the softcap; each logit is one rank's full dot product, so the gather itself changes no bit)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Fold to 2-D: on a sliced (non-contiguous) 3-D input torch's matmul may skip folding when weights
        # don't require grad, which changes low bits vs transformers (whose weights do require grad).
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)
        if self.tp.enabled:
            logits = self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        logits = logits.view(*hidden.shape[:-1], -1)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _per_layer_inputs(self, input_ids: Tensor, x0: Tensor) -> Tensor:
        """Gemma 4 PLE vectors [B, S, L, P]: (norm(proj(x0)·H^-½) + table[ids]·√P) · 2^-½."""
        layers, dim = self.config.num_hidden_layers, self.config.ple_dim
        table, projection = self.embed_tokens_per_layer, self.per_layer_model_projection(x0)
        kernel = self.ple_inputs_kernel
        if kernel is not None and triton_runs_on(x0):
            norm = self.per_layer_projection_norm
            args = (norm.weight, norm.eps, norm.style, self.config.hidden_size**-0.5, 2.0**-0.5)
            if not table.tp.enabled:  # the kernel looks the token part up (vocabulary-parallel rows all-reduce)
                return kernel(projection, None, *args, lookup=(input_ids, table.weight, table.scale_tensor()))
            return kernel(projection, table(input_ids).reshape(*input_ids.shape, layers, dim), *args)
        token_part = table(input_ids).reshape(*input_ids.shape, layers, dim)
        context = projection * (self.config.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.reshape(*x0.shape[:-1], layers, dim))
        return (context + token_part) * (2.0**-0.5)

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_hf(
        cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE, quantization: str | None = None,
    ) -> GemmaForCausalLM:
        """Load a Hugging Face checkpoint folder (single `model.safetensors` or sharded with
        `model.safetensors.index.json`). `dtype=None` keeps the dtype stored for the embedding table.
        K/V weights of KV-shared layers and non-text (vision/audio) weights are skipped; any other unknown or
        missing text weight raises. Returns the model in eval mode with requires_grad off. With ``tp`` of world
        size > 1, only rank ``tp.rank``'s slices are read (`shards.shard_for`; the caller must have joined the
        group: the model's forwards are collective).

        FP8 (`quantization.py`): a checkpoint whose config.json has a compressed-tensors ``quantization_config``
        loads its FP8 projections as they are (``quantization`` None or "fp8"); ``quantization="fp8"`` on a
        model-dtype checkpoint quantizes the loaded weights (`quantize_fp8`). Either way ``dtype`` is the
        activation / output dtype. ConfigurationError for an unsupported scheme or device."""
        folder = Path(path)
        config = GemmaTextConfig.from_pretrained(folder)
        if quantization not in (None, "fp8"):
            raise ConfigurationError(f"quantization={quantization!r} is not supported by the custom_torch model; "
                                     "fp8 is")
        scheme = read_checkpoint_scheme(folder)
        fp8 = scheme is not None or quantization == "fp8"
        files = _weight_files(folder)
        key_to_file = _key_index(folder, files)
        prefix = _text_prefix(config, key_to_file)
        embed_key = prefix + "embed_tokens.weight"
        config = _with_stored_head(config, embed_key, key_to_file)
        if dtype is None:
            with safe_open(key_to_file[embed_key], framework="pt") as f:
                dtype = f.get_slice(embed_key).get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(dtype, torch.float32)
        if fp8:
            check_fp8_device(device, dtype)

        model = cls(config, device="meta", dtype=dtype, tp=tp)
        if scheme is not None:
            prepare_fp8(model, scheme, prefix)
        meta_state = model.state_dict()
        expected = set(meta_state)
        wanted: dict[str, str] = {}  # checkpoint key -> model key
        unexpected: list[str] = []
        for key in key_to_file:
            local = _local_name(key, prefix, config)
            if local is None:
                continue
            if local in expected:
                wanted[key] = local
            elif not _is_unused_shared_kv(local, config):
                unexpected.append(key)
        if unexpected:
            raise ValueError(f"{folder}: checkpoint has text weights this model does not use: {unexpected[:8]}")
        missing = sorted(expected - set(wanted.values()))
        if missing:
            raise ValueError(f"{folder}: checkpoint lacks weights {missing[:8]} (prefix {prefix!r}).")

        state: dict[str, Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for key in wanted:
            by_file.setdefault(key_to_file[key], []).append(key)
        whole: dict[str, torch.Size] = {}  # with tp: the unsharded shapes config.json implies (slices would fit them)
        wrong_whole: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        if tp.enabled:
            unsharded = cls(config, device="meta", dtype=dtype)
            if scheme is not None:
                prepare_fp8(unsharded, scheme, prefix)
            whole = {key: tensor.shape for key, tensor in unsharded.state_dict().items()}
        for file, keys in by_file.items():
            try:
                with safe_open(file, framework="pt", device=str(device)) as f:
                    for key in keys:
                        local = wanted[key]
                        if local in whole and not local.endswith(".weight_scale"):  # stored [N, 1], held [N]
                            stored = tuple(f.get_slice(key).get_shape())
                            if stored != tuple(whole[local]):
                                wrong_whole.append((local, stored, tuple(whole[local])))
                                continue
                        shard = (shard_for(local, config, tp.rank, tp.world_size, tp.expert_parallel) if tp.enabled
                                 else None)
                        if local.endswith(".weight_scale"):
                            state[local] = _read_scale(f, key, shard, meta_state[local].shape[0])
                        else:
                            state[local] = _read_weight(f, key, shard, meta_state[local].dtype)
            except ConfigurationError:
                raise
            except Exception as exc:
                raise ValueError(f"{file}: reading its tensors failed: {type(exc).__name__}: {exc}; the file is "
                                 "probably corrupt: fetch or convert it again") from None
        wrong = wrong_whole + [(key, tuple(tensor.shape), tuple(meta_state[key].shape))
                               for key, tensor in state.items() if tensor.shape != meta_state[key].shape]
        if wrong:
            shown = "; ".join(f"{key} is {got} in the checkpoint but {want} by config.json" for key, got, want in wrong[:4])
            raise ValueError(f"{folder}: config.json disagrees with the weights ({shown}): its sizes (hidden_size, "
                             "vocab_size, intermediate_size, heads, head_dim ...) must be the checkpoint's")
        model.load_state_dict(state, strict=True, assign=True)
        model.requires_grad_(False)
        if scheme is None and quantization == "fp8":
            quantize_fp8(model)
        if fp8 and torch.device(device).type == "cuda":
            check_fp8_shapes(model)
        return model.eval()


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def _read_weight(handle: Any, key: str, shard: Shard | None, dtype: torch.dtype) -> Tensor:
    """``key``'s (slice of the) tensor in ``dtype``; an FP8 tensor only where the model holds FP8 (never cast)."""
    tensor = read_shard(handle, key, shard)
    if is_fp8(tensor) != (dtype == FP8_DTYPE):
        raise ConfigurationError(
            f"checkpoint tensor {key} is {tensor.dtype} where the model expects {dtype}: its FP8 tensors do not match "
            "its quantization_config (only compressed-tensors FP8 Linear weights with weight_scale load; FP8 MoE "
            "experts or an FP8 LM head/embedding are not supported)")
    return tensor if dtype == FP8_DTYPE else tensor.to(dtype)


def _read_scale(handle: Any, key: str, shard: Shard | None, rows: int) -> Tensor:
    """A compressed-tensors ``weight_scale`` as fp32 [rows] (this rank's output rows): a per-channel [out, 1]
    scale sliced like its weight's rows (row-parallel weights keep every row's scale), a tensor-wise [1] / []
    scale broadcast to every row."""
    full = handle.get_slice(key).get_shape()
    if math.prod(full) == 1:
        return handle.get_tensor(key).float().reshape(1).expand(rows).contiguous()
    scale = read_shard(handle, key, shard).float().reshape(-1)
    if scale.shape[0] != rows:
        raise ConfigurationError(f"{key} has shape {full}, expected [{rows}, 1] (per-channel) or [1] (per-tensor)")
    return scale


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({folder / name for name in weight_map.values()})
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{folder} has neither model.safetensors nor model.safetensors.index.json; gemmaserve loads "
        "safetensors checkpoints only (convert .bin / GGUF checkpoints with transformers first)."
    )


def _key_index(folder: Path, files: list[Path]) -> dict[str, str]:
    """Every tensor name in the checkpoint -> the file holding it. Raises ValueError naming a weight file that
    is missing, truncated or corrupt (safetensors' own errors are not the caller's to decode)."""
    index: dict[str, str] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file} is listed in the checkpoint's index but does not exist")
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    index[key] = str(file)
        except Exception as exc:
            raise ValueError(
                f"{file} ({file.stat().st_size} bytes) is not a readable safetensors file: {exc}; it is probably "
                "truncated or corrupt (an interrupted download or copy): fetch or convert it again"
            ) from None
    return index


def _text_prefix(config: GemmaTextConfig, keys: dict[str, str]) -> str:
    if config.is_multimodal_wrapper:
        candidates = ["model.language_model.", "language_model.model."]
    else:
        candidates = ["model.", ""]
    for prefix in candidates:
        if prefix + "embed_tokens.weight" in keys:
            return prefix
    raise ValueError(
        f"cannot find the text embedding: none of {[p + 'embed_tokens.weight' for p in candidates]} is in "
        f"the checkpoint (model_type {config.model_type!r})."
    )


_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def _with_stored_head(config: GemmaTextConfig, embed_key: str, key_to_file: dict[str, str]) -> GemmaTextConfig:
    """``config``, untied when config.json ties the output head to the embedding but the checkpoint stores a head
    with other values: transformers then keeps the stored head (it warns "we will NOT tie them"), so this model
    must too. A stored head equal to the embedding (or none) keeps the tie."""
    head_key = next((key for key in _HEAD_KEYS if key in key_to_file), None)
    if not config.tie_word_embeddings or head_key is None:
        return config
    with safe_open(key_to_file[embed_key], framework="pt") as f:
        embed = f.get_tensor(embed_key)
    with safe_open(key_to_file[head_key], framework="pt") as f:
        head = f.get_tensor(head_key)
    if embed.shape == head.shape and torch.equal(embed, head):
        return config
    logger.warning("config.json ties the output head to the embedding but the checkpoint stores %s with other "
                   "values: using the stored head, as transformers does (set tie_word_embeddings to false to "
                   "silence this)", head_key)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _local_name(key: str, prefix: str, config: GemmaTextConfig) -> str | None:
    """Model parameter name for a checkpoint key, or None for keys outside the text stack."""
    if key.startswith(prefix):
        return key[len(prefix) :]
    if not config.tie_word_embeddings and key in _HEAD_KEYS:
        return "lm_head.weight"
    return None


def _is_unused_shared_kv(local: str, config: GemmaTextConfig) -> bool:
    """True for k/v projections and norms that checkpoints carry for KV-shared layers (never used)."""
    parts = local.split(".")
    if len(parts) < 4 or parts[0] != "layers" or parts[2] != "self_attn":
        return False
    layer = int(parts[1])
    return not config.stores_kv(layer) and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm")
