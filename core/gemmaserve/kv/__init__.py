"""Paged-KV bookkeeping (block IDs only; the KV tensors live in backends).

- :class:`BlockManager`: free list + reference counts.
- :class:`RadixPrefixIndex`: block-aligned prefix -> one value per full block, LRU leaf eviction.
- :class:`ExactMatchIndex`: whole sequence -> all its block values, including a partial tail block.
- :class:`CacheManager`: the prefix cache backends drive (lookup / begin_store / commit_store).
- :mod:`gemmaserve.kv.events`: the prefix cache's changes as vLLM KV-cache events (ZMQ + msgpack).

Pure Python: importing this package never imports torch, numpy, zmq, msgpack or any backend library.
"""

from __future__ import annotations

from gemmaserve.kv.block_manager import BlockManager, BlockRefError, OutOfBlocksError
from gemmaserve.kv.cache_manager import BlockWrite, CacheManager, CacheStats, PrefixMatch, StorePlan
from gemmaserve.kv.exact_index import ExactEntry, ExactMatchIndex
from gemmaserve.kv.events import KVEventsConfig, VllmBlockHasher, ZmqEventPublisher, parse_kv_events_config
from gemmaserve.kv.radix import BlockValue, InsertResult, RadixMatch, RadixObserver, RadixPrefixIndex, StoredBlock

__all__ = [
    "BlockManager",
    "BlockRefError",
    "OutOfBlocksError",
    "RadixPrefixIndex",
    "RadixMatch",
    "InsertResult",
    "BlockValue",
    "RadixObserver",
    "StoredBlock",
    "ExactMatchIndex",
    "ExactEntry",
    "CacheManager",
    "PrefixMatch",
    "BlockWrite",
    "StorePlan",
    "CacheStats",
    "KVEventsConfig",
    "parse_kv_events_config",
    "VllmBlockHasher",
    "ZmqEventPublisher",
]
