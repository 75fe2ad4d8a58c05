"""`BatchedPrefill`: the next chunks of several rows in one forward (one pass over the weights for all).

A prefill chunk of a few dozen tokens is memory-bound (it reads every weight once), so a burst of requests that
each prefill a short chunk — prefix hits computing only their own suffix, say — costs a full weight pass per
request when run one by one. `BatchedPrefill` pads the chunks of ``R`` rows to ``[R, S]`` and runs one eager
forward with a `WarmPrefillContext` (each layer writes the chunks' K/V into the pools, then gathers every
row's visible keys through a padded ``[R, K]`` slot table and attends with the position mask), so ``R`` chunks
cost about one.

Rows may be cold (empty) or warm; each chunk must be no longer than the narrowest window (then it stores every
position it computes) and than ``max_chunk`` (``MAX_BATCHED_CHUNK_TOKENS``: longer chunks are compute-bound and
replay faster one by one as CUDA graphs), and keys per group are capped (``max_keys``). Sub-batches hold at most ``max_tokens``
padded tokens. Sliding blocks leaving the window are released after the forward (the chunks' first queries
still read them). Results equal the one-row prefill up to matmul rounding (other shapes, other kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .kv.paged_cache import PagedKVCache
from .kv.pools import KVPools
from .models.gemma import GemmaForCausalLM
from .prefill_graphs import MAX_GRAPH_PREFILL_KEYS, WarmPrefillContext

__all__ = ["BatchedPrefill"]

MAX_BATCHED_PREFILL_TOKENS = 8192
"""Padded tokens (rows x longest chunk) per batched forward: bounds the activations (E2B: ~0.5 GiB)."""

MAX_BATCHED_PREFILL_KEYS = 131072
"""Gathered keys (rows x most keys of a row) per batched forward: bounds the attention's K/V copies (E2B full
layers, 8 query heads x 512 dims, bf16: ~1 GiB each for K and V at the limit)."""

MAX_BATCHED_CHUNK_TOKENS = 128
"""Longest chunk that joins a batch. A chunk costs about max(one pass over the weights, its FLOPs): E2B on an
H200 reads its 4.6 GB of weights in ~1.1 ms, the FLOPs of ~140 tokens. Shorter chunks (prefix-hit suffixes,
prompt tails) are memory-bound, so batching them saves a weight pass per row; longer ones are compute-bound
and run faster replayed one by one as CUDA graphs (causal SDPA, no dispatch) than in a masked eager batch
(H200 run 9: batching every 512-token chunk made 64 cold 1600-token prompts 2.9 s instead of 1.8 s)."""


class BatchedPrefill:
    """Batched eager prefill of several rows' chunks (see the module docstring). Not thread-safe (backend
    lock). ``min_rows``: fewer eligible rows than this are not worth a batch (the caller runs them one by
    one, e.g. through the CUDA-graph prefill)."""

    def __init__(self, model: GemmaForCausalLM, pools: KVPools, attention: Literal["eager", "sdpa"], *,
                 min_rows: int = 2, max_tokens: int = MAX_BATCHED_PREFILL_TOKENS,
                 max_keys: int = MAX_GRAPH_PREFILL_KEYS, max_chunk: int = MAX_BATCHED_CHUNK_TOKENS,
                 max_batch_keys: int = MAX_BATCHED_PREFILL_KEYS) -> None:
        if min_rows < 2 or max_tokens < 1 or max_keys < 1:
            raise ValueError(f"need min_rows >= 2 and positive limits, got {min_rows}, {max_tokens}, {max_keys}")
        self.model = model
        self.pools = pools
        self.attention = attention
        self.min_rows = min_rows
        self.max_tokens = max_tokens
        self.max_keys = max_keys
        self.max_batch_keys = max(max_batch_keys, max_keys)
        self.groups = list(pools.groups)
        windows = [g.window for g in pools.groups.values() if g.window is not None]
        self.max_chunk = min([max_chunk, max_tokens, *windows])
        self.device = next(iter(pools.k.values())).device
        self.batches = 0  # forwards run (for stats and tests)
        self.rows = 0  # row chunks served
        self.fallbacks = 0  # batches the backend ran one by one instead (a pool lacked the blocks; see pools.py)

    def applies(self, row: PagedKVCache, num_new: int) -> bool:
        """True if a chunk of ``num_new`` tokens appended to ``row`` can join a batch."""
        return 0 < num_new <= self.max_chunk and self.num_keys(row, num_new) <= self.max_keys

    def num_keys(self, row: PagedKVCache, num_new: int) -> int:
        """Keys the row's chunk gathers in its widest group."""
        return row.length + num_new - min(self.pools.first_visible(row.length))

    def plan(self, sizes: Sequence[int], keys: Sequence[int] | None = None) -> list[list[int]]:
        """Split chunk indices (in order) into sub-batches of at most ``max_tokens`` padded tokens and
        ``max_batch_keys`` gathered keys (rows x the most keys of a row; ``keys[i]`` of chunk ``i``)."""
        keys = keys if keys is not None else [0] * len(sizes)
        batches: list[list[int]] = []
        current: list[int] = []
        longest = widest = 0
        for index, (size, width) in enumerate(zip(sizes, keys)):
            rows = len(current) + 1
            if current and (rows * max(longest, size) > self.max_tokens or rows * max(widest, width) > self.max_batch_keys):
                batches.append(current)
                current, longest, widest = [], 0, 0
            current.append(index)
            longest, widest = max(longest, size), max(widest, width)
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def prefill(self, rows: Sequence[PagedKVCache], chunks: Sequence[Sequence[int]],
                want_logits: Sequence[bool]) -> list[Tensor | None]:
        """Append ``chunks[i]`` to ``rows[i]`` (each must satisfy :meth:`applies`) in one forward; returns
        per row its last position's logits [1, vocab] where ``want_logits[i]``, else None. Raises
        KVCapacityError if a pool lacks blocks (rows prepared so far keep blocks past their length, which
        their next append reuses). On any exception no row's length has moved, so each row can be redone
        alone (its prepared blocks are reused)."""
        count = len(rows)
        if not count or len(chunks) != count or len(want_logits) != count:
            raise ValueError(f"{count} rows, {len(chunks)} chunks, {len(want_logits)} logits flags")
        sizes = [len(c) for c in chunks]
        starts = [row.length for row in rows]
        for row, n in zip(rows, sizes):
            row.prepare_append(n, release=False)  # the chunks' first queries still read those blocks
        width = max(sizes)
        bs = self.pools.block_size
        ids = torch.zeros((count, width), dtype=torch.int64)
        positions = torch.zeros((count, width), dtype=torch.int64)
        write_slots, key_slots, key_positions = {}, {}, {}
        firsts = dict(zip(self.groups, zip(*(self.pools.first_visible(start) for start in starts))))
        for group in self.groups:
            scratch = self.pools.scratch_block(group) * bs
            keys = max(start + n - first for start, n, first in zip(starts, sizes, firsts[group]))
            write_slots[group] = torch.full((count, width), scratch, dtype=torch.int64)
            key_slots[group] = torch.full((count, keys), scratch, dtype=torch.int64)
            key_positions[group] = torch.full((count, keys), -1, dtype=torch.int64)
        for i, (row, chunk, start, n) in enumerate(zip(rows, chunks, starts, sizes)):
            end = start + n
            ids[i, :n] = torch.tensor(list(chunk), dtype=torch.int64)
            positions[i] = torch.arange(start, start + width).clamp_(max=end - 1)  # padding repeats the last
            for group in self.groups:
                write_slots[group][i, :n] = row.slots(group, start, end)
                first = firsts[group][i]
                key_slots[group][i, : end - first] = row.slots(group, first, end)
                key_positions[group][i, : end - first] = torch.arange(first, end)
        to_device = (lambda t: t.to(self.device, non_blocking=False))
        q_positions = to_device(positions)
        context = WarmPrefillContext(
            self.pools, q_positions, {g: to_device(t) for g, t in write_slots.items()},
            {g: to_device(t) for g, t in key_slots.items()}, {g: to_device(t) for g, t in key_positions.items()},
            self.attention)
        hidden = self.model.forward_hidden(to_device(ids), q_positions, context)
        wanted = [i for i in range(count) if want_logits[i]]
        out: list[Tensor | None] = [None] * count
        if wanted:
            index = torch.tensor(wanted, device=self.device)
            last = torch.tensor([sizes[i] - 1 for i in wanted], device=self.device)
            logits = self.model.compute_logits(hidden[index, last])
            for j, i in enumerate(wanted):
                out[i] = logits[j : j + 1]
        # lengths move only once nothing can raise any more, so a failed batch can be redone row by row
        for row, n in zip(rows, sizes):
            row.commit_append(n)
            row.release_out_of_window(0)
        self.batches += 1
        self.rows += count
        return out
