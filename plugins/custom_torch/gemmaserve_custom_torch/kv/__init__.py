"""Paged KV of the custom_torch backend: pools, per-row block tables, the one-forward tick batch, prefix cache,
admission. See ``pools.py`` for the memory layout and the sliding-window rule."""

from .admission import KVAdmission
from .batched import BatchedPagedKVCache
from .decode_context import DecodeBatchContext
from .paged_cache import PagedKVCache
from .pools import (GroupGeometry, KVGroupSpec, KVPools, kv_groups, plan_pool_sizes, plan_pools_for_settings,
                    reference_tokens)
from .prefix_cache import CachedBlock, PrefixCache

__all__ = [
    "BatchedPagedKVCache",
    "CachedBlock",
    "DecodeBatchContext",
    "GroupGeometry",
    "KVAdmission",
    "KVGroupSpec",
    "KVPools",
    "PagedKVCache",
    "PrefixCache",
    "kv_groups",
    "plan_pool_sizes",
    "plan_pools_for_settings",
    "reference_tokens",
]
