"""Reference-counted allocator of KV block IDs (the IDs only; backends own the tensors).

A block is *free* iff its reference count is 0. ``allocate`` hands out free blocks with count 1;
every holder (a cache entry, a pinned lookup, a running request...) adds one with ``incref`` and
gives it back with ``decref``. The block returns to the free list when the count reaches 0.
Every operation is O(1) per block. Not thread-safe: callers serialize access.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

__all__ = ["BlockManager", "OutOfBlocksError", "BlockRefError"]


class OutOfBlocksError(RuntimeError):
    """``allocate(n)`` was called with fewer than ``n`` free blocks (check ``can_allocate`` first)."""


class BlockRefError(RuntimeError):
    """A block ID was out of range, or referenced/released while free: a bookkeeping bug in the caller."""


class BlockManager:
    """Free list + per-block reference counts over blocks ``0 .. num_blocks - 1``.

    Blocks are handed out first-freed-first (FIFO), so a block just released stays untouched as long
    as possible. Failed calls raise before changing anything.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        """True if ``allocate(num)`` would succeed."""
        return 0 <= num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` free blocks; each gets reference count 1 and belongs to the caller.

        ``num == 0`` returns ``[]``. Raises :class:`OutOfBlocksError` if fewer than ``num`` are free.
        """
        if num < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num})")
        if num > len(self._free):
            raise OutOfBlocksError(f"need {num} KV blocks but only {len(self._free)} of {self._num_blocks} are free")
        block_ids = [self._free.popleft() for _ in range(num)]
        for block_id in block_ids:
            self._refcounts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference per occurrence. Every block must already be allocated."""
        block_ids = list(block_ids)
        refcounts, num_blocks = self._refcounts, self._num_blocks
        for block_id in block_ids:  # refcount()'s checks, inlined: a prefix hit increfs every block of the row
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self.refcount(block_id)  # raises BlockRefError naming the id
            if refcounts[block_id] == 0:
                raise BlockRefError(f"incref of free block {block_id}: allocate it first")
        for block_id in block_ids:
            refcounts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference per occurrence; returns the blocks that became free (in argument order).

        Raises :class:`BlockRefError` (changing nothing) if a block would drop below 0 references.
        """
        counts = Counter(block_ids)
        refcounts, num_blocks = self._refcounts, self._num_blocks
        for block_id, count in counts.items():
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self.refcount(block_id)  # raises BlockRefError naming the id
            held = refcounts[block_id]
            if held < count:
                raise BlockRefError(f"decref of block {block_id} {count} time(s) but it holds {held} reference(s)")
        freed: list[int] = []
        for block_id, count in counts.items():
            self._refcounts[block_id] -= count
            if self._refcounts[block_id] == 0:
                self._free.append(block_id)
                freed.append(block_id)
        return freed

    def refcount(self, block_id: int) -> int:
        """References held on ``block_id`` (0 = free)."""
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise BlockRefError(f"block id {block_id!r} is not in [0, {self._num_blocks})")
        return self._refcounts[block_id]

    def check_integrity(self) -> None:
        """Raise RuntimeError unless: the free list has no duplicates, a block is free iff its count
        is 0, and no count is negative (so free + referenced == total)."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("BlockManager: free list holds duplicate blocks (double free)")
        zero = {b for b, count in enumerate(self._refcounts) if count == 0}
        if zero != free_set:
            raise RuntimeError(
                "BlockManager: free list and zero refcounts disagree: "
                f"free-but-referenced={sorted(free_set - zero)}, leaked={sorted(zero - free_set)}"
            )
        if len(self._refcounts) != self._num_blocks or any(count < 0 for count in self._refcounts):
            raise RuntimeError("BlockManager: refcount table has the wrong size or a negative count")
