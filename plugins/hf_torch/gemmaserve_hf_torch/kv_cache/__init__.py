"""KV formats of the ``hf`` backend: HF per-layer cache tensors and the core's paged blocks."""

from __future__ import annotations

from gemmaserve_hf_torch.kv_cache.hf_format import BlockPools, CacheLayout, LayerShape, detect_layout, set_layer_kv

__all__ = ["BlockPools", "CacheLayout", "LayerShape", "detect_layout", "set_layer_kv"]
