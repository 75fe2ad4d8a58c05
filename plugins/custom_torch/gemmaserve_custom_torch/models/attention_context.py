"""The model <-> KV-cache interface (`AttentionContext`) and its contiguous reference implementation.

The model computes Q/K/V; an `AttentionContext` owns everything about *which* keys a query sees: storage,
positions, masks, padding, KV sharing. Contract of `attend(layer_idx, q, k, v)`:

* q [B, S, Hq, D] after q_norm + RoPE; k, v [B, S, Hkv, D] after k_norm + RoPE / v_norm (no RoPE on v), in the
  model dtype. For KV-shared layers (`config.kv_source_layer[layer_idx] != layer_idx`) k and v are None and
  the context must use the K/V of the source layer from the same forward (including its cached past).
* Returns the attention output [B, S, Hq, D], contiguous, in q's dtype.
* Optionally a context has ``kv_cache_target(layer_idx) -> (k_cache, v_cache, slots) | None``: where a storing
  layer's new K/V go (caches of contiguous rows [Hkv, D], int64 slots [B * S], one per token in order). A caller
  that takes a target must write that layer's k and v there itself before ``attend``, and then passes k = v =
  None to it (the fused q/k/v kernel writes them in the launch that computes them).
* Scale (`config.attention_scale`), sliding window, layer type and GQA ratio come from the config the
  context holds. Layers are called in increasing `layer_idx` order within one forward.

Pure helpers `build_attention_mask`, `eager_attention` (bitwise transformers eager) and `sdpa_attention`
(torch's fused SDPA kernels, for CUDA prefill) are shared with other (paged) implementations.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import GemmaTextConfig


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor: ...


def build_attention_mask(q_positions: Tensor, k_positions: Tensor, window: int | None) -> Tensor:
    """Boolean visibility mask [..., S, K] (True = the query may attend to the key).

    q_positions [..., S], k_positions [..., K] (integer, broadcastable leading dims). A key is visible iff
    0 <= k_pos <= q_pos and, with a window W, q_pos - W < k_pos. Negative positions mark padding: a negative
    key is never visible; a negative query sees nothing (its output is then finite garbage, never NaN).
    """
    q = q_positions[..., :, None]
    k = k_positions[..., None, :]
    visible = (k <= q) & (k >= 0)
    if window is not None:
        visible &= k > q - window
    return visible


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, Hkv, K, D] -> [B, Hkv * n_rep, K, D], each KV head repeated n_rep times consecutively."""
    if n_rep == 1:
        return x
    b, h, k, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, k, d).reshape(b, h * n_rep, k, d)


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None = None
) -> Tensor:
    """Softmax attention as transformers' eager path computes it (bitwise).

    q [B, Hq, S, D]; k, v [B, Hkv, K, D]; mask bool (True = visible) or None: [S, K], [B, S, K] (shared by
    all heads) or anything broadcastable to [B, Hq, S, K] given as 4-D.
    Scores are computed in the input dtype, masked additively with finfo(dtype).min, softmaxed in fp32 and
    cast back; returns [B, Hq, S, D] in q's dtype. For bitwise parity with transformers pass q as a
    `[B, S, Hq, D]` tensor transposed to head-major and k/v contiguous in `[B, Hkv, K, D]`.
    """
    num_heads, num_kv = q.shape[1], k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} KV heads.")
    n_rep = num_heads // num_kv
    keys = repeat_kv(k, n_rep)
    values = repeat_kv(v, n_rep)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dim() == 3:
            mask = mask[:, None]
        additive = torch.full(mask.shape, torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        scores = scores + additive.masked_fill_(mask, 0.0)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, *, causal: bool = False
) -> Tensor:
    """`eager_attention`'s contract through ``F.scaled_dot_product_attention`` (not bitwise equal to it).

    K/V heads are repeated to the query heads first (torch's memory-efficient and cuDNN kernels, which take
    an explicit mask and head dim 512, do not take GQA). ``causal=True`` with ``mask=None`` needs S == K
    (lets a flash kernel run where the head dim allows). Returns [B, Hq, S, D] in q's dtype.
    """
    num_heads, num_kv = q.shape[1], k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} KV heads.")
    if causal and (mask is not None or q.shape[2] != k.shape[2]):
        raise ValueError("causal SDPA takes no mask and needs as many keys as queries")
    keys, values = repeat_kv(k, num_heads // num_kv), repeat_kv(v, num_heads // num_kv)
    if mask is not None and mask.dim() == 3:
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale)


class _StepKV:
    """K/V a storing layer attended with in the current forward (cache + new), for its KV-sharing consumers."""

    __slots__ = ("k_positions", "keys", "q_positions", "values")

    def __init__(self, keys: Tensor, values: Tensor, k_positions: Tensor, q_positions: Tensor) -> None:
        self.keys = keys
        self.values = values
        self.k_positions = k_positions
        self.q_positions = q_positions


class ContiguousKVContext:
    """Reference (not paged) `AttentionContext` for B rows of equal length, no padding.

    Keeps, per KV-storing layer, contiguous K/V [B, Hkv, K, D] and the positions of those keys. Each forward
    appends the new tokens, so one instance serves a prefill followed by step-by-step decode. Tokens are at
    consecutive positions starting at 0: the caller must pass `positions = ctx.next_positions(B, S)` to the
    model. Sliding layers keep only their last W-1 keys after each call (what transformers' dynamic sliding
    cache keeps); the current call still sees cache + all new keys, masked by causality and the window.
    Mutates itself on every `attend` of a storing layer; not thread-safe.
    """

    def __init__(self, config: GemmaTextConfig) -> None:
        self.config = config
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}
        self._positions: dict[int, Tensor] = {}
        self._seen: dict[int, int] = {}
        self._step: dict[int, _StepKV] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far (per row)."""
        first = self.config.kv_storing_layers[0]
        return self._seen.get(first, 0)

    def next_positions(self, batch_size: int, num_tokens: int, device: torch.device | str = "cpu") -> Tensor:
        """Positions [B, S] (int64) the next forward of `num_tokens` tokens per row must use."""
        start = self.num_tokens
        row = torch.arange(start, start + num_tokens, dtype=torch.long, device=device)
        return row.expand(batch_size, num_tokens)

    def reset(self) -> None:
        """Drop all cached K/V."""
        for store in (self._keys, self._values, self._positions, self._seen, self._step):
            store.clear()

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        config = self.config
        source = config.kv_source_layer[layer_idx]
        if source == layer_idx:
            if k is None or v is None:
                raise ValueError(f"layer {layer_idx} stores KV, so attend() needs k and v.")
            step = self._append(layer_idx, k, v)
        else:
            if k is not None or v is not None:
                raise ValueError(f"layer {layer_idx} reuses the KV of layer {source}; pass k=v=None.")
            step = self._step.get(source)
            if step is None or step.q_positions.numel() != q.shape[1]:
                raise RuntimeError(
                    f"layer {layer_idx} needs the KV of layer {source} from the same forward, which has not run."
                )
        mask = build_attention_mask(step.q_positions, step.k_positions, config.window_for_layer(layer_idx))
        out = eager_attention(q.transpose(1, 2), step.keys, step.values, mask, config.attention_scale)
        return out.transpose(1, 2).contiguous()

    def _append(self, layer_idx: int, k: Tensor, v: Tensor) -> _StepKV:
        num_new = k.shape[1]
        seen = self._seen.get(layer_idx, 0)
        q_positions = torch.arange(seen, seen + num_new, dtype=torch.long, device=k.device)
        new_k, new_v = k.transpose(1, 2), v.transpose(1, 2)
        if layer_idx in self._keys:
            keys = torch.cat([self._keys[layer_idx], new_k], dim=2)
            values = torch.cat([self._values[layer_idx], new_v], dim=2)
            k_positions = torch.cat([self._positions[layer_idx], q_positions])
        else:
            keys, values, k_positions = new_k.contiguous(), new_v.contiguous(), q_positions
        window = self.config.window_for_layer(layer_idx)
        keep = keys.shape[2] if window is None else min(keys.shape[2], window - 1)
        start = keys.shape[2] - keep
        self._keys[layer_idx] = keys[:, :, start:]
        self._values[layer_idx] = values[:, :, start:]
        self._positions[layer_idx] = k_positions[start:]
        self._seen[layer_idx] = seen + num_new
        step = _StepKV(keys, values, k_positions, q_positions)
        self._step[layer_idx] = step
        return step
