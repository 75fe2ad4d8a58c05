"""`ForwardBatch`: one tick's tokens of many rows (prefill chunks and decode rows) packed for ONE forward, and
`RaggedPagedContext`, the attention context that runs it over the paged pools.

A batch is built in one place (:func:`build_forward_batch`) from rows whose blocks for the new positions are
already prepared (``PagedKVCache.prepare_append``; lengths not yet committed). Sequence ``s`` contributes
``n_s`` tokens at positions ``row.length ...``; tensors (on the pools' device):

- ``ids``, ``positions``: int64 ``[T]`` (tokens of sequence 0, then 1, ...);
- ``query_start``: int32 ``[S + 1]``; ``seq_lens``: int32 ``[S]`` = context after the tick (``length + n_s``);
- ``block_tables[group]``: int32 ``[S, width]`` (``-1`` = not held); ``write_slots[group]``: int64 ``[T]``,
  the flat pool slot each token's K/V goes to (the scratch block for positions the group does not keep);
- ``last_index``: int64 ``[S]``, each sequence's last token (whose logits a completed prompt or a decode
  row needs).

Every storing layer writes the batch's K/V with one indexed copy, then every layer attends through the block
tables with the ragged kernel (Triton) or its plain-torch reference (the portable path); fresh keys are read
back from the pools, so one kernel serves prefill and decode. From ``narrow_layer`` on (the KV-shared layers,
fast prefill) only the sequences' last tokens are computed: those layers attend as decode rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..kernels.ragged_reference import ragged_paged_attention_reference
from ..models.config import GemmaTextConfig
from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["ForwardBatch", "RaggedPagedContext", "build_forward_batch"]

RaggedAttention = Literal["triton", "reference"]


@dataclass(slots=True)
class ForwardBatch:
    """The packed tick (see the module docstring). ``query_lens`` is the host copy of ``n_s``."""

    ids: Tensor
    positions: Tensor
    query_start: Tensor
    seq_lens: Tensor
    block_tables: dict[str, Tensor]
    write_slots: dict[str, Tensor]
    last_index: Tensor
    query_lens: list[int]
    _tiles: dict[int, tuple[Tensor, Tensor, int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def tiles(self, block_m: int) -> tuple[Tensor, Tensor, int]:
        """The Triton kernel's query-tile map for tiles of ``block_m`` queries (built once per size)."""
        tiles = self._tiles.get(block_m)
        if tiles is None:
            from ..kernels.ragged_attention import query_tiles

            seqs, firsts = query_tiles(self.query_lens, block_m)
            both = torch.tensor([seqs, firsts], dtype=torch.int32).to(self.ids.device)
            tiles = self._tiles[block_m] = (both[0], both[1], len(seqs))
        return tiles

    def last_tokens(self, sequences: Tensor) -> ForwardBatch:
        """The batch of only the last token of each of ``sequences`` (int64 [S'] on the device): what the
        narrowed (KV-shared) layers attend with. It writes nothing (``write_slots`` empty)."""
        count = int(sequences.shape[0])
        return ForwardBatch(
            ids=self.ids[self.last_index[sequences]], positions=self.positions[self.last_index[sequences]],
            query_start=torch.arange(count + 1, dtype=torch.int32, device=self.ids.device),
            seq_lens=self.seq_lens[sequences].contiguous(),
            block_tables={g: t[sequences].contiguous() for g, t in self.block_tables.items()},
            write_slots={}, last_index=torch.arange(count, device=self.ids.device), query_lens=[1] * count,
        )


def build_forward_batch(pools: KVPools, rows: Sequence[PagedKVCache], tokens: Sequence[Sequence[int]],
                        device: torch.device) -> ForwardBatch:
    """Pack ``tokens[i]`` appended to ``rows[i]`` (prepared, not committed). One H2D copy per tensor kind."""
    if len(rows) != len(tokens) or not rows:
        raise ValueError(f"{len(rows)} rows for {len(tokens)} token lists")
    bs = pools.block_size
    lens = [len(t) for t in tokens]
    if min(lens) < 1:
        raise ValueError("every sequence of a forward batch needs at least one token")
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    last: list[int] = []
    for row, chunk in zip(rows, tokens):
        ids.extend(chunk)
        positions.extend(range(row.length, row.length + len(chunk)))
        starts.append(starts[-1] + len(chunk))
        last.append(starts[-1] - 1)
    width = max(max(len(t) for t in row.tables.values()) for row in rows)
    tables: dict[str, list[list[int]]] = {}
    slots: dict[str, list[int]] = {}
    for group in pools.groups:
        scratch = pools.scratch_block(group) * bs
        tables[group] = [row.tables[group] + [-1] * (width - len(row.tables[group])) for row in rows]
        group_slots: list[int] = []
        for row, n in zip(rows, lens):
            start, end = row.length, row.length + n
            write_from = row.write_start(group, n)
            group_slots.extend([scratch] * (write_from - start))
            if write_from < end:
                group_slots.extend(row.slots(group, write_from, end).tolist())
        slots[group] = group_slots
    groups = list(pools.groups)
    ints = torch.tensor([ids, positions, *(slots[g] for g in groups)], dtype=torch.int64).to(device)
    meta = torch.tensor([*starts, *(start + n for start, n in zip((r.length for r in rows), lens))],
                        dtype=torch.int32).to(device)
    table_tensor = torch.tensor([tables[g] for g in groups], dtype=torch.int32).to(device)
    return ForwardBatch(
        ids=ints[0], positions=ints[1], query_start=meta[: len(starts)], seq_lens=meta[len(starts):],
        block_tables={g: table_tensor[i] for i, g in enumerate(groups)},
        write_slots={g: ints[2 + i] for i, g in enumerate(groups)},
        last_index=torch.tensor(last, dtype=torch.int64).to(device), query_lens=lens,
    )


class RaggedPagedContext:
    """`AttentionContext` of one `ForwardBatch` (B = 1, S = T packed tokens). ``narrow``: from layer
    ``narrow[0]`` on the model computes only the last tokens of the sequences ``narrow[1]`` (int64 sequence
    indices; the model's own ``narrow`` takes their token indices, ``batch.last_index[narrow[1]]``) (fast prefill; those
    layers must store no K/V). ``attention``: the Triton kernels or the plain-torch reference."""

    def __init__(self, config: GemmaTextConfig, pools: KVPools, batch: ForwardBatch, attention: RaggedAttention,
                 narrow: tuple[int, Tensor] | None = None) -> None:
        self.config = config
        self.pools = pools
        self.batch = batch
        self.attention = attention
        self.narrow_layer = narrow[0] if narrow is not None else config.num_hidden_layers
        self.narrowed = batch.last_tokens(narrow[1]) if narrow is not None else None
        if narrow is not None and any(config.stores_kv(i) for i in range(narrow[0], config.num_hidden_layers)):
            raise ValueError(f"layers from {narrow[0]} on store K/V: they cannot be narrowed")
        self._ragged: Callable[..., Tensor] = ragged_paged_attention_reference
        self._decode: Callable[..., Tensor] | None = None
        if attention == "triton":
            from ..kernels.paged_attention import paged_decode_attention
            from ..kernels.ragged_attention import ragged_paged_attention

            self._ragged, self._decode = ragged_paged_attention, paged_decode_attention

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        group = self.pools.group_of_layer[layer_idx]
        k_pool, v_pool = self.pools.k[source], self.pools.v[source]
        if source == layer_idx:
            assert k is not None and v is not None and k.shape[1] == self.batch.num_tokens
            slots = self.batch.write_slots[group]
            k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k[0])
            v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v[0])
        window = self.config.window_for_layer(layer_idx) or 0
        scale = self.config.attention_scale
        batch = self.batch
        if layer_idx >= self.narrow_layer:
            assert self.narrowed is not None
            batch = self.narrowed
            if self._decode is not None:  # one query per sequence: the decode kernel
                out = self._decode(q[0].contiguous(), k_pool, v_pool, batch.block_tables[group], batch.seq_lens,
                                   scale=scale, window=window)
                return out[None]
        if self.attention == "triton":
            from ..kernels.ragged_attention import ragged_block_m

            block_m = ragged_block_m(q.shape[-1], q.shape[2] // k_pool.shape[2])
            out = self._ragged(q[0], k_pool, v_pool, batch.block_tables[group], batch.query_start, batch.seq_lens,
                               scale=scale, window=window, tiles=batch.tiles(block_m))
        else:
            out = self._ragged(q[0], k_pool, v_pool, batch.block_tables[group], batch.query_start, batch.seq_lens,
                               scale=scale, window=window)
        return out[None]
