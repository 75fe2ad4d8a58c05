"""Paged-KV bookkeeping (block IDs only; the KV tensors live in backends).

- :class:`BlockManager`: free list + reference counts.
- :class:`RadixPrefixIndex`: block-aligned prefix -> one value per full block, LRU leaf eviction.
- :class:`ExactMatchIndex`: whole sequence -> all its block values, including a partial tail block.
- :class:`CacheManager`: the prefix cache backends drive (lookup / begin_store / commit_store).

Pure Python: importing this package never imports torch, numpy or any backend library.
"""

from __future__ import annotations

from gemmaserve.kv.block_manager import BlockManager, BlockRefError, OutOfBlocksError
from gemmaserve.kv.cache_manager import BlockWrite, CacheManager, CacheStats, PrefixMatch, StorePlan
from gemmaserve.kv.exact_index import ExactEntry, ExactMatchIndex
from gemmaserve.kv.radix import BlockValue, InsertResult, RadixMatch, RadixPrefixIndex

__all__ = [
    "BlockManager",
    "BlockRefError",
    "OutOfBlocksError",
    "RadixPrefixIndex",
    "RadixMatch",
    "InsertResult",
    "BlockValue",
    "ExactMatchIndex",
    "ExactEntry",
    "CacheManager",
    "PrefixMatch",
    "BlockWrite",
    "StorePlan",
    "CacheStats",
]
