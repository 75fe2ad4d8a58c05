"""`GraphPrefill`: cold prefill chunks over fixed buffers, replayed as CUDA graphs per length bucket.

An eager prefill of a few hundred tokens is bound by the host (E2B on the H200: ~5,700 aten calls, 53 ms of
wall time for 7.6 ms of kernels), so TTFT pays for dispatch. A *cold* chunk (the row is empty: no prefix hit,
first chunk of the prompt) needs no earlier keys, so its forward reads only fixed buffers and the pools and
can be captured once per padded length and replayed:

- buffers: ``ids`` and constant ``positions`` 0..capacity-1, per group the flat pool ``slots`` each position
  writes, and ``last`` (index of the chunk's last real token, whose logits are returned);
- a chunk of ``n`` tokens runs at the smallest bucket ``b >= n``: positions ``n..b-1`` are padding. They come
  after every real token, so causal attention hides them from the real queries; their K/V (and the K/V of
  positions a sliding group does not keep) go to the group's scratch block, which nothing reads back;
- attention per layer: SDPA over the chunk's fresh keys, causal, with the window mask where the bucket is
  longer than the window (``eager`` attention on request, the bitwise-transformers op sequence).

``use_graphs=False`` runs the same padded forward eagerly (CPU tests and the replay-parity reference).
Results equal the paged prefill up to matmul rounding (the padded shapes may pick other kernels).
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

__all__ = ["GraphPrefill", "GraphPrefillContext", "make_graph_prefill", "prefill_buckets"]

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


class GraphPrefill:
    """Cold prefill chunks of up to ``buckets[-1]`` tokens through fixed buffers (see the module docstring).
    Not thread-safe (backend lock). Logits returned by :meth:`prefill` are a fresh tensor."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, *, buckets: Sequence[int],
                 attention: Literal["eager", "sdpa"], use_graphs: bool) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        self.model = model
        self.pools = pools
        self.buckets = tuple(buckets)
        self.attention = attention
        device = next(iter(pools.k.values())).device
        self.device = device
        capacity = self.buckets[-1]
        groups = list(pools.groups)
        # one staging copy per chunk: row 0 ids, row 1 the last index (first column), rows 2.. slots per group
        self.io = torch.zeros((2 + len(groups), capacity), dtype=torch.int64, device=device)
        self.ids = self.io[0]
        self.last = self.io[1, :1]
        self.slots = {group: self.io[2 + i] for i, group in enumerate(groups)}
        self.positions = torch.arange(capacity, dtype=torch.int64, device=device)
        self.graphs = StepGraphs(self._forward, "prefill") if use_graphs else None
        self.chunks = 0  # chunks served (for stats and tests)

    def applies(self, row: PagedKVCache, num_new: int) -> bool:
        """True for a cold chunk: ``row`` is empty and the chunk fits the largest bucket."""
        return row.length == 0 and 0 < num_new <= self.buckets[-1]

    @torch.inference_mode()
    def prefill(self, row: PagedKVCache, token_ids: Sequence[int], *, want_logits: bool) -> Tensor | None:
        """Write positions [0, n) of the empty ``row``; returns the last position's logits [1, vocab] if
        ``want_logits``. On an exception the row's KV is undefined: free it."""
        num_new = len(token_ids)
        assert self.applies(row, num_new)
        bucket = pick_bucket(self.buckets, num_new)
        row.prepare_append(num_new)
        bs = self.pools.block_size
        staged = torch.zeros((self.io.shape[0], bucket), dtype=torch.int64)
        staged[0, :num_new] = torch.tensor(list(token_ids), dtype=torch.int64)
        staged[1, 0] = num_new - 1
        for i, group in enumerate(self.slots):
            staged[2 + i] = self.pools.scratch_block(group) * bs
            write_from = row.write_start(group, num_new)
            if write_from < num_new:
                staged[2 + i, write_from:num_new] = row.slots(group, write_from, num_new)
        self.io[:, :bucket].copy_(staged, non_blocking=False)
        key = (bucket, want_logits)
        outputs = self.graphs.run(key) if self.graphs is not None else self._forward(key)
        row.commit_append(num_new)
        self.chunks += 1
        return outputs[0].clone() if want_logits else None

    def capture(self, buckets: Sequence[int] | None = None) -> dict[object, float]:
        """Capture the (bucket, logits wanted) graphs of ``buckets`` (default all) now, writing only the
        scratch blocks; returns seconds per key. No-op without graphs."""
        if self.graphs is None:
            return {}
        with torch.inference_mode():
            for bucket in buckets or self.buckets:
                self.io.zero_()
                for i, group in enumerate(self.slots):
                    self.io[2 + i].fill_(self.pools.scratch_block(group) * self.pools.block_size)
                for want_logits in (True, False):
                    if not self.graphs.has((bucket, want_logits)):
                        self.graphs.capture((bucket, want_logits))
        return dict(self.graphs.capture_seconds)

    def _forward(self, key: tuple[int, bool]) -> tuple[Tensor, ...]:
        bucket, want_logits = key
        positions = self.positions[:bucket]
        context = GraphPrefillContext(self.pools, positions, {g: s[:bucket] for g, s in self.slots.items()},
                                      self.attention)
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
