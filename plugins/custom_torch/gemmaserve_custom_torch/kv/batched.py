"""`BatchedPagedKVCache`: the decoding rows, the per-step decode tensors, and the decode attention context.

Decode state lives in tensors (what a CUDA-graph path would keep as fixed buffers): token positions,
``seq_lens`` (int32, KV length including the token being decoded), one int32 block table per group
``[B, width]`` (-1 = sentinel / unused) and the write slot of each row's new token per group. Tables are
mirrored from the rows' Python lists and refreshed only for rows whose ``version`` changed.

Two attention paths, chosen per backend (``CUSTOM_BACKEND_ATTENTION``):

- ``gather`` (portable reference): per group, gather each row's visible keys into a left-padded
  ``[B, T, H, D]`` tensor (full: T = longest row; sliding: the rightmost ``min(T, W)`` positions) and run the
  masked eager attention of the model package;
- ``triton``: ``paged_decode_attention`` reads the pools through the block tables (window arg on sliding layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..models.attention_context import eager_attention
from ..models.config import GemmaTextConfig
from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["BatchedPagedKVCache", "DecodeState", "PagedDecodeContext"]


@dataclass(slots=True)
class DecodeState:
    """Tensors of one decode step (B rows, each decoding the token at ``positions[b]``)."""

    positions: Tensor  # int64 [B]
    seq_lens: Tensor  # int32 [B] = positions + 1
    block_tables: dict[str, Tensor]  # int32 [B, width] per group
    write_slots: dict[str, Tensor]  # int64 [B] flat pool slot of the new token, per group
    gather_slots: dict[str, Tensor]  # int64 [B, T_g] (gather path only; padded entries point at slot 0)
    gather_mask: dict[str, Tensor]  # bool [B, 1, 1, T_g], True = real key


class BatchedPagedKVCache:
    """Rows in batch order (``pop`` behaves like ``list.pop``). Owns its rows: ``pop`` hands one back."""

    def __init__(self, pools: KVPools, device: torch.device) -> None:
        self.pools = pools
        self.device = device
        self.rows: list[PagedKVCache] = []
        self._host = {g: torch.full((0, 1), -1, dtype=torch.int32) for g in pools.groups}
        self._versions: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, row: PagedKVCache) -> None:
        assert not row.freed and row.length > 0, "only live, non-empty rows join a batch"
        self.rows.append(row)
        self._versions.append(-1)
        for group, host in self._host.items():
            self._host[group] = torch.cat([host, torch.full((1, host.shape[1]), -1, dtype=torch.int32)])

    def pop(self, index: int) -> PagedKVCache:
        row = self.rows.pop(index)
        del self._versions[index]
        for group, host in self._host.items():
            self._host[group] = torch.cat([host[:index], host[index + 1 :]])
        return row

    def block_tables(self) -> dict[str, Tensor]:
        """int32 [B, width] table per group on the device (-1 = sentinel), refreshed for changed rows."""
        width = max(len(t) for row in self.rows for t in row.tables.values())
        for group, host in self._host.items():
            if host.shape[1] < width:
                grown = torch.full((host.shape[0], max(width, 2 * host.shape[1])), -1, dtype=torch.int32)
                grown[:, : host.shape[1]] = host
                self._host[group] = grown
        for index, row in enumerate(self.rows):
            if self._versions[index] != row.version:
                for group, table in row.tables.items():
                    line = self._host[group][index]
                    line.fill_(-1)
                    line[: len(table)] = torch.tensor(table, dtype=torch.int32)
                self._versions[index] = row.version
        return {group: host.to(self.device) for group, host in self._host.items()}

    def prepare_step(self, *, gather: bool) -> DecodeState:
        """Decode tensors for the step that writes position ``row.length`` of every row; call after every
        row's ``prepare_append(1)``."""
        bs = self.pools.block_size
        lengths = [row.length for row in self.rows]
        positions = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        seq_lens = (positions + 1).to(torch.int32)
        tables = self.block_tables()
        write_slots: dict[str, Tensor] = {}
        gather_slots: dict[str, Tensor] = {}
        gather_mask: dict[str, Tensor] = {}
        for group, table in tables.items():
            blocks = table.gather(1, (positions // bs)[:, None]).to(torch.int64)[:, 0]
            write_slots[group] = blocks * bs + positions % bs
            if gather:
                window = self.pools.geometry[group].window
                span = max(lengths) + 1 if window is None else min(max(lengths) + 1, window)
                pos = seq_lens.to(torch.int64)[:, None] - span + torch.arange(span, device=self.device)[None, :]
                blocks = table.gather(1, (pos.clamp(min=0) // bs)).to(torch.int64)
                valid = (pos >= 0) & (blocks >= 0)
                gather_slots[group] = torch.where(valid, blocks * bs + pos % bs, 0)
                gather_mask[group] = valid[:, None, None, :]
        return DecodeState(positions, seq_lens, tables, write_slots, gather_slots, gather_mask)

    def check_integrity(self) -> None:
        """Rows are live and distinct; refreshed table mirrors equal the rows' tables."""
        if len(set(map(id, self.rows))) != len(self.rows) or any(row.freed for row in self.rows):
            raise RuntimeError("BatchedPagedKVCache: a row is duplicated or already freed")
        for group, host in self._host.items():
            if host.shape[0] != len(self.rows):
                raise RuntimeError(f"BatchedPagedKVCache: {group} mirror rows {host.shape[0]} != {len(self.rows)}")
            for index, row in enumerate(self.rows):
                if self._versions[index] == row.version:
                    table = row.tables[group]
                    if host[index, : len(table)].tolist() != table or bool((host[index, len(table) :] != -1).any()):
                        raise RuntimeError(f"BatchedPagedKVCache: row {index} {group} mirror is stale")


class PagedDecodeContext:
    """`AttentionContext` of one batched decode step (S = 1): storing layers scatter their new K/V into the
    pools (one indexed write per layer), then every layer attends over its group's paged KV.

    ``mode="triton"`` calls ``kernel`` (default: the Triton ``paged_decode_attention``; any function with its
    signature works, e.g. ``paged_decode_attention_reference`` on CPU) with the state's block tables."""

    def __init__(
        self, config: GemmaTextConfig, pools: KVPools, state: DecodeState, mode: Literal["gather", "triton"],
        kernel: Callable[..., Tensor] | None = None,
    ) -> None:
        self.config = config
        self.pools = pools
        self.state = state
        self.mode = mode
        self._gathered: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "triton":
            if kernel is None:
                from ..kernels.paged_attention import paged_decode_attention as kernel
            self._kernel = kernel

    def check_integrity(self) -> None:
        """Every step tensor has one entry per row; gathered K/V exist only for storing layers."""
        rows = self.state.positions.shape[0]
        tensors = [self.state.seq_lens, *self.state.block_tables.values(), *self.state.write_slots.values(),
                   *self.state.gather_slots.values(), *self.state.gather_mask.values()]
        if any(t.shape[0] != rows for t in tensors):
            raise RuntimeError("PagedDecodeContext: step tensors disagree on the batch size")
        if any(not self.config.stores_kv(layer) for layer in self._gathered):
            raise RuntimeError("PagedDecodeContext: gathered K/V of a layer that stores none")

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        group = self.pools.group_of_layer[layer_idx]
        k_pool, v_pool = self.pools.k[source], self.pools.v[source]
        if source == layer_idx:
            assert k is not None and v is not None and k.shape[1] == 1
            slots = self.state.write_slots[group]
            k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k[:, 0])
            v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v[:, 0])
        window = self.config.window_for_layer(layer_idx)
        scale = self.config.attention_scale
        if self.mode == "triton":
            out = self._kernel(
                q[:, 0].contiguous(), k_pool, v_pool, self.state.block_tables[group], self.state.seq_lens,
                scale=scale, window=window or 0,
            )
            return out[:, None]
        if source not in self._gathered:
            slots = self.state.gather_slots[group]
            keys = k_pool.view(-1, *k_pool.shape[2:])[slots].transpose(1, 2).contiguous()
            values = v_pool.view(-1, *v_pool.shape[2:])[slots].transpose(1, 2).contiguous()
            self._gathered[source] = (keys, values)
        keys, values = self._gathered[source]
        out = eager_attention(q.transpose(1, 2), keys, values, self.state.gather_mask[group], scale)
        return out.transpose(1, 2).contiguous()
