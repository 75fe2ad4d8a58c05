"""Fixtures of the MLX backend tests: tiny checkpoints (built once per session) and backends."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason='needs mlx: pip install "gemmaserve[mlx]"')
pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).parent))

from mlx_checkpoints import BUILDERS, shared_builders


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(name)`` -> folder of a tiny checkpoint (``mlx_checkpoints.BUILDERS`` or
    ``gemma4_multimodal`` / ``gemma3_multimodal``), built on first use."""
    root = tmp_path_factory.mktemp("mlx_ckpts")

    @functools.cache
    def get(name: str) -> Path:
        if name in ("gemma4_multimodal", "gemma3_multimodal"):  # transformers 5's names: model.language_model.*
            return shared_builders().wrap_as_multimodal(get(name.removesuffix("_multimodal")), root / name)
        return BUILDERS[name](root / name)

    return get


@pytest.fixture(scope="session")
def gemma4_dir(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("gemma4")
