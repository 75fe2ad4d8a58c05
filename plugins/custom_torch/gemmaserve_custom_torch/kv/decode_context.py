"""`DecodeBatchContext`: the attention of a decode-only `ForwardBatch` (every sequence one new token).

The model runs such a batch as ``[S, 1]`` (one row per sequence, as a decode step always did), so each layer
gets ``q [S, 1, Hq, D]``. Storing layers scatter their new K/V into the pools (one indexed write per layer,
through ``batch.write_slots``; or the model's fused q/k/v kernel writes them, through :meth:`kv_cache_target`),
then every layer attends over its group's paged KV:

- ``triton``: the paged DECODE kernel (``paged_decode_attention``; at one query per sequence it measured faster
  than the ragged kernel) over ``batch.block_tables`` / ``batch.seq_lens``: no host sync, graph-capturable;
- ``reference`` (the portable path): per group, gather each sequence's visible keys into a left-padded
  ``[S, Hkv, T, D]`` tensor (full: T = longest sequence; sliding: the rightmost ``min(T, W)`` positions) and
  run the model package's masked eager attention. It reads the longest length on the host
  (``batch.max_seq_len`` when the batch was built there, else one sync): eager only.

A sequence with ``seq_len`` 0 gets zeros from the kernel and is fully masked on the reference path (finite).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..models.attention_context import eager_attention
from ..models.config import GemmaTextConfig
from .pools import BatchKVWrites, KVPools

if TYPE_CHECKING:
    from .forward_batch import ForwardBatch, RaggedAttention

__all__ = ["DecodeBatchContext"]


class DecodeBatchContext:
    """`AttentionContext` of a decode-only ``batch`` over ``pools`` (see the module docstring). ``kernel``
    replaces ``paged_decode_attention`` on the ``triton`` path (any function with its signature). Writes the
    pools; holds per-group gathers of one forward (reference path)."""

    def __init__(self, config: GemmaTextConfig, pools: KVPools, batch: ForwardBatch, attention: RaggedAttention,
                 kernel: Callable[..., Tensor] | None = None) -> None:
        self.config = config
        self.pools = pools
        self.batch = batch
        self.attention = attention
        self._gathered: dict[int, tuple[Tensor, Tensor]] = {}
        self._gather_at: dict[str, tuple[Tensor, Tensor]] = {}
        self._kv = BatchKVWrites(pools, batch.write_slots)
        if attention == "triton" and kernel is None:
            from ..kernels.paged_attention import paged_decode_attention as kernel
        self._kernel = kernel

    def kv_cache_target(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The AttentionContext option (:meth:`BatchKVWrites.target`): a storing layer's caller writes its new K/V
        itself and passes none to :meth:`attend`."""
        return self._kv.target(layer_idx)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        group = self.pools.group_of_layer[layer_idx]
        k_pool, v_pool = self.pools.k[source], self.pools.v[source]
        assert k is None or k.shape[1] == 1, "a decode row brings one token"
        self._kv.store(layer_idx, k, v)
        scale = self.config.attention_scale
        if self._kernel is not None:
            window = self.config.window_for_layer(layer_idx) or 0
            out = self._kernel(q[:, 0].contiguous(), k_pool, v_pool, self.batch.block_tables[group],
                               self.batch.seq_lens, scale=scale, window=window)
            return out[:, None]
        if source not in self._gathered:
            slots, _ = self._gather_slots(group)
            keys = k_pool.view(-1, *k_pool.shape[2:])[slots].transpose(1, 2).contiguous()
            values = v_pool.view(-1, *v_pool.shape[2:])[slots].transpose(1, 2).contiguous()
            self._gathered[source] = (keys, values)
        keys, values = self._gathered[source]
        out = eager_attention(q.transpose(1, 2), keys, values, self._gather_slots(group)[1], scale)
        return out.transpose(1, 2).contiguous()

    def _gather_slots(self, group: str) -> tuple[Tensor, Tensor]:
        """(slots int64 [S, T], visible bool [S, 1, 1, T]) of ``group``'s left-padded gather (built once)."""
        if group not in self._gather_at:
            batch, bs = self.batch, self.pools.block_size
            longest = batch.max_seq_len if batch.max_seq_len is not None else int(batch.seq_lens.max())
            window = self.pools.geometry[group].window
            span = longest if window is None else min(longest, window)
            device = batch.seq_lens.device
            pos = batch.seq_lens.to(torch.int64)[:, None] - span + torch.arange(span, device=device)[None, :]
            blocks = batch.block_tables[group].gather(1, pos.clamp(min=0) // bs).to(torch.int64)
            valid = (pos >= 0) & (blocks >= 0)
            self._gather_at[group] = (torch.where(valid, blocks * bs + pos % bs, 0), valid[:, None, None, :])
        return self._gather_at[group]

    def check_integrity(self) -> None:
        """Every batch tensor has one entry per sequence; gathered K/V exist only for storing layers."""
        batch = self.batch
        rows = batch.ids.shape[0]
        tensors = [batch.positions, batch.seq_lens, *batch.block_tables.values(), *batch.write_slots.values(),
                   *(slots for slots, _ in self._gather_at.values())]
        if any(t.shape[0] != rows for t in tensors):
            raise RuntimeError("DecodeBatchContext: batch tensors disagree on the batch size")
        if any(not self.config.stores_kv(layer) for layer in self._gathered):
            raise RuntimeError("DecodeBatchContext: gathered K/V of a layer that stores none")
