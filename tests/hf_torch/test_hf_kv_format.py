"""KV layout and HF-format <-> paged-block conversion, and how prefill uses prefix-cache hits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from gemmaserve.errors import ModelLoadError
from gemmaserve.kv.cache_manager import BlockWrite, CacheManager
from gemmaserve_hf_torch.backend import HFTorchBackend
from gemmaserve_hf_torch.kv_cache.hf_format import BlockPools, DummyLayer, storing_layers

BLOCK = 4


def test_gemma4_layout_has_two_head_dims_and_no_kv_for_shared_layers(gemma4_backend: HFTorchBackend) -> None:
    layout = gemma4_backend.layout
    # layers 0, 1 sliding (head dim 16), 2 full (head dim 32); 3..5 reuse the KV of 1 and 2
    assert [(s.layer_idx, s.kv_heads, s.head_dim) for s in layout.stored] == [(0, 2, 16), (1, 2, 16), (2, 2, 32)]
    cache = layout.new_cache()
    # transformers < 5.23 has no DummyLayer: its caches stop before the shared tail
    shared = [DummyLayer] * 3 if DummyLayer is not None else []
    # the sliding layers keep every position but attend over their window (WindowedLayer, a DynamicLayer)
    assert [type(layer).__name__ for layer in cache.layers] == ["WindowedLayer"] * 2 + ["DynamicLayer"] + [
        layer.__name__ for layer in shared]
    assert all(isinstance(layer, DynamicLayer) for layer in cache.layers[:3])
    assert [getattr(layer, "sliding_window", None) for layer in cache.layers[:3]] == [s.window for s in layout.stored]
    assert layout.stored[0].window is not None and layout.stored[2].window is None
    layout.check_cache(layout.cache_from_tensors(layout.empty_tensors(2, 5)), 2, 5)


def test_storing_layers_from_config() -> None:
    from transformers import Gemma4TextConfig, Qwen3NextConfig

    gemma = Gemma4TextConfig(
        num_hidden_layers=6, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3
    )
    assert storing_layers(gemma) == [True, True, True, True, False, False]
    with pytest.raises(ModelLoadError, match="layer 0 uses cache layer LinearAttentionLayer"):
        storing_layers(Qwen3NextConfig(num_hidden_layers=4))  # hybrid linear-attention model


def test_llama_layout(llama_backend: HFTorchBackend) -> None:
    assert [(s.layer_idx, s.kv_heads, s.head_dim) for s in llama_backend.layout.stored] == [(0, 2, 16), (1, 2, 16), (2, 2, 16)]


def test_sliding_layers_keep_every_position(gemma4_backend: HFTorchBackend) -> None:
    with gemma4_backend.lock:
        result = gemma4_backend.prefill(list(range(20, 50)))  # 30 tokens, window 8
        lengths = [keys.shape[2] for keys, _ in gemma4_backend.layout.layer_tensors(result.kv.cache)]
        gemma4_backend.free_row_kv(result.kv)
    assert lengths == [30, 30, 30]


def test_pools_follow_the_cache_adapter(any_backend: HFTorchBackend) -> None:
    any_backend.set_cache_adapter(CacheManager(num_blocks=10, block_size=BLOCK))
    pools = any_backend.pools
    assert pools is not None
    for shape, keys, values in zip(any_backend.layout.stored, pools.keys, pools.values):
        assert tuple(keys.shape) == tuple(values.shape) == (10, BLOCK, shape.kv_heads, shape.head_dim)
    assert any_backend.kv_stats() == {"blocks_total": 10, "blocks_used": 0, "blocks_free": 10, "blocks_evictable": 0}
    any_backend.set_cache_adapter(None)
    assert any_backend.pools is None and any_backend.kv_stats() == {}


def test_pools_larger_than_the_device_are_refused_naming_the_setting(any_backend: HFTorchBackend) -> None:
    """PREFIX_CACHE_BLOCKS beyond the machine's memory: a ConfigurationError naming it, at once, instead of an
    allocation error traceback or the process being killed while the zeroed pools are touched."""
    import time

    from gemmaserve.errors import ConfigurationError

    start = time.perf_counter()
    with pytest.raises(ConfigurationError, match=r"PREFIX_CACHE_BLOCKS=10000000000 blocks .* need .* GiB .* lower "
                                                 r"PREFIX_CACHE_BLOCKS"):
        BlockPools(any_backend.layout, num_blocks=10**10, block_size=BLOCK)
    assert time.perf_counter() - start < 1.0


def test_block_round_trip_is_exact_and_touches_only_planned_slots(any_backend: HFTorchBackend) -> None:
    layout = any_backend.layout
    with any_backend.lock:
        result = any_backend.prefill(list(range(30, 41)))  # 11 tokens: blocks of 4, 4 and a tail of 3
        tensors = layout.layer_tensors(result.kv.cache)
        pools = BlockPools(layout, num_blocks=8, block_size=BLOCK)
        pools.write(tensors, [BlockWrite(5, 0, 4), BlockWrite(2, 4, 8), BlockWrite(7, 8, 11)])
        for (keys, values), (read_keys, read_values) in zip(tensors, pools.read([5, 2, 7], 11)):
            assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
        for (keys, _), (read_keys, _) in zip(tensors, pools.read([5, 2], 6)):
            assert torch.equal(read_keys, keys[:, :, :6])
        untouched = [0, 1, 3, 4, 6]
        assert all(not pool[untouched].any() for pool in (*pools.keys, *pools.values))
        assert all(not pool[7, 3:].any() for pool in pools.keys)  # the tail block's unused slot
        pools.check_integrity()
        any_backend.free_row_kv(result.kv)


class _CountingForward:
    """Wraps the backend's forward and records how many tokens each call feeds."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.fed = inner, []

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.fed.append(int(input_ids.shape[1]))
        return self.inner(input_ids, **kwargs)


def test_partial_and_full_hits_compute_only_what_is_missing(gemma4_backend: HFTorchBackend) -> None:
    backend = gemma4_backend
    backend.set_cache_adapter(CacheManager(num_blocks=32, block_size=BLOCK))
    prompt = list(range(60, 73))  # 13 tokens: 3 whole blocks + a tail of 1
    with backend.lock:
        cold = backend.prefill(prompt)
        assert cold.last_cache_hit_tokens == 0
        counter = backend.forward = _CountingForward(backend.forward)
        full = backend.prefill_lookup(prompt)
        assert (full.num_cached, backend.last_cache_hit_tokens, full.num_remaining) == (12, 12, 1)
        backend.prefill_chunk(full, full.num_remaining)
        torch.testing.assert_close(full.last_logits, cold.last_logits, atol=1e-5, rtol=0)
        partial = backend.prefill_lookup([*prompt[:10], 5, 6, 7])  # diverges inside block 2
        assert partial.num_cached == 8
        backend.prefill_chunk(partial, partial.num_remaining)
        assert counter.fed == [1, 5]
        unfinished = backend.prefill_lookup(prompt)
        with pytest.raises(ValueError, match="is_complete"):
            backend.prefill_store(unfinished)
        for state in (full, partial, unfinished, cold):
            backend.free_row_kv(state.kv)
    assert backend.cache_manager.stats().pinned_blocks == 0  # lookups release their match at once


def test_layout_without_dummy_layers_as_transformers_before_5_23(gemma4_backend: HFTorchBackend, monkeypatch) -> None:
    """transformers < 5.23 (the H200 image's 5.17) has no DummyLayer: a KV-shared model's cache ends at its last
    storing layer, and the shared tail is read as non-storing (the hf_torch package failed to import there)."""
    from transformers import Gemma4TextConfig

    from gemmaserve_hf_torch.kv_cache import hf_format

    monkeypatch.setattr(hf_format, "DummyLayer", None)
    layout = gemma4_backend.layout
    assert layout.cache_layers == 3
    cache = layout.new_cache()
    assert len(cache.layers) == 3 and all(isinstance(layer, DynamicLayer) for layer in cache.layers)
    layout.check_cache(layout.cache_from_tensors(layout.empty_tensors(2, 5)), 2, 5)

    class TruncatedCache:  # what DynamicCache(config=...) builds there: no layer for the shared tail
        def __init__(self, config: Any) -> None:
            kept = config.num_hidden_layers - config.num_kv_shared_layers
            self.layers = [DynamicLayer() for _ in range(kept)]

    monkeypatch.setattr(hf_format, "DynamicCache", TruncatedCache)
    gemma = Gemma4TextConfig(
        num_hidden_layers=6, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3
    )
    assert storing_layers(gemma) == [True, True, True, True, False, False]


def test_a_sliding_window_of_one_is_refused() -> None:
    from transformers import Gemma4TextConfig, MistralConfig

    gemma = Gemma4TextConfig(num_hidden_layers=2, num_kv_shared_layers=0, sliding_window=1,
                             layer_types=["sliding_attention", "full_attention"])
    for config in (gemma, MistralConfig(num_hidden_layers=2, sliding_window=1)):
        with pytest.raises(ModelLoadError, match="sliding_window=1"):
            storing_layers(config)
    assert storing_layers(MistralConfig(num_hidden_layers=2, sliding_window=2)) == [True, True]
