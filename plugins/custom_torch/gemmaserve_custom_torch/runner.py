"""`PagedRunner`: the one-row eager prefill of the model over paged KV.

Prefill (one row, one chunk [start, end)): gather the sliding keys the chunk's first queries still see
(``first_visible(start)`` .. ``start``) *before* ``prepare_append`` frees out-of-window blocks, then run the
model with a `PagedPrefillContext`: each storing layer attends over (cached pages + the chunk's own fresh
K/V) with an explicit position mask (causal, plus ``q - W < k`` on sliding layers) and scatters the chunk's
stored positions into its pools with one indexed write. When no earlier keys exist the keys are exactly the
fresh ones, so with ``eager`` attention logits equal the contiguous reference bit for bit; ``sdpa`` (CUDA)
runs torch's fused kernels instead (plain causal when the chunk has no earlier keys and the window does
not bite, else the explicit mask).

The one-row prefill is the fallback of the one-forward tick (`MixedStep`) for a chunk whose sliding pool
cannot hold its old window and its new blocks at once: it gathers the old keys first, so it needs no headroom.
Decode steps are `MixedStep` ticks (decode-only batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .kv.paged_cache import PagedKVCache
from .kv.pools import KVPools
from .models.attention_context import build_attention_mask, eager_attention, sdpa_attention
from .models.gemma import GemmaForCausalLM

__all__ = ["PagedPrefillContext", "PagedRunner", "PrefillAttention"]

PrefillAttention = Literal["eager", "sdpa"]


class PagedPrefillContext:
    """`AttentionContext` of one prefill chunk of one row (B = 1). ``old`` holds, per sliding storing layer,
    the (keys, values) [1, Hkv, n, D] of positions [first_visible(start), start), gathered beforehand; full
    layers read positions [0, start) from the pools. Writes the chunk's K/V into the pools."""

    def __init__(self, pools: KVPools, row: PagedKVCache, start: int, num_new: int,
                 old: dict[int, tuple[Tensor, Tensor]], attention: PrefillAttention = "eager") -> None:
        self.pools = pools
        self.attention = attention
        self.config = pools.config
        self.row = row
        self.start = start
        self.num_new = num_new
        self.old = old
        self.device = next(iter(pools.k.values())).device
        self.q_positions = torch.arange(start, start + num_new, device=self.device)
        self._steps: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._old_slots: dict[str, Tensor] = {}  # per group: slots of [0, start) (full groups)
        self._new_slots: dict[str, Tensor] = {}  # per group: slots of the stored chunk positions

    def check_integrity(self) -> None:
        """Collected K/V span old keys + the chunk and end at the chunk's last position, per storing layer."""
        end = self.start + self.num_new
        for layer, (keys, values, k_positions) in self._steps.items():
            if keys.shape != values.shape or keys.shape[2] != k_positions.numel() or int(k_positions[-1]) != end - 1:
                raise RuntimeError(f"PagedPrefillContext: layer {layer} collected inconsistent K/V")

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        if source == layer_idx:
            assert k is not None and v is not None and k.shape[:2] == (1, self.num_new)
            self._steps[layer_idx] = self._store_and_collect(layer_idx, k, v)
        keys, values, k_positions = self._steps[source]
        window = self.config.window_for_layer(layer_idx)
        scale = self.config.attention_scale
        if self.attention == "sdpa" and keys.shape[2] == self.num_new and (window is None or self.num_new <= window):
            out = sdpa_attention(q.transpose(1, 2), keys, values, None, scale, causal=True)
            return out.transpose(1, 2).contiguous()
        mask = build_attention_mask(self.q_positions, k_positions, window)
        attend = sdpa_attention if self.attention == "sdpa" else eager_attention
        out = attend(q.transpose(1, 2), keys, values, mask, scale)
        return out.transpose(1, 2).contiguous()

    def _store_and_collect(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        group = self.pools.group_of_layer[layer]
        k_pool, v_pool = self.pools.k[layer], self.pools.v[layer]
        write_from = self.row.write_start(group, self.num_new)
        end = self.start + self.num_new
        if write_from < end:
            if group not in self._new_slots:
                self._new_slots[group] = self.row.slots(group, write_from, end, self.device)
            slots = self._new_slots[group]
            skip = write_from - self.start
            k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k[0, skip:])
            v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v[0, skip:])
        if layer in self.old:
            old_k, old_v = self.old[layer]
        else:
            if group not in self._old_slots:
                self._old_slots[group] = self.row.slots(group, 0, self.start, self.device)
            slots = self._old_slots[group]
            old_k = k_pool.view(-1, *k_pool.shape[2:])[slots].transpose(0, 1)[None]
            old_v = v_pool.view(-1, *v_pool.shape[2:])[slots].transpose(0, 1)[None]
        first = self.start - old_k.shape[2]
        k_positions = torch.arange(first, end, device=self.device)
        if old_k.shape[2] == 0:
            return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), k_positions
        keys = torch.cat([old_k, k.transpose(1, 2)], dim=2)
        values = torch.cat([old_v, v.transpose(1, 2)], dim=2)
        return keys, values, k_positions


class PagedRunner:
    """Runs one-row prefills of ``model`` over rows of ``pools``. Stateless between calls apart from the rows
    it mutates."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, prefill_attention: PrefillAttention = "eager") -> None:
        self.model = model
        self.pools = pools
        self.config = model.config
        self.prefill_attention = prefill_attention
        self.device = next(iter(pools.k.values())).device

    @torch.inference_mode()
    def prefill(self, row: PagedKVCache, token_ids: Sequence[int], *, want_logits: bool) -> Tensor | None:
        """Append ``token_ids`` (positions row.length ...) to ``row``; returns the last position's logits
        [1, vocab] if ``want_logits``. On an exception the row's KV is undefined: free it."""
        start, num_new = row.length, len(token_ids)
        assert num_new > 0
        old: dict[int, tuple[Tensor, Tensor]] = {}
        for name, group in self.pools.groups.items():
            if group.window is None:
                continue
            first = self.pools.geometry[name].first_visible(start)
            slots = row.slots(name, first, start, self.device)
            for layer in group.layers:
                k_pool, v_pool = self.pools.k[layer], self.pools.v[layer]
                old[layer] = (
                    k_pool.view(-1, *k_pool.shape[2:])[slots].transpose(0, 1)[None],
                    v_pool.view(-1, *v_pool.shape[2:])[slots].transpose(0, 1)[None],
                )
        row.prepare_append(num_new)
        context = PagedPrefillContext(self.pools, row, start, num_new, old, self.prefill_attention)
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
        hidden = self.model.forward_hidden(ids, context.q_positions[None], context)
        row.commit_append(num_new)
        return self.model.compute_logits(hidden[:, -1]) if want_logits else None
