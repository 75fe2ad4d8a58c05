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


BUILDERS = {
    "gemma4": _build_gemma4,
    "gemma4_per_layer_config": build_gemma4_per_layer_config,
    "gemma4_k_eq_v": _build_gemma4_k_eq_v,  # K = V on full layers, one global KV head
    "gemma3": _build_gemma3,
    "llama": build_tiny_llama,
}
