"""Per-layer K/V pools, grouped by attention type, and the window rule that bounds sliding storage.

Layout. Layers are grouped by type: all *storing* sliding layers form the ``sliding_attention`` group, all
storing full layers the ``full_attention`` group (KV-shared layers store nothing: they read their
``config.kv_source_layer`` producer). Each group has one block-id space (a ``BlockManager``) and, per storing
layer ``l``, two tensors ``k[l]``, ``v[l]`` of shape ``[num_blocks_g, block_size, kv_heads_l, head_dim_l]``:
block id ``b`` of group ``g`` is slot ``b`` in every pool of ``g``. Token ``p`` of a row lives in logical
block ``p // block_size`` at offset ``p % block_size``; a row's block table maps logical -> physical id, with
``-1`` for "not held" (freed out-of-window sliding blocks). Pools are zero-initialised (never NaN), so masked
reads of stale slots are harmless. Every pool has one extra *scratch* block (id ``scratch_block(group)`` =
the group's block count) that no manager hands out: padding rows of a fixed-size (CUDA-graph) decode write
and read there.

Window rule (``GroupGeometry``, W = window, bs = block size), for a row whose KV covers positions [0, n):

- a query at position q sees keys q-W < k <= q, so the next query needs keys >= ``first_visible(n)`` = n-W+1;
- the row *keeps* sliding blocks from ``keep_from(n)`` = (n//bs)*bs - W on: what a block-aligned prefix hit
  at (n//bs)*bs needs even when it must recompute its last token (that query sees keys >= (n//bs)*bs - W);
- so a row never holds more than ``ceil(W/bs) + 1`` sliding blocks (``max_blocks``): W//bs + 1 when bs | W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gemmaserve.errors import ConfigurationError, KVCapacityError
from gemmaserve.kv.block_manager import BlockManager

from ..models.config import FULL, SLIDING, GemmaTextConfig

__all__ = ["BatchKVWrites", "GroupGeometry", "KVGroupSpec", "KVPools", "kv_groups", "plan_pool_sizes",
           "plan_pools_for_settings", "reference_tokens"]

Reclaimer = Callable[[str, int], None]
"""``reclaim(group, num_blocks)``: try to free that many blocks of ``group`` (the prefix cache evicts)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Block size and window (None = full attention) of one group; pure position arithmetic."""

    block_size: int
    window: int | None

    def first_visible(self, n: int) -> int:
        """First key position a query at position ``n`` attends to."""
        return 0 if self.window is None else max(0, n - self.window + 1)

    def keep_from(self, n: int) -> int:
        """First position whose block a row covering [0, n) keeps (blocks wholly before it are freed)."""
        return 0 if self.window is None else max(0, (n // self.block_size) * self.block_size - self.window)

    def max_blocks(self, num_tokens: int) -> int:
        """Most blocks a row of up to ``num_tokens`` tokens ever holds (the admission footprint)."""
        full = _cdiv(num_tokens, self.block_size)
        return full if self.window is None else min(full, _cdiv(self.window, self.block_size) + 1)


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One group: its layer type, window, and storing layers with their (kv_heads, head_dim)."""

    name: str
    window: int | None
    layers: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        return sum(2 * block_size * heads * dim * itemsize for heads, dim in self.shapes)


def kv_groups(config: GemmaTextConfig) -> tuple[KVGroupSpec, ...]:
    """Groups of ``config``'s storing layers, sliding first; a type with no storing layer has no group."""
    groups = []
    for layer_type in (SLIDING, FULL):
        layers = tuple(i for i in config.kv_storing_layers if config.layer_types[i] == layer_type)
        if layers:
            shapes = tuple((config.num_kv_heads[i], config.head_dims[i]) for i in layers)
            window = config.sliding_window if layer_type == SLIDING else None
            groups.append(KVGroupSpec(layer_type, window, layers, shapes))
    return tuple(groups)


def _pool_maxima(sliding: KVGroupSpec, block_size: int, *, max_rows: int, max_active_tokens: int, max_len: int,
                 sliding_headroom_tokens: int) -> tuple[int, int]:
    """(sliding, full): the most blocks of each group that the scheduler's limits let requests use. Full: every
    admitted request reserves ``ceil(n / bs)`` blocks, at most ``MAX_BATCH_SIZE`` of them hold reservations and
    their tokens sum to at most ``MAX_ACTIVE_KV_TOKENS`` (nor is one longer than ``max_len``). Sliding: each of
    ``max_rows`` rows holds at most its window's blocks plus the headroom of a prefill chunk, and never more
    than its full blocks plus that headroom."""
    headroom = _cdiv(sliding_headroom_tokens, block_size)
    full_max = min(_cdiv(max_active_tokens, block_size) + max_rows, max_rows * _cdiv(max_len, block_size))
    window = GroupGeometry(block_size, sliding.window).max_blocks(max_len)
    return min(max_rows * (window + headroom), full_max + max_rows * headroom), full_max


def reference_tokens(
    groups: Sequence[KVGroupSpec], block_size: int, itemsize: int, budget_bytes: int, *, max_rows: int,
    max_active_tokens: int, max_len: int,
) -> int:
    """The request length at which the default split makes the sliding and full pools run out together:
    ``min(max_len, ceil(max_active_tokens / max_rows))`` (the average request length at which the scheduler's
    row and token limits bind together), shortened in whole blocks until ``max_rows`` requests of that length
    fit in the budget at once (never below one block). Groups without both types: the same rule (it then
    only informs)."""
    per_block = {g.name: g.bytes_per_block(block_size, itemsize) for g in groups}
    window = next((g.window for g in groups if g.name == SLIDING), None)
    geometry = GroupGeometry(block_size, window)
    cap = max(1, min(max_len, _cdiv(max_active_tokens, max_rows)))

    def fits(blocks: int) -> bool:  # max_rows requests of ``blocks`` full blocks (and their window) fit
        tokens = min(cap, blocks * block_size)
        need = per_block.get(FULL, 0) * _cdiv(tokens, block_size)
        need += per_block.get(SLIDING, 0) * geometry.max_blocks(tokens)
        return max_rows * need <= budget_bytes

    low, high = 1, _cdiv(cap, block_size)  # the largest fitting block count in [low, high], or low
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return min(cap, low * block_size)


def plan_pool_sizes(
    groups: Sequence[KVGroupSpec],
    block_size: int,
    itemsize: int,
    budget_bytes: int,
    *,
    sliding_blocks: int | None,
    max_rows: int,
    max_active_tokens: int,
    max_len: int,
    sliding_headroom_tokens: int = 0,
) -> dict[str, int]:
    """Blocks per group for a memory budget; the full group gets what the sliding group leaves. The sliding
    group gets ``sliding_blocks`` if given (CUSTOM_BACKEND_SLIDING_BLOCKS), else (window-aware default):

    - when the budget holds both groups' maxima (``_pool_maxima``: ``max_rows`` rows' windows plus one prefill
      chunk of headroom each, ``sliding_headroom_tokens``, see ``mixed_step.py``; and the full blocks of
      ``ceil(max_active_tokens / bs) + max_rows``), the sliding maximum;
    - otherwise (memory is tight) the split at which both pools run out together for requests of
      ``reference_tokens`` L: the sliding group gets the budget's share that one L-token request puts in
      sliding layers, ``budget * a * s // (a * s + b * f)`` bytes (``a``, ``b``: the request's sliding / full
      blocks, ``GroupGeometry.max_blocks``; ``s``, ``f``: bytes of one block), which admits
      ``budget // (a * s + b * f)`` such requests, the most any split admits; raised to what the full group
      cannot use (memory beyond its maximum) and capped at the sliding maximum. No chunk headroom then: at
      that concurrency a prefill chunk past its window runs shorter (``MixedStep`` halves it).

    Raises ConfigurationError if the budget cannot hold one block each."""
    per_block = {g.name: g.bytes_per_block(block_size, itemsize) for g in groups}
    total = sum(per_block.values())
    uniform = budget_bytes // total
    if uniform < 1:
        raise ConfigurationError(
            f"the KV budget ({budget_bytes} bytes) is smaller than one block in every layer ({total} bytes at "
            f"block size {block_size}); raise CUSTOM_BACKEND_KV_MEMORY_GB or CUSTOM_BACKEND_KV_BLOCKS"
        )
    sliding = next((g for g in groups if g.name == SLIDING), None)
    full = next((g for g in groups if g.name == FULL), None)
    if sliding is None or full is None:
        return {g.name: budget_bytes // per_block[g.name] for g in groups}
    s, f = per_block[SLIDING], per_block[FULL]
    one_window = GroupGeometry(block_size, sliding.window).max_blocks(max_len)
    if sliding_blocks is not None and sliding_blocks < one_window:
        raise ConfigurationError(
            f"CUSTOM_BACKEND_SLIDING_BLOCKS={sliding_blocks} cannot hold one request's sliding window: a request of "
            f"{min(max_len, sliding.window + block_size)} tokens or more needs {one_window} blocks of that pool "
            f"(window {sliding.window}, blocks of {block_size}); set at least {one_window}, or leave it unset "
            "(window-aware default)")
    if sliding_blocks is None:
        sliding_max, full_max = _pool_maxima(sliding, block_size, max_rows=max_rows,
                                             max_active_tokens=max_active_tokens, max_len=max_len,
                                             sliding_headroom_tokens=sliding_headroom_tokens)
        if sliding_max * s + full_max * f <= budget_bytes:
            sliding_blocks = sliding_max
        else:
            reference = reference_tokens(groups, block_size, itemsize, budget_bytes, max_rows=max_rows,
                                         max_active_tokens=max_active_tokens, max_len=max_len)
            a = GroupGeometry(block_size, sliding.window).max_blocks(reference)
            b = _cdiv(reference, block_size)
            balanced = budget_bytes * a // (a * s + b * f)
            unused_by_full = (budget_bytes - full_max * f) // s
            sliding_blocks = max(1, min(sliding_max, max(balanced, unused_by_full)))
    left = budget_bytes - sliding_blocks * s
    full_blocks = left // f
    if full_blocks < 1:
        raise ConfigurationError(
            f"CUSTOM_BACKEND_SLIDING_BLOCKS={sliding_blocks} uses the whole KV budget ({budget_bytes} bytes) and "
            f"leaves no full-attention block; lower it (uniform pools would have {uniform} blocks each)"
        )
    return {SLIDING: sliding_blocks, FULL: full_blocks}


def plan_pools_for_settings(config: GemmaTextConfig, settings: Any, block_size: int, itemsize: int, budget_bytes: int,
                            *, sliding_blocks: int | None, max_len: int) -> dict[str, int]:
    """``plan_pool_sizes`` with the arguments the backend derives from the core ``settings`` (``max_batch_size``,
    ``max_active_kv_tokens``, ``prefill_chunk_tokens``) and ``max_len`` (the longest request it admits): the
    one place the backend and the capacity report (``benchmarks/decode_model.py``) plan pools from settings."""
    groups = kv_groups(config)
    windows = [g.window for g in groups if g.window is not None]
    return plan_pool_sizes(
        groups, block_size, itemsize, budget_bytes, sliding_blocks=sliding_blocks, max_rows=settings.max_batch_size,
        max_active_tokens=settings.max_active_kv_tokens, max_len=max_len,
        # a tick's chunk keeps its first queries' sliding blocks until its forward ends
        sliding_headroom_tokens=min([settings.prefill_chunk_tokens, *windows]),
    )


class KVPools:
    """The pools of every group plus their block managers. Mutated by rows and the prefix cache (block
    references) and by the attention contexts (tensor contents); single-threaded (under the backend lock)."""

    def __init__(
        self,
        config: GemmaTextConfig,
        num_blocks: dict[str, int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.groups = {g.name: g for g in kv_groups(config)}
        if set(num_blocks) != set(self.groups):
            raise ValueError(f"num_blocks names {sorted(num_blocks)}, expected groups {sorted(self.groups)}")
        self.geometry = {name: GroupGeometry(block_size, g.window) for name, g in self.groups.items()}
        self.managers = {name: BlockManager(num_blocks[name]) for name in self.groups}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for name, group in self.groups.items():
            for layer, (heads, dim) in zip(group.layers, group.shapes):
                shape = (num_blocks[name] + 1, block_size, heads, dim)  # + the scratch block
                self.k[layer] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[layer] = torch.zeros(shape, dtype=dtype, device=device)
        sources = config.kv_source_layer
        self.group_of_layer = {i: config.layer_types[sources[i]] for i in range(config.num_hidden_layers)}
        self.reclaimer: Reclaimer | None = None
        # Told of every block copy made outside a forward, after it is queued (tensor parallel: rank 0 has the
        # worker ranks repeat it on their pools). None = nobody listens.
        self.copy_listener: Callable[[str, Sequence[int], Sequence[int]], None] | None = None
        self.live_rows: set[object] = set()  # every PagedKVCache not yet freed (for leak checks)
        self.releases = 0  # decref calls so far: a refcount may have dropped since a count was taken

    def first_visible(self, start: int) -> list[int]:
        """Per group (in ``groups`` order): the first key position a query at ``start`` sees, i.e. where the
        keys of a chunk appended at ``start`` begin."""
        return [self.geometry[group].first_visible(start) for group in self.groups]

    def scratch_block(self, group: str) -> int:
        """Id of ``group``'s scratch block (never allocated; padding rows of graph decode use it)."""
        return self.managers[group].num_blocks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def num_free(self, group: str) -> int:
        return self.managers[group].num_free

    def ensure_free(self, group: str, num: int) -> None:
        """Make ``num`` blocks of ``group`` free (the reclaimer evicts cached prefixes) or raise
        KVCapacityError, changing nothing the caller holds."""
        manager = self.managers[group]
        if manager.num_free < num and self.reclaimer is not None:
            self.reclaimer(group, num - manager.num_free)
        if manager.num_free < num:
            raise KVCapacityError(
                f"KV pool {group!r} is exhausted: need {num} free blocks, {manager.num_free} of "
                f"{manager.num_blocks} are free and the rest are held by running requests; admit requests "
                "through kv_reserve, or raise CUSTOM_BACKEND_KV_MEMORY_GB / CUSTOM_BACKEND_KV_BLOCKS"
            )

    def allocate(self, group: str, num: int) -> list[int]:
        """``num`` fresh blocks of ``group`` (refcount 1, owned by the caller); see ``ensure_free``."""
        self.ensure_free(group, num)
        return self.managers[group].allocate(num)

    def incref(self, group: str, block_ids: Sequence[int]) -> None:
        self.managers[group].incref(block_ids)

    def decref(self, group: str, block_ids: Sequence[int]) -> None:
        self.managers[group].decref(block_ids)
        self.releases += 1

    def refcount(self, group: str, block_id: int) -> int:
        return self.managers[group].refcount(block_id)

    def copy_blocks(self, group: str, sources: Sequence[int], targets: Sequence[int]) -> None:
        """K/V of block ``sources[i]`` into block ``targets[i]`` in every layer of ``group``: one multi-tensor copy
        queued on the device (no index tensors, no host sync). Both sides must be held by the caller."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} source blocks for {len(targets)} targets")
        if not sources:
            return  # nothing to copy here, nor to send to tensor-parallel workers
        into: list[torch.Tensor] = []
        out_of: list[torch.Tensor] = []
        for layer in self.groups[group].layers:
            for pool in (self.k[layer], self.v[layer]):
                for source, target in zip(sources, targets):
                    into.append(pool[target])
                    out_of.append(pool[source])
        torch._foreach_copy_(into, out_of)
        if self.copy_listener is not None:
            self.copy_listener(group, sources, targets)

    def check_integrity(self) -> None:
        """Each block manager is consistent and every pool has its group's block count (+ the scratch block)."""
        for name, group in self.groups.items():
            manager = self.managers[name]
            manager.check_integrity()
            for layer in group.layers:
                if self.k[layer].shape[0] != manager.num_blocks + 1 or self.v[layer].shape != self.k[layer].shape:
                    raise RuntimeError(f"KVPools: layer {layer} pools disagree with group {name!r}")


class BatchKVWrites:
    """Where one forward's storing layers put their new K/V: the pools at ``write_slots[group]`` (one flat slot
    per token of the batch, in order; scratch slots for padding and positions a group does not keep). The
    attention contexts of a forward (decode-only and ragged) hold one each, built per forward."""

    def __init__(self, pools: KVPools, write_slots: dict[str, torch.Tensor]) -> None:
        self.pools = pools
        self.write_slots = write_slots
        self._written: set[int] = set()  # storing layers whose K/V the model wrote through :meth:`target`

    def target(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k pool, v pool as rows [Hkv, D], write slots) of a storing layer, whose caller then writes its new K/V
        there itself and passes none to :meth:`store` (the AttentionContext's ``kv_cache_target``); None for
        KV-shared layers."""
        if self.pools.config.kv_source_layer[layer_idx] != layer_idx:
            return None
        self._written.add(layer_idx)
        return (*self._rows(layer_idx), self.write_slots[self.pools.group_of_layer[layer_idx]])

    def store(self, layer_idx: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Write a storing layer's new ``k``, ``v`` [B, S, Hkv, D] (B * S = the batch's tokens) with one indexed
        copy each; None for both when the layer's K/V went through :meth:`target`. Nothing for KV-shared
        layers."""
        if self.pools.config.kv_source_layer[layer_idx] != layer_idx:
            return
        if layer_idx in self._written:
            assert k is None and v is None, "the caller wrote this layer's K/V (kv_cache_target): pass none"
            return
        slots = self.write_slots[self.pools.group_of_layer[layer_idx]]
        assert k is not None and v is not None and k.shape[0] * k.shape[1] == slots.shape[0]
        k_rows, v_rows = self._rows(layer_idx)
        k_rows.index_copy_(0, slots, k.reshape(-1, *k.shape[2:]))
        v_rows.index_copy_(0, slots, v.reshape(-1, *v.shape[2:]))

    def _rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_pool, v_pool = self.pools.k[layer_idx], self.pools.v[layer_idx]
        return k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])
