"""Which layers of an mlx_lm model own a KV cache, their window and their K/V shapes.

Discovered from the model itself: ``mlx_lm.models.cache.make_prompt_cache`` lists one cache per
KV-owning layer (Gemma 4's KV-shared layers have none: they read an earlier layer's K/V), a
``KVCache`` for full attention and a ``RotatingKVCache(max_size=window)`` for sliding attention.
A one-token forward through those caches then gives each layer's KV heads, head sizes and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from gemmaserve.errors import ModelLoadError

__all__ = ["LayerSpec", "KVLayout", "discover_layout"]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One KV-owning layer: ``window`` tokens of sliding attention (None = full attention)."""

    window: int | None
    kv_heads: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The model's KV-owning layers in cache-list order, and the KV dtype."""

    layers: tuple[LayerSpec, ...]
    dtype: mx.Dtype

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(spec.window for spec in self.layers)

    def bytes_per_token(self) -> int:
        size = self.dtype.size
        return sum(spec.kv_heads * (spec.key_dim + spec.value_dim) * size for spec in self.layers)


def discover_layout(model: nn.Module) -> KVLayout:
    """Inspect ``model``'s caches (see module docstring). Raises ModelLoadError for cache kinds the
    batched backend cannot hold (recurrent state, quantized or chunked caches)."""
    caches = make_prompt_cache(model)
    windows: list[int | None] = []
    for index, cache in enumerate(caches):
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            windows.append(int(cache.max_size))
        else:
            raise ModelLoadError(
                f"layer {index} uses an mlx_lm {type(cache).__name__}, which BACKEND=mlx cannot batch; "
                "use BACKEND=mlx-stream"
            )
    if not caches:
        raise ModelLoadError("the model has no KV-caching layers; BACKEND=mlx cannot batch it")
    mx.eval(model(mx.array([[0]]), cache=caches))
    specs = []
    for window, cache in zip(windows, caches, strict=True):
        keys, values = cache.keys, cache.values
        specs.append(LayerSpec(window, int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])))
    return KVLayout(tuple(specs), caches[0].keys.dtype)
