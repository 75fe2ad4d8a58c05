"""Paged KV of the custom_torch backend: pools, per-row block tables, batched decode state, prefix cache,
admission. See ``pools.py`` for the memory layout and the sliding-window rule."""

from .admission import KVAdmission
from .batched import BatchedPagedKVCache, DecodeState, PagedDecodeContext
from .paged_cache import PagedKVCache
from .pools import (GroupGeometry, KVGroupSpec, KVPools, kv_groups, plan_pool_sizes, plan_pools_for_settings,
                    reference_tokens)
from .prefix_cache import CachedBlock, PrefixCache

__all__ = [
    "BatchedPagedKVCache",
    "CachedBlock",
    "DecodeState",
    "GroupGeometry",
    "KVAdmission",
    "KVGroupSpec",
    "KVPools",
    "PagedDecodeContext",
    "PagedKVCache",
    "PrefixCache",
    "kv_groups",
    "plan_pool_sizes",
    "plan_pools_for_settings",
    "reference_tokens",
]
