"""KV blocks of the core prefix cache <-> this backend's KV arrays.

Pools (one K and one V per KV-owning layer) are mlx arrays [num_blocks, block_size, kv_heads, dim];
block ``b`` slot ``s`` holds the KV of token ``k*block_size + s`` of whatever sequence the core
``CacheManager`` filed under ``b``. Reads gather whole blocks and writes scatter whole token ranges:
one indexed copy per pool, whatever the number of blocks. Sliding-window layers are stored in full,
so any cached prefix can be resumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from gemmaserve_mlx.layout import KVLayout

if TYPE_CHECKING:
    from gemmaserve.kv.cache_manager import BlockWrite

    from gemmaserve_mlx.kv_batch import KVBatch

__all__ = ["KVPools"]


class KVPools:
    """Per-layer K/V block pools for ``num_blocks`` blocks of ``block_size`` tokens. Owned by the
    backend; mutated only by :meth:`write`."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = [mx.zeros((num_blocks, block_size, s.kv_heads, s.key_dim), layout.dtype) for s in layout.layers]
        self.values = [
            mx.zeros((num_blocks, block_size, s.kv_heads, s.value_dim), layout.dtype) for s in layout.layers
        ]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def read(self, block_ids: Sequence[int], num_tokens: int) -> list[tuple[mx.array, mx.array]]:
        """Copies of the first ``num_tokens`` tokens held by ``block_ids`` (in token order), per layer
        as (keys, values) [1, kv_heads, num_tokens, dim]. Evaluated, so the blocks may change after."""
        assert 0 < num_tokens <= len(block_ids) * self.block_size
        assert num_tokens > (len(block_ids) - 1) * self.block_size, "more blocks than tokens"
        index = mx.array(list(block_ids), dtype=mx.int32)
        out = []
        for keys, values in zip(self.keys, self.values, strict=True):
            out.append((_tokens(keys, index, num_tokens), _tokens(values, index, num_tokens)))
        mx.eval(out)
        return out

    def write(self, kv: KVBatch, writes: Sequence[BlockWrite]) -> None:
        """Copy the KV of each write's token range from the one-row prefill KV ``kv`` into its block."""
        if not writes:
            return
        source: list[int] = []
        target: list[int] = []
        for write in writes:
            assert 0 < write.num_tokens <= self.block_size and 0 <= write.block_id < self.num_blocks
            source.extend(range(write.token_start, write.token_end))
            target.extend(range(write.block_id * self.block_size, write.block_id * self.block_size + write.num_tokens))
        assert max(source) < kv.lengths[0], "writes past the prompt's KV"
        source_index = mx.array(source, dtype=mx.int32)
        target_index = mx.array(target, dtype=mx.int32)
        for layer in range(len(self.layout.layers)):
            row_keys, row_values = kv.row_columns(layer)
            self.keys[layer] = _scatter(self.keys[layer], target_index, row_keys[source_index])
            self.values[layer] = _scatter(self.values[layer], target_index, row_values[source_index])
        mx.eval(self.keys, self.values)

    def check_integrity(self) -> None:
        """Raise RuntimeError if a pool's shape or dtype left the layout."""
        for pools, dim_of in ((self.keys, "key_dim"), (self.values, "value_dim")):
            for pool, spec in zip(pools, self.layout.layers, strict=True):
                expected = (self.num_blocks, self.block_size, spec.kv_heads, getattr(spec, dim_of))
                if tuple(pool.shape) != expected or pool.dtype != self.layout.dtype:
                    raise RuntimeError(f"KVPools: pool {tuple(pool.shape)} {pool.dtype} != {expected}")


def _tokens(pool: mx.array, index: mx.array, num_tokens: int) -> mx.array:
    blocks = pool[index]  # [n_blocks, block_size, heads, dim]
    flat = blocks.reshape(-1, pool.shape[2], pool.shape[3])[:num_tokens]
    return mx.contiguous(flat.transpose(1, 0, 2)[None])


def _scatter(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    flat = pool.reshape(-1, pool.shape[2], pool.shape[3])
    flat[slots] = rows
    return flat.reshape(pool.shape)
