"""`BatchedPagedKVCache`: the decoding rows of the backend, in batch order.

It holds no device state: every decode step is a decode-only `MixedStep` tick, which describes the rows afresh
(`~.forward_batch.pack_tick`, or `~.decode_state.DecodeStaging` on the fixed buffers, whose table mirror
sends only what changed).
"""

from __future__ import annotations

import torch

from .paged_cache import PagedKVCache
from .pools import KVPools

__all__ = ["BatchedPagedKVCache"]


class BatchedPagedKVCache:
    """Rows in batch order (``pop`` behaves like ``list.pop``). Owns its rows: ``pop`` hands one back."""

    def __init__(self, pools: KVPools, device: torch.device) -> None:
        self.pools = pools
        self.device = device
        self.rows: list[PagedKVCache] = []

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, row: PagedKVCache) -> None:
        assert not row.freed and row.length > 0, "only live, non-empty rows join a batch"
        self.rows.append(row)

    def pop(self, index: int) -> PagedKVCache:
        return self.rows.pop(index)

    def check_integrity(self) -> None:
        """Rows are live and distinct."""
        if len(set(map(id, self.rows))) != len(self.rows) or any(row.freed for row in self.rows):
            raise RuntimeError("BatchedPagedKVCache: a row is duplicated or already freed")
