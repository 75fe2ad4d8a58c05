"""Tiny random checkpoints for the MLX tests, written with transformers' ``save_pretrained``.

Gemma 4 / Gemma 3 (and the multimodal wrapper) come from the shared builders in
``tests/tiny_checkpoints.py`` (importable from every test folder: ``tests/`` is on the path
through the root conftest), and so does the Llama-style one.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["shared_builders", "build_tiny_llama", "build_gemma4_per_layer_config", "BUILDERS"]



def shared_builders() -> ModuleType:
    """The shared tiny-checkpoint builders (``tests/tiny_checkpoints.py``)."""
    import tiny_checkpoints

    return tiny_checkpoints


def build_tiny_llama(path: Path) -> Path:
    """The shared tiny Llama-style model (one head dim, GQA, full attention everywhere, untied head)."""
    return shared_builders().build_tiny_llama(path)


def build_gemma4_per_layer_config(path: Path) -> Path:
    """Gemma 4 with config.json exactly as transformers 5 writes it (``per_layer_config``, no
    ``global_head_dim``): mlx_lm alone would build 512-wide full-attention heads from it."""
    built = shared_builders().build_tiny_gemma4(path, hub_style=False)
    raw: dict[str, Any] = json.loads((built / "config.json").read_text())
    assert "per_layer_config" in raw and "global_head_dim" not in raw
    return built


def _build_gemma4(path: Path) -> Path:
    return shared_builders().build_tiny_gemma4(path)


def _build_gemma4_k_eq_v(path: Path) -> Path:
    return shared_builders().build_tiny_gemma4_k_eq_v(path)


def _build_gemma3(path: Path) -> Path:
    return shared_builders().build_tiny_gemma3(path)


def _without(path: Path, *keys: str, **replace: Any) -> Path:
    """Drop ``keys`` from config.json and set ``replace``: a sparser or older config of the same weights."""
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    for key in keys:
        raw.pop(key, None)
    (path / "config.json").write_text(json.dumps({**raw, **replace}, indent=2, sort_keys=True) + "\n")
    return path


def build_gemma4_without_layer_types(path: Path) -> Path:
    """Seven layers, one head size for both layer types and no ``layer_types`` in config.json: transformers makes
    layers 6 and 7 full (every 6th, and the last always), mlx_lm alone made layer 5 full."""
    types = ["sliding_attention"] * 5 + ["full_attention"] * 2
    built = shared_builders().build_tiny_gemma4(path, num_hidden_layers=7, layer_types=types, global_head_dim=16,
                                                num_kv_shared_layers=1)
    return _without(built, "layer_types")


def build_gemma3_legacy_rope_type(path: Path) -> Path:
    """Gemma 3 with a legacy ``rope_scaling`` spelled with ``type`` (no ``rope_type``), which transformers 5 reads
    as default RoPE and mlx_lm alone read as linear scaling."""
    built = shared_builders().build_tiny_gemma3(path, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500.0}})
    return _without(built, "rope_parameters", "layer_types", rope_theta=500.0, rope_local_base_freq=50.0,
                    sliding_window_pattern=3, rope_scaling={"type": "linear", "factor": 8.0})


BUILDERS = {
    "gemma4": _build_gemma4,
    "gemma4_per_layer_config": build_gemma4_per_layer_config,
    "gemma4_k_eq_v": _build_gemma4_k_eq_v,  # K = V on full layers, one global KV head
    "gemma3": _build_gemma3,
    "llama": build_tiny_llama,
    "gemma4_without_layer_types": build_gemma4_without_layer_types,
    "gemma3_legacy_rope_type": build_gemma3_legacy_rope_type,
}
