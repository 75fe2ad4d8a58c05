"""`GraphPrefill`: prefill chunks over fixed buffers, replayed as CUDA graphs per padded shape.

An eager prefill of a few hundred tokens is bound by the host (E2B on the H200: ~5,700 aten calls, 53 ms of
wall time for 7.6 ms of kernels), so TTFT pays for dispatch. A chunk's forward can read only fixed buffers
and the pools, so it is captured once per padded shape and replayed:

- buffers: ``ids``, query ``positions``, ``last`` (index of the chunk's last real token, whose logits are
  returned), per group the flat pool slot each position writes (``write_slots``) and, for warm chunks, the
  slots and positions of every key the chunk's queries may see (``key_slots`` / ``key_positions``);
- a chunk of ``n`` tokens runs at the smallest bucket ``b >= n``; positions ``n..b-1`` are padding whose
  K/V (and that of positions a sliding group does not keep) go to the group's scratch block, never read back;
- *cold* chunk (empty row: no prefix hit, first chunk): the keys are the chunk's own, so attention is SDPA,
  causal (padding comes after every real token), with the window mask where the bucket exceeds the window;
- *warm* chunk (later chunks, prefix hits; no longer than the narrowest window): each storing layer writes
  the chunk's K/V into the pools, gathers its keys from the pools through ``key_slots`` (padded to a key
  bucket with scratch slots at position -1, which no query sees; padding queries repeat the last real
  position) and attends with the position mask (causal + window).

``eager`` attention swaps in the bitwise-transformers op sequence. ``use_graphs=False`` runs the same padded
forwards eagerly (CPU tests and the replay-parity reference). Results equal the paged prefill up to matmul
rounding (the padded shapes may pick other kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .graphs import StepGraphs
from .kv.decode_state import pick_bucket
from .kv.paged_cache import PagedKVCache
from .kv.pools import KVPools
from .models.attention_context import build_attention_mask, eager_attention, sdpa_attention
from .models.gemma import GemmaForCausalLM
from .settings import CustomTorchSettings

__all__ = ["GraphPrefill", "GraphPrefillContext", "WarmPrefillContext", "make_graph_prefill", "prefill_buckets"]

logger = logging.getLogger(__name__)


def prefill_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded chunk lengths up to ``max_tokens``: 16, 32, 48, 64, 96, 128, 192, 256, ... (each power of
    two and 1.5x it, so padding wastes at most a third), ending with ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes: list[int] = []
    size = smallest
    while size < max_tokens:
        sizes.append(size)
        if size * 3 // 2 < max_tokens and size >= 32:
            sizes.append(size * 3 // 2)
        size *= 2
    sizes.append(max_tokens)
    return tuple(sorted(set(sizes)))


class GraphPrefillContext:
    """`AttentionContext` of one padded cold chunk (B = 1, keys = the chunk's own). Writes every storing
    layer's K/V into its pools at ``slots[group]`` (one indexed write per layer) and attends over them."""

    def __init__(self, pools: KVPools, positions: Tensor, slots: dict[str, Tensor],
                 attention: Literal["eager", "sdpa"]) -> None:
        self.pools = pools
        self.config = pools.config
        self.positions = positions
        self.slots = slots
        self.attention = attention
        self._fresh: dict[int, tuple[Tensor, Tensor]] = {}
        self._masks: dict[int | None, Tensor] = {}

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        if source == layer_idx:
            assert k is not None and v is not None
            slots = self.slots[self.pools.group_of_layer[layer_idx]]
            k_pool, v_pool = self.pools.k[layer_idx], self.pools.v[layer_idx]
            k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k[0])
            v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v[0])
            self._fresh[layer_idx] = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
        keys, values = self._fresh[source]
        window = self.config.window_for_layer(layer_idx)
        length = q.shape[1]
        scale = self.config.attention_scale
        if window is not None and length <= window:
            window = None  # the window cannot bite inside the chunk: plain causal
        if self.attention == "sdpa" and window is None:
            out = sdpa_attention(q.transpose(1, 2), keys, values, None, scale, causal=True)
        else:
            mask = self._masks.get(window)
            if mask is None:
                mask = self._masks[window] = build_attention_mask(self.positions, self.positions, window)
            attend = sdpa_attention if self.attention == "sdpa" else eager_attention
            out = attend(q.transpose(1, 2), keys, values, mask, scale)
        return out.transpose(1, 2).contiguous()


class WarmPrefillContext:
    """`AttentionContext` of padded chunks of ``B`` rows that may already hold KV (the graph path: B = 1;
    `BatchedPrefill`: several rows). Every storing layer first writes the chunks' K/V into its pools at
    ``write_slots[group]`` [B, S], then gathers each row's keys from the pools at ``key_slots[group]`` [B, K]
    (the positions the row's queries may see, old and new; padding = a scratch slot at position -1, which no
    query sees) and attends with the position mask built from ``q_positions`` [B, S]."""

    def __init__(self, pools: KVPools, q_positions: Tensor, write_slots: dict[str, Tensor],
                 key_slots: dict[str, Tensor], key_positions: dict[str, Tensor],
                 attention: Literal["eager", "sdpa"]) -> None:
        self.pools = pools
        self.config = pools.config
        self.q_positions = q_positions
        self.write_slots = write_slots
        self.key_slots = key_slots
        self.key_positions = key_positions
        self.attention = attention
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}
        self._masks: dict[tuple[str, int | None], Tensor] = {}

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        group = self.pools.group_of_layer[layer_idx]
        if source == layer_idx:
            assert k is not None and v is not None
            k_flat = self.pools.k[layer_idx].view(-1, *self.pools.k[layer_idx].shape[2:])
            v_flat = self.pools.v[layer_idx].view(-1, *self.pools.v[layer_idx].shape[2:])
            writes = self.write_slots[group].reshape(-1)
            k_flat.index_copy_(0, writes, k.reshape(-1, *k.shape[2:]))
            v_flat.index_copy_(0, writes, v.reshape(-1, *v.shape[2:]))
            slots = self.key_slots[group]  # [B, K] -> keys [B, Hkv, K, D]
            self._kv[layer_idx] = (k_flat[slots].transpose(1, 2), v_flat[slots].transpose(1, 2))
        keys, values = self._kv[source]
        window = self.config.window_for_layer(layer_idx)
        mask = self._masks.get((group, window))
        if mask is None:
            mask = build_attention_mask(self.q_positions, self.key_positions[group], window)  # [B, S, K]
            self._masks[(group, window)] = mask
        attend = sdpa_attention if self.attention == "sdpa" else eager_attention
        out = attend(q.transpose(1, 2), keys, values, mask, self.config.attention_scale)
        return out.transpose(1, 2).contiguous()


MAX_GRAPH_PREFILL_KEYS = 16384
"""Most keys per group a captured warm chunk attends over; rows with a longer context prefill eagerly."""

MAX_WARM_GRAPHS = 64
"""Warm shapes (chunk bucket x key buckets) captured at most; further shapes run the padded forward eagerly,
so contexts of ever new lengths cannot keep paying first-use captures (~0.1 s each on the H200) forever."""


class GraphPrefill:
    """Prefill chunks of up to ``buckets[-1]`` tokens through fixed buffers (see the module docstring).
    Not thread-safe (backend lock). Logits returned by :meth:`prefill` are a fresh tensor.

    Cold chunk (empty row): key ``("cold", bucket, want_logits)``. Warm chunk (the row holds ``start``
    tokens; the chunk is no longer than the narrowest window, so it stores every position it computes):
    key ``("warm", bucket, key buckets per group, want_logits)``; sliding blocks leaving the window are
    released only after the forward (the chunk's first queries still read them), so the row briefly holds
    up to ``chunk / block_size`` extra sliding blocks; if a pool cannot supply them the chunk runs eagerly."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, *, buckets: Sequence[int],
                 attention: Literal["eager", "sdpa"], use_graphs: bool,
                 max_keys: int = MAX_GRAPH_PREFILL_KEYS, max_warm_graphs: int = MAX_WARM_GRAPHS) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        self.model = model
        self.pools = pools
        self.buckets = tuple(buckets)
        self.attention = attention
        device = next(iter(pools.k.values())).device
        self.device = device
        capacity = self.buckets[-1]
        self.groups = list(pools.groups)
        windows = [g.window for g in pools.groups.values() if g.window is not None]
        self.max_warm_tokens = min([capacity, *windows])
        self.key_buckets = prefill_buckets(max(max_keys, capacity + max(windows, default=0)))
        width = max(capacity, self.key_buckets[-1])
        # one staging copy per chunk; rows: ids, query positions, last index (first column), then per group the
        # write slots, then per group the key slots and key positions (warm chunks)
        num_groups = len(self.groups)
        self.io = torch.zeros((3 + 3 * num_groups, width), dtype=torch.int64, device=device)
        self.ids, self.q_positions, self.last = self.io[0, :capacity], self.io[1, :capacity], self.io[2, :1]
        self.write_slots = {g: self.io[3 + i, :capacity] for i, g in enumerate(self.groups)}
        self.key_slots = {g: self.io[3 + num_groups + i] for i, g in enumerate(self.groups)}
        self.key_positions = {g: self.io[3 + 2 * num_groups + i] for i, g in enumerate(self.groups)}
        self.graphs = StepGraphs(self._forward, "prefill") if use_graphs else None
        self.max_warm_graphs = max_warm_graphs
        self._warm_keys: set[tuple] = set()  # warm shapes captured so far
        self.chunks = 0  # chunks served (for stats and tests)
        self.warm_chunks = 0

    def applies(self, row: PagedKVCache, num_new: int) -> bool:
        """True if the chunk of ``num_new`` tokens appended to ``row`` can run here: a cold chunk up to the
        largest bucket, or a warm one up to the narrowest window whose keys fit ``max_keys`` per group."""
        if num_new <= 0 or num_new > self.buckets[-1]:
            return False
        if row.length == 0:
            return True
        if num_new > self.max_warm_tokens:
            return False
        end = row.length + num_new
        return all(end - first <= self.key_buckets[-1] for first in self.pools.first_visible(row.length))

    @torch.inference_mode()
    def prefill(self, row: PagedKVCache, token_ids: Sequence[int], *, want_logits: bool) -> Tensor | None:
        """Append ``token_ids`` to ``row`` (:meth:`applies` must hold); returns the last position's logits
        [1, vocab] if ``want_logits``. Raises KVCapacityError (row unchanged) if a pool lacks blocks. On any
        other exception the row's KV is undefined: free it."""
        num_new = len(token_ids)
        start = row.length
        bucket = pick_bucket(self.buckets, num_new)
        bs = self.pools.block_size
        cold = start == 0
        if cold:
            row.prepare_append(num_new)
            key_buckets: tuple[int, ...] = ()
            width = bucket
        else:
            row.prepare_append(num_new, release=False)  # the chunk's first queries still read those blocks
            firsts = self.pools.first_visible(start)
            key_buckets = tuple(pick_bucket(self.key_buckets, start + num_new - first) for first in firsts)
            width = max(bucket, *key_buckets)
        end = start + num_new
        staged = torch.zeros((self.io.shape[0], width), dtype=torch.int64)
        staged[0, :num_new] = torch.tensor(list(token_ids), dtype=torch.int64)
        staged[1, :bucket] = torch.arange(bucket) if cold else torch.arange(start, start + bucket).clamp_(max=end - 1)
        staged[2, 0] = num_new - 1
        groups = len(self.groups)
        for i, group in enumerate(self.groups):
            scratch = self.pools.scratch_block(group) * bs
            staged[3 + i, :bucket] = scratch
            write_from = row.write_start(group, num_new)
            if write_from < end:
                staged[3 + i, write_from - start:num_new] = row.slots(group, write_from, end)
            if not cold:
                first, keys = firsts[i], end - firsts[i]
                staged[3 + groups + i, :key_buckets[i]] = scratch
                staged[3 + groups + i, :keys] = row.slots(group, first, end)
                staged[3 + 2 * groups + i, :key_buckets[i]] = -1
                staged[3 + 2 * groups + i, :keys] = torch.arange(first, end)
        self.io[:, :width].copy_(staged)
        key = ("cold", bucket, want_logits) if cold else ("warm", bucket, key_buckets, want_logits)
        capture = self.graphs is not None and (
            cold or key in self._warm_keys or len(self._warm_keys) < self.max_warm_graphs)
        if capture and not cold:
            self._warm_keys.add(key)
        outputs = self.graphs.run(key) if capture else self._forward(key)
        row.commit_append(num_new)
        if not cold:
            row.release_out_of_window(0)
            self.warm_chunks += 1
        self.chunks += 1
        return outputs[0].clone() if want_logits else None

    def capture(self, buckets: Sequence[int] | None = None) -> dict[object, float]:
        """Capture the cold (bucket, logits wanted) graphs of ``buckets`` (default all) now, writing only the
        scratch blocks; returns seconds per key. Warm graphs are captured on first use. No-op without graphs."""
        if self.graphs is None:
            return {}
        with torch.inference_mode():
            for bucket in buckets or self.buckets:
                self.io.zero_()
                self.q_positions.copy_(torch.arange(self.q_positions.numel()))
                for group in self.groups:
                    self.write_slots[group].fill_(self.pools.scratch_block(group) * self.pools.block_size)
                for want_logits in (True, False):
                    if not self.graphs.has(("cold", bucket, want_logits)):
                        self.graphs.capture(("cold", bucket, want_logits))
        return dict(self.graphs.capture_seconds)

    def _forward(self, key: tuple) -> tuple[Tensor, ...]:
        bucket, want_logits = key[1], key[-1]
        positions = self.q_positions[:bucket]
        write_slots = {g: s[:bucket] for g, s in self.write_slots.items()}
        context: GraphPrefillContext | WarmPrefillContext
        if key[0] == "cold":
            context = GraphPrefillContext(self.pools, positions, write_slots, self.attention)
        else:
            sizes = dict(zip(self.groups, key[2]))
            context = WarmPrefillContext(
                self.pools, positions[None], {g: s[None] for g, s in write_slots.items()},
                {g: s[None, : sizes[g]] for g, s in self.key_slots.items()},
                {g: p[None, : sizes[g]] for g, p in self.key_positions.items()}, self.attention)
        hidden = self.model.forward_hidden(self.ids[None, :bucket], positions[None], context)
        if not want_logits:
            return (hidden[0, :1],)
        return (self.model.compute_logits(hidden[0].index_select(0, self.last)),)


MAX_GRAPH_PREFILL_TOKENS = 2048
"""Longest captured chunk: longer first chunks run eagerly (their dispatch cost is small next to their work)."""


def make_graph_prefill(model: GemmaForCausalLM, pools: KVPools, custom: CustomTorchSettings,
                       attention: Literal["eager", "sdpa"], chunk_tokens: int) -> GraphPrefill | None:
    """The backend's graph prefill: on CUDA with ``CUSTOM_BACKEND_PREFILL_GRAPH`` (default on), except for MoE
    models (host-side expert routing cannot be captured); None elsewhere. Captures every bucket now with
    ``CUSTOM_BACKEND_GRAPH_CAPTURE=startup``."""
    on_cuda = next(iter(pools.k.values())).device.type == "cuda"
    if not (custom.prefill_graph and on_cuda) or model.config.moe_num_experts > 0:
        return None
    graph_prefill = GraphPrefill(model, pools, buckets=prefill_buckets(min(chunk_tokens, MAX_GRAPH_PREFILL_TOKENS)),
                                 attention=attention, use_graphs=True)
    if custom.graph_capture == "startup":
        seconds = graph_prefill.capture()
        logger.info("custom_torch: captured %d prefill graphs in %.1f s", len(seconds), sum(seconds.values()))
    return graph_prefill
