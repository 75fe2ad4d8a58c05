"""Session fixtures: tiny random Gemma checkpoints (built once per session) and cached HF reference models."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4, build_tiny_gemma4_k_eq_v, build_tiny_gemma4_moe

_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "gemma4": build_tiny_gemma4,
    "gemma4_k_eq_v": build_tiny_gemma4_k_eq_v,
    "gemma4_moe": build_tiny_gemma4_moe,
    "gemma3": build_tiny_gemma3,
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_checkpoint(name)` -> folder of the named tiny checkpoint (one of _BUILDERS), built on first use."""
    root = tmp_path_factory.mktemp("tiny_ckpts")

    @functools.cache
    def get(name: str) -> Path:
        return _BUILDERS[name](root / name)

    return get


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("gemma4")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("gemma3")


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path, torch.dtype], torch.nn.Module]:
    """`hf_reference(path, dtype)` -> transformers model (eager attention, eager experts), cached per session."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
        return model.eval()

    return load
